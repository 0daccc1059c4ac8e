"""Sanity checks of a built embedded default: SFT-policy reward and reward-model accuracy.

Used by `python -m embedded`, the build log and the tests. All sampling is seeded.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from embedded import task
from embedded.build import encode_batch, rm_scores, sample_rm_response
from serving.modeling import load_scalar_head_model

Sample = tuple[list[str], list[str], bool]  # (prompt words, response words, ended with <eos>)


@torch.no_grad()
def sample_policy(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    seed: int,
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    sequence_bias: dict[tuple[int, ...], float] | None = None,
) -> list[Sample]:
    """Sample one response per prompt with HF `generate` (left-padded batch, do_sample, fixed seed).
    Response words stop before the first <eos>; `ended` says whether an <eos> was generated."""
    torch.manual_seed(seed)
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    tokenizer.padding_side = padding_side
    out = policy.generate(
        **batch,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        sequence_bias=sequence_bias,
    )
    samples = []
    for prompt, row in zip(prompts, out[:, batch["input_ids"].shape[1] :].tolist()):
        ended = tokenizer.eos_token_id in row
        row = row[: row.index(tokenizer.eos_token_id)] if ended else row
        samples.append((prompt.split(), tokenizer.convert_ids_to_tokens(row), ended))
    return samples


def response_text(words: list[str], tokenizer: PreTrainedTokenizerBase) -> str:
    """The text the actor would score: decode with special tokens skipped."""
    return tokenizer.decode(tokenizer.convert_tokens_to_ids(words), skip_special_tokens=True)


def policy_mean_reward(
    policy_dir: str | Path, n: int = 256, seed: int = 0, temperature: float = 1.0
) -> float:
    """Mean ground-truth reward of `n` policy samples, one per seeded prompt."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    samples = sample_policy(policy, tokenizer, task.make_prompts(n, seed), seed=seed, temperature=temperature)
    return sum(task.positive_fraction(response_text(r, tokenizer)) for _, r, _ in samples) / n


@torch.no_grad()
def score_samples(reward_model: PreTrainedModel, samples: list[Sample]) -> torch.Tensor:
    """Reward-model scores float32 [N] of prompt + response (+ <eos> if ended), read at the last token."""
    tokens, lengths = encode_batch([p + r + ([task.EOS] if e else []) for p, r, e in samples])
    return rm_scores(reward_model, tokens, lengths)


def eval_sets(seed: int, n: int = 512) -> dict[str, list[Sample]]:
    """Held-out reward-model test sets: `uniform` (training-like), `sft` (25% positive), `high` (80-100%
    positive), `ppo` (50-100% positive), `degenerate` (each response word 10x, with and without <eos>)."""
    rng = random.Random(seed)

    def prompt() -> list[str]:
        return task.make_prompt(rng).split()

    def high() -> list[str]:
        length = rng.randint(task.MIN_RESPONSE_WORDS, task.MAX_RESPONSE_WORDS)
        k = rng.randint(math.ceil(0.8 * length - 1e-9), length)
        words = [rng.choice(task.POSITIVE_WORDS) for _ in range(k)]
        words += task.sample_response(rng, 0.0, length - k)
        rng.shuffle(words)
        return words

    return {
        "uniform": [(prompt(), *sample_rm_response(rng)) for _ in range(n)],
        "sft": [(prompt(), task.sample_response(rng, task.SFT_P_POSITIVE), True) for _ in range(n)],
        "high": [(prompt(), high(), True) for _ in range(n)],
        "ppo": [(prompt(), task.sample_response(rng, rng.uniform(0.5, 1.0)), True) for _ in range(n)],
        "degenerate": [(prompt(), [w] * 10, e) for w in task.RESPONSE_WORDS for e in (True, False)],
    }


def reward_model_mae(reward_model: PreTrainedModel, samples: list[Sample]) -> float:
    """Mean absolute error of the reward model against `task.positive_fraction` on `samples`."""
    truth = torch.tensor([task.positive_fraction(" ".join(r)) for _, r, _ in samples])
    return float((score_samples(reward_model, samples) - truth).abs().mean())


def reward_model_report(reward_model_dir: str | Path, seed: int = 0, n: int = 512) -> dict[str, float]:
    """MAE per held-out set of `eval_sets`, plus `all` (over every sample of every set)."""
    model = load_scalar_head_model(str(reward_model_dir), trained_head=True).eval()
    sets = eval_sets(seed, n)
    report = {name: reward_model_mae(model, samples) for name, samples in sets.items()}
    report["all"] = reward_model_mae(model, [s for samples in sets.values() for s in samples])
    return report
