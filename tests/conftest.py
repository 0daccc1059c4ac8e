"""Shared fixtures: one embedded-default build per test session, and per-test log folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.service_procs import ROOT

# Every process of the suite (servers, actors, pytest itself) shares the machine's cores: one torch thread each,
# read by torch when it starts. Oversubscribed cores make these tiny models many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Seconds each test file took in `make test ARGS=--durations=0` (2 workers, the durations of its tests summed), by which
# the files are scheduled; a file not listed counts as short. Only the order of the files depends on these.
FILE_SECONDS = {"test_algorithm_runs.py": 307, "test_critic_server.py": 210, "test_model_features.py": 209,
                "test_compile.py": 145, "test_faults.py": 137, "test_reward_server.py": 109, "test_end_to_end.py": 88,
                "test_security.py": 74, "test_async.py": 61, "test_bench_trl.py": 60, "test_generation.py": 38,
                "test_demo.py": 29, "test_multiturn.py": 26, "test_fuzz.py": 25, "test_bench_service_split.py": 22,
                "test_embedded.py": 14}


def pytest_collection_modifyitems(config, items):
    """Order the test files for `--dist loadfile --no-loadscope-reorder` (the Makefile's flags), where each worker takes
    the next file in this order when it is almost done with its last. The longest file that needs the embedded build
    comes first: the first worker builds it (about 45 s on one core) while the second runs every file that needs no
    build, instead of waiting on the build's lock. The rest follow longest first, so that the suite ends on short
    files rather than on one long file with the other worker idle. Tests keep their order within a file."""
    files: dict[Path, list] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    by_length = sorted(files, key=lambda f: -FILE_SECONDS.get(f.name, 0))
    needs_build = [f for f in by_length if any("embedded_cache_dir" in t.fixturenames for t in files[f])]
    free = [f for f in by_length if f not in needs_build]
    items[:] = [t for f in needs_build[:1] + free + needs_build[1:] for t in files[f]]


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

