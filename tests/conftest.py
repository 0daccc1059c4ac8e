"""Shared fixtures: one embedded-default build per test session, and per-test log folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.service_procs import ROOT

# Every process of the suite (servers, actors, pytest itself) shares the machine's cores: one torch thread each,
# read by torch when it starts. Oversubscribed cores make these tiny models many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def embedded_cache_dir() -> Path:
    """Where the session's embedded default lives ($PPO_SERVICES_CACHE, else .cache/test), not built yet; every
    server subprocess inherits PPO_SERVICES_CACHE."""
    return Path(os.environ.setdefault("PPO_SERVICES_CACHE", str(ROOT / ".cache" / "test")))


@pytest.fixture(scope="session")
def embedded_cache(embedded_cache_dir) -> Path:
    """Build (or reuse) the embedded default once."""
    cache = embedded_cache_dir
    from embedded import ensure_built

    ensure_built(cache)
    return cache


@pytest.fixture(scope="session")
def embedded_assets(embedded_cache):
    from embedded import ensure_built

    return ensure_built(embedded_cache)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


# The score statistics written into openrlhf_reward_model's config.json
OPENRLHF_MEAN, OPENRLHF_STD = 0.25, 2.0


def with_special_tokens(tokenizer, *, eos: bool = False):
    """`tokenizer` made to encode a text on its own as Llama's does, `<bos> text` (and, with `eos`, `<eos>` after
    it, as encoders close a text with [SEP]): the embedded tokenizer adds no special tokens."""
    from tokenizers import processors

    single = "<bos> $A <eos>" if eos else "<bos> $A"
    specials = [("<bos>", tokenizer.bos_token_id)] + ([("<eos>", tokenizer.eos_token_id)] if eos else [])
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tokenizer


@pytest.fixture(scope="session")
def openrlhf_reward_model(embedded_assets, tmp_path_factory) -> Path:
    """The embedded reward model as OpenRLHF saves a reward model trained with --normalize_reward: the head under
    `value_head` (its older default value_head_prefix) and `normalize_reward`, `mean` and `std` in config.json."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("openrlhf") / "rm"
    shutil.copytree(embedded_assets.reward_model, path)
    weights = load_file(path / "model.safetensors")
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["RewardModel"], normalize_reward=True, mean=OPENRLHF_MEAN, std=OPENRLHF_STD)
    (path / "config.json").write_text(json.dumps(config))
    return path

