"""The models both sides of `bench.trl_ppo` load: built here, locally and deterministically (no downloads), and
cached under .cache/bench/<shape>-v<N>/ (a build goes to a temporary directory renamed into place under a file
lock, so concurrent runs build once).

    tokenizer     character level: <pad> <eos> <bos> <unk> and the 95 printable ASCII characters (99 ids)
    policy/       LlamaForCausalLM (the reference is the same directory); hidden 256, 6 layers, 8 heads, MLP 768
    value/        LlamaForSequenceClassification, num_labels=1, same shape (critic_server --model, TRL value_model)
    reward/       LlamaForSequenceClassification, num_labels=1, same shape (reward_server --model, TRL reward_model)
    prompts.jsonl {"prompt": "<16 characters>"} per line: 16 tokens each, the same on both sides

Every model directory carries the tokenizer, so `AutoTokenizer.from_pretrained` works on each and the servers
report the same vocabulary as the actor (tokens are sent as ids, not text).

The policy is a random initialisation with one deliberate change. A random Llama puts nearly uniform probability
on every id, so it would sample <pad> about once per 99 tokens; TRL reads the first <pad> of a response as its end
(it masks every <pad> as padding), ours does not, so the two sides would score different sequences. The policy
therefore gets one constant feature: the last hidden dimension of every token embedding is set to 4 (the other
entries are ~0.02), which makes that dimension of the final normalised hidden state large and positive at every
position, and the lm_head rows of <pad>, <bos> and <unk> get a large negative weight on it, so their logits sit
~100 below the others and they are never sampled. <eos> keeps its natural ~1/96 chance per token: responses that
stop at EOS are then ~90 of 256 tokens long on average, spread like real ones (geometrically: many short, some
cut at 256). `python -m bench.trl_models` builds and prints the measured length distribution.
"""

from __future__ import annotations

import json
import random
import shutil
import string
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench"
BUILD_VERSION = 1  # bump when anything below changes, so a stale cache is not reused
SEED = 20260
PROMPT_TOKENS = 16
N_PROMPTS = 4096
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
CHARS = tuple(chr(c) for c in range(32, 127))  # printable ASCII: 95 characters
VOCAB = {tok: i for i, tok in enumerate((*SPECIALS, *CHARS))}
PAD_ID, EOS_ID, BOS_ID, UNK_ID = (VOCAB[t] for t in SPECIALS)
FEATURE_VALUE = 4.0  # the constant embedding feature (see the module docstring)
SUPPRESS_WEIGHT = -10.0  # lm_head weight of <pad>, <bos>, <unk> on it

# name -> (hidden, layers, heads, intermediate, max positions)
SHAPES = {
    "full": (256, 6, 8, 768, 512),
    "tiny": (32, 2, 4, 64, 64),
}


@dataclass(frozen=True)
class Assets:
    root: Path

    @property
    def policy(self) -> Path:
        return self.root / "policy"

    @property
    def value(self) -> Path:
        return self.root / "value"

    @property
    def reward(self) -> Path:
        return self.root / "reward"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    def read_prompts(self) -> list[str]:
        return [json.loads(line)["prompt"] for line in self.prompts.read_text().splitlines() if line.strip()]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; adds no special tokens when encoding; right padding."""
    backend = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        padding_side="right", clean_up_tokenization_spaces=False,
    )


def llama_config(shape: str, **extra: object) -> LlamaConfig:
    hidden, layers, heads, intermediate, positions = SHAPES[shape]
    return LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=positions,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False, **extra,
    )


def make_prompts(n: int = N_PROMPTS, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + string.digits + "     .,?"
    return ["".join(rng.choice(alphabet) for _ in range(PROMPT_TOKENS)) for _ in range(n)]


def _policy(shape: str) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config(shape))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, -1] = FEATURE_VALUE
        for tok in (PAD_ID, BOS_ID, UNK_ID):
            model.lm_head.weight[tok, -1] = SUPPRESS_WEIGHT
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    return model


def _scalar(shape: str, seed: int) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(llama_config(shape, num_labels=1))


def _build_into(tmp: Path, shape: str) -> None:
    tokenizer = build_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a fixed reduction order: identical files on every build
    try:
        for name, model in (("policy", _policy(shape)), ("value", _scalar(shape, SEED + 1)),
                            ("reward", _scalar(shape, SEED + 2))):
            model.save_pretrained(tmp / name)
            tokenizer.save_pretrained(tmp / name)
    finally:
        torch.set_num_threads(threads)
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts()))
    (tmp / "build.json").write_text(json.dumps({"version": BUILD_VERSION, "shape": shape, "seed": SEED}))


def ensure_built(shape: str = "full", cache: Path = CACHE) -> Assets:
    """The cached build of `shape`, built first if missing."""
    root = cache / f"{shape}-v{BUILD_VERSION}"
    if (root / "build.json").is_file():
        return Assets(root)
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f"{root.name}.lock")):
        if not (root / "build.json").is_file():
            tmp = cache / f".tmp-{root.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            _build_into(tmp, shape)
            tmp.rename(root)
    return Assets(root)


def matmul_params(config: LlamaConfig, head_outputs: int) -> int:
    """Parameters that take part in matmuls per token (every linear layer; not the embedding lookup, not the
    norms): the 6 * params * tokens count of training FLOPs. head_outputs: vocab for the policy, 1 for a value
    or reward head."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    return n * (2 * h * h + 2 * h * kv + 3 * h * i) + h * head_outputs


def response_lengths(assets: Assets, max_new_tokens: int, rows: int = 64, seed: int = 0) -> torch.Tensor:
    """Sample `rows` responses (temperature 1) from the policy; their lengths when stopping at EOS."""
    model = LlamaForCausalLM.from_pretrained(assets.policy, dtype=torch.float32).eval()
    tok = build_tokenizer()
    prompts = assets.read_prompts()[:rows]
    ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"] for p in prompts])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                             max_new_tokens=max_new_tokens, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    resp = out[:, ids.shape[1]:]
    hit = resp == EOS_ID
    first = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full((rows,), resp.shape[1]))
    specials = int(((resp == PAD_ID) | (resp == BOS_ID) | (resp == UNK_ID)).logical_and(
        torch.arange(resp.shape[1])[None, :] < first[:, None]).sum())
    print(f"{rows} responses of at most {max_new_tokens}: mean length {first.float().mean():.1f}, "
          f"median {first.float().median():.0f}, min {int(first.min())}, max {int(first.max())}, "
          f"{int((~hit.any(1)).sum())} cut at {max_new_tokens}; <pad>/<bos>/<unk> sampled {specials} times")
    return first


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the bench models and report the policy's response lengths.")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="full")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    built = ensure_built(args.shape)
    print(f"models in {built.root}")
    response_lengths(built, args.max_new_tokens)
