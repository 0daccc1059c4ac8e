"""The embedded default: the task, the cached build, and whether PPO can learn from its models.

One build per session (about 45 s on one core), shared with the other tests (tests/conftest.py's
embedded_cache_dir: $PPO_SERVICES_CACHE, else .cache/test).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import embedded
from embedded import EmbeddedAssets, ensure_built, resolve_model, task
from embedded.build import rm_scores
from embedded.evaluate import policy_mean_reward, reward_model_report, sample_policy, score_samples
from serving.modeling import load_scalar_head_model, per_token_scores, vocab_sha256

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cache_dir(embedded_cache_dir: Path) -> Path:
    return embedded_cache_dir


@pytest.fixture(scope="session")
def assets(cache_dir: Path) -> EmbeddedAssets:
    return ensure_built(cache_dir)


def test_positive_fraction() -> None:
    assert task.positive_fraction("") == 0.0
    assert task.positive_fraction("   ") == 0.0
    assert task.positive_fraction("<eos>") == 0.0
    assert task.positive_fraction("good great happy") == 1.0
    assert task.positive_fraction("bad awful the") == 0.0
    assert task.positive_fraction("good bad") == 0.5
    assert task.positive_fraction("good  bad\tthe so") == 0.25
    assert task.positive_fraction("good <eos>") == 1.0  # special tokens are ignored
    assert task.positive_fraction("<unk> good <pad> bad") == 0.5
    assert task.positive_fraction("good river => xyzzy") == 0.25  # other words dilute


def test_task_sampling_is_seeded() -> None:
    prompts = task.make_prompts(50, seed=3)
    assert prompts == task.make_prompts(50, seed=3) != task.make_prompts(50, seed=4)
    for p in prompts:
        *topics, sep = p.split()
        assert sep == task.SEPARATOR and 2 <= len(topics) <= 5 and set(topics) <= set(task.TOPIC_WORDS)
    import random

    rng = random.Random(0)
    responses = [task.sample_response(rng, task.SFT_P_POSITIVE) for _ in range(2000)]
    assert all(3 <= len(r) <= 10 and set(r) <= set(task.RESPONSE_WORDS) for r in responses)
    mean = sum(task.positive_fraction(" ".join(r)) for r in responses) / len(responses)
    assert 0.22 < mean < 0.28


def test_tokenizer_round_trip(assets: EmbeddedAssets) -> None:
    tok = AutoTokenizer.from_pretrained(assets.tokenizer)
    assert len(tok) == len(task.VOCAB)
    specials = [tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id]
    assert tok.convert_ids_to_tokens(specials) == ["<pad>", "<unk>", "<bos>", "<eos>"]
    prompt, response = "river castle winter =>", "very good and sad"
    ids = tok(prompt)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == prompt.split()  # no <bos>/<eos> added
    full = ids + tok(response)["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(full, skip_special_tokens=True) == f"{prompt} {response}"
    assert tok("river foo")["input_ids"][1] == tok.unk_token_id
    tok.padding_side = "left"
    batch = tok(["river =>", "a b c =>"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2 and batch["attention_mask"][0] == [0, 0, 1, 1]
    rm_tok = AutoTokenizer.from_pretrained(assets.reward_model)
    assert vocab_sha256(rm_tok) == vocab_sha256(tok)


def test_resolve_model(assets: EmbeddedAssets, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                       tmp_path: Path) -> None:
    assert resolve_model("embedded:policy", cache_dir) == str(assets.policy)
    assert resolve_model("embedded:reward", cache_dir) == str(assets.reward_model)
    monkeypatch.setenv(embedded.CACHE_ENV, str(cache_dir))
    assert resolve_model("embedded:reward") == str(assets.reward_model)
    assert resolve_model(str(assets.policy)) == str(assets.policy)  # a local directory
    assert resolve_model("org/model-name") == "org/model-name"  # a hub id, for from_pretrained
    monkeypatch.setenv("HOME", str(assets.root))
    assert resolve_model(f"~/{assets.policy.name}") == str(assets.policy)  # transformers would not expand it
    # what can only be a local path, with no directory there, is refused naming the key (transformers would report
    # a malformed hub id)
    (tmp_path / "empty-model").mkdir()  # transformers would say "Unrecognized model", naming no key
    for spec, why in (("/some/local/dir", "no such directory"), ("./models/x", "no such directory"),
                      (str(tmp_path / "empty-model"), "an empty directory, where a model"),
                      ("~/nope", "no such directory"), (str(assets.prompts_train), "a file, where a model directory"),
                      ("embedded:critic", "unknown embedded model; expected 'embedded:policy' or 'embedded:reward'")):
        with pytest.raises(embedded.ModelNotFound, match=f"^policy.model_name={re.escape(spec)}: {why}"):
            resolve_model(spec, cache_dir, key="policy.model_name")
    for path in (assets.prompts_train, assets.prompts_eval):
        prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
        assert prompts and all(p.endswith(f" {task.SEPARATOR}") for p in prompts)


def test_cached_build_is_reused(assets: EmbeddedAssets, cache_dir: Path) -> None:
    marker = assets.root / embedded.MARKER
    before = marker.stat().st_mtime_ns
    start = time.monotonic()
    again = ensure_built(cache_dir)
    assert time.monotonic() - start < 1.0
    assert again == assets and marker.stat().st_mtime_ns == before


def test_concurrent_builds_build_once_and_match(assets: EmbeddedAssets, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Three processes start on an empty cache at once (as the critic server, reward server and actor
    do): exactly one builds, all get the same assets, and a second build gives the same files.

    The builds train for a few steps only (the step counts are module constants, set in each process): a full
    build takes about 45 s on one core, and every step runs the same deterministic code. The files that do not
    depend on training (tokenizer, prompts) equal the session's build."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO); import embedded.build as b; "
        "b.POLICY_STEPS = b.RM_STEPS = 3; "
        "from embedded import ensure_built; print(ensure_built(sys.argv[1]).root)"
    )

    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "a")], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "a" / assets.root.name)}
    assert sum("building the embedded default into" in err for _, err in outputs) == 1
    assert [p.name for p in (tmp_path / "a").iterdir() if p.name.startswith(".")] == []  # no temporary dirs left

    monkeypatch.setattr(embedded.build, "POLICY_STEPS", 3)  # the same short build again, here
    monkeypatch.setattr(embedded.build, "RM_STEPS", 3)
    ensure_built(tmp_path / "b")
    first, second, ours = (json.loads((root / embedded.MARKER).read_text())["files"]
                           for root in (tmp_path / "a" / assets.root.name, tmp_path / "b" / assets.root.name,
                                        assets.root))
    assert first == second  # weights included: the build is deterministic
    assert ours.keys() == first.keys()
    for name in ("policy/tokenizer.json", "policy/tokenizer_config.json", "prompts_train.jsonl",
                 "prompts_eval.jsonl"):
        assert ours[name] == first[name], name


def test_sft_policy_reward_is_low(assets: EmbeddedAssets) -> None:
    reward = policy_mean_reward(assets.policy, n=256, seed=123)
    assert 0.1 <= reward <= 0.45


def test_reward_model_is_accurate(assets: EmbeddedAssets) -> None:
    report = reward_model_report(assets.reward_model, seed=11, n=256)
    assert all(mae < 0.05 for mae in report.values()), report


@pytest.mark.parametrize("positive_bias", [0.0, 3.0])
def test_reward_model_tracks_policy_samples(assets: EmbeddedAssets, positive_bias: float) -> None:
    """RM scores of real policy samples match the ground truth, also for a policy pushed towards
    positive words (as PPO pushes it): the bias on positive-word logits lifts the reward to ~0.87."""
    tok = AutoTokenizer.from_pretrained(assets.policy)
    policy = AutoModelForCausalLM.from_pretrained(assets.policy).eval()
    reward_model = load_scalar_head_model(str(assets.reward_model)).eval()
    bias = {(tok.convert_tokens_to_ids(w),): positive_bias for w in task.POSITIVE_WORDS}
    samples = sample_policy(policy, tok, task.make_prompts(256, seed=5), seed=5, sequence_bias=bias)
    truth = torch.tensor([task.positive_fraction(" ".join(r)) for _, r, _ in samples])
    scores = score_samples(reward_model, samples)
    assert (scores - truth).abs().mean() < 0.05
    if positive_bias:
        assert truth.mean() > 0.75


@torch.no_grad()
def test_reward_model_ranks_positive_above_negative(assets: EmbeddedAssets) -> None:
    tok = AutoTokenizer.from_pretrained(assets.reward_model)
    reward_model = load_scalar_head_model(str(assets.reward_model)).eval()
    for prompt in task.make_prompts(8, seed=9):
        texts = [f"{prompt} good great happy love", f"{prompt} bad awful sad hate"]
        encoded = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
        tokens = torch.tensor(encoded)
        lengths = torch.tensor([len(e) for e in encoded])
        high, low = rm_scores(reward_model, tokens, lengths).tolist()
        assert high > 0.9 and low < 0.1 and high > low


@torch.no_grad()
def test_policy_initialises_a_critic(assets: EmbeddedAssets) -> None:
    critic = load_scalar_head_model(str(assets.policy)).eval()
    tokens, lengths = torch.tensor([[5, 6, 4, 30, 3], [5, 4, 3, 0, 0]]), torch.tensor([5, 3])
    values = per_token_scores(critic, tokens, lengths)
    assert values.shape == (2, 5) and values.dtype == torch.float32 and torch.all(values[1, 3:] == 0)
