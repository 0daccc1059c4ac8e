"""Build the embedded default from scratch: tokenizer, SFT policy, reward model and prompt files.

Everything is trained locally on the synthetic task of `embedded.task` (nothing is downloaded), with
fixed seeds and a fixed torch thread count, so two builds on the same machine write identical files.
Layout of the output directory (see `build`):

    policy/          LlamaForCausalLM (safetensors) + generation_config.json + tokenizer files
    reward_model/    LlamaForSequenceClassification, num_labels=1 (safetensors) + tokenizer files
    prompts_train.jsonl, prompts_eval.jsonl    one {"prompt": "..."} per line
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from embedded import task
from serving.modeling import last_token_scores, per_token_scores

log = logging.getLogger(__name__)

SEED = 1234
BUILD_THREADS = 1  # fixed, so the floating-point reduction order (and so the weights) never varies
MAX_LENGTH = 64
N_TRAIN_PROMPTS, N_EVAL_PROMPTS = 2048, 256
POLICY_STEPS, POLICY_BATCH, POLICY_LR = 200, 64, 3e-3
RM_STEPS, RM_BATCH, RM_LR = 500, 128, 2e-3
RM_MAX_RESPONSE_WORDS = 24  # the reward model is trained on responses of 0-24 words
_IDS = {word: i for i, word in enumerate(task.VOCAB)}
_NOISE_TOKENS = (*task.TOPIC_WORDS, task.SEPARATOR, task.UNK, task.BOS, task.PAD)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `task.VOCAB`, split on whitespace; adds no <bos>/<eos> when encoding."""
    backend = Tokenizer(models.WordLevel(vocab=dict(_IDS), unk_token=task.UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=task.PAD,
        unk_token=task.UNK,
        bos_token=task.BOS,
        eos_token=task.EOS,
        model_max_length=MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """The shared tiny shape: hidden 64, 2 layers, 4 heads, MLP 128, 64 positions, vocab of `task.VOCAB`."""
    return LlamaConfig(
        vocab_size=len(task.VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_LENGTH,
        pad_token_id=_IDS[task.PAD],
        bos_token_id=_IDS[task.BOS],
        eos_token_id=_IDS[task.EOS],
        tie_word_embeddings=False,
        **overrides,
    )


def encode_batch(sequences: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Word lists -> (tokens int64 [B, S] right-padded with <pad>, lengths int64 [B])."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    tokens = torch.full((len(sequences), int(lengths.max())), _IDS[task.PAD], dtype=torch.long)
    for row, words in enumerate(sequences):
        tokens[row, : len(words)] = torch.tensor([_IDS.get(w, _IDS[task.UNK]) for w in words])
    return tokens, lengths


def sample_rm_response(rng: random.Random) -> tuple[list[str], bool]:
    """A reward-model training response (words, ended-with-<eos>?) whose positive fraction is spread
    uniformly over [0, 1]: 0-24 words, k ~ U{0..n} positives, degenerate (one word repeated) 25% of the
    time, stray topic/special tokens 10% of the time, truncated (no <eos>) 20% of the time."""
    n = rng.randint(0, 12) if rng.random() < 0.85 else rng.randint(13, RM_MAX_RESPONSE_WORDS)
    k = rng.randint(0, n)
    if rng.random() < 0.25:
        positives = [rng.choice(task.POSITIVE_WORDS)]
        others = [rng.choice(task.NEGATIVE_WORDS + task.FILLER_WORDS)]
    else:
        q = rng.random()
        positives = list(task.POSITIVE_WORDS)
        others = list(task.NEGATIVE_WORDS) * round(10 * q) + list(task.FILLER_WORDS) * round(20 * (1 - q))
        others = others or list(task.NEGATIVE_WORDS)
    words = [rng.choice(positives) for _ in range(k)] + [rng.choice(others) for _ in range(n - k)]
    rng.shuffle(words)
    if rng.random() < 0.1:
        for _ in range(rng.randint(1, 2)):
            words.insert(rng.randint(0, len(words)), rng.choice(_NOISE_TOKENS))
    return words, rng.random() < 0.8


def rm_batch(rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens int64 [B, S], lengths int64 [B], ground-truth rewards float32 [B]) for the reward model."""
    seqs, targets = [], []
    for _ in range(size):
        words, ended = sample_rm_response(rng)
        seqs.append(task.make_prompt(rng).split() + words + ([task.EOS] if ended else []))
        targets.append(task.positive_fraction(" ".join(words)))
    tokens, lengths = encode_batch(seqs)
    return tokens, lengths, torch.tensor(targets, dtype=torch.float32)


def policy_batch(rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids int64 [B, S], attention_mask int64 [B, S], labels int64 [B, S]) of SFT data:
    prompt + response + <eos>, labels -100 on prompt and padding."""
    seqs, prompt_lens = [], []
    for _ in range(size):
        prompt = task.make_prompt(rng).split()
        seqs.append(prompt + task.sample_response(rng, task.SFT_P_POSITIVE) + [task.EOS])
        prompt_lens.append(len(prompt))
    tokens, lengths = encode_batch(seqs)
    positions = torch.arange(tokens.shape[1])[None, :]
    mask = (positions < lengths[:, None]).long()
    labels = tokens.masked_fill((mask == 0) | (positions < torch.tensor(prompt_lens)[:, None]), -100)
    return tokens, mask, labels


def _train(model: torch.nn.Module, steps: int, lr: float, loss_fn: Callable[[int], torch.Tensor]) -> float:
    """AdamW with linear warm-up and cosine decay; `loss_fn(step)` computes one batch's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    loss = torch.tensor(0.0)
    with torch.enable_grad():
        for step in range(steps):
            loss = loss_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 100 == 0 or step == steps - 1:
                log.info("  step %d/%d loss %.4f", step + 1, steps, loss.item())
    model.eval()
    return float(loss.item())


def train_policy(seed: int = SEED) -> LlamaForCausalLM:
    """The SFT policy: next-token loss on response tokens of SFT data (25% positive words)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    rng = random.Random(seed)

    def loss_fn(step: int) -> torch.Tensor:
        input_ids, mask, labels = policy_batch(rng, POLICY_BATCH)
        return model(input_ids=input_ids, attention_mask=mask, labels=labels).loss

    _train(model, POLICY_STEPS, POLICY_LR, loss_fn)
    return model


def rm_scores(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reward read-out exactly as the reward server does it: float32 [B] from tokens [B, S], lengths [B]."""
    return last_token_scores(per_token_scores(model, tokens, lengths), lengths)


def train_reward_model(seed: int = SEED) -> LlamaForSequenceClassification:
    """The reward model: MSE regression of the positive fraction, read at the last valid token."""
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(tiny_llama_config(num_labels=1))
    rng = random.Random(seed + 1)

    def loss_fn(step: int) -> torch.Tensor:
        tokens, lengths, targets = rm_batch(rng, RM_BATCH)
        return torch.nn.functional.mse_loss(rm_scores(model, tokens, lengths), targets)

    _train(model, RM_STEPS, RM_LR, loss_fn)
    return model


@contextmanager
def deterministic_torch(threads: int = BUILD_THREADS) -> Iterator[None]:
    """Fixed thread count and deterministic algorithms for the duration of a build; the caller's
    settings and global torch RNG state are restored after."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng():
            yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def _write_prompts(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def build(out_dir: str | Path) -> None:
    """Train and write every asset into `out_dir` (created; normally an empty temporary directory)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    tokenizer = build_tokenizer()
    with deterministic_torch():
        log.info("training the SFT policy (%d steps)", POLICY_STEPS)
        policy = train_policy()
        policy.generation_config = GenerationConfig(
            bos_token_id=_IDS[task.BOS],
            eos_token_id=_IDS[task.EOS],
            pad_token_id=_IDS[task.PAD],
            max_new_tokens=16,
        )
        policy.save_pretrained(out / "policy")
        tokenizer.save_pretrained(out / "policy")
        log.info("training the reward model (%d steps)", RM_STEPS)
        reward_model = train_reward_model()
        reward_model.save_pretrained(out / "reward_model")
        tokenizer.save_pretrained(out / "reward_model")
    _write_prompts(out / "prompts_train.jsonl", task.make_prompts(N_TRAIN_PROMPTS, seed=SEED + 10))
    _write_prompts(out / "prompts_eval.jsonl", task.make_prompts(N_EVAL_PROMPTS, seed=SEED + 20))
    log.info("built the embedded default in %.1fs", time.monotonic() - start)
