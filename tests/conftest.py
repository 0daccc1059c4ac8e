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


# Scheduling under xdist (`make test`: two workers, one test file each at a time, files handed out in the order
# below). The embedded build takes about 45 s on one core; the first test that needs it builds it and every other one
# that needs it waits. So the longest file that needs it goes first (one worker builds), then the files that need
# no build (the benches' harnesses, the unit tests: the other worker runs them meanwhile), then the rest longest
# first, so the two workers end close together. Seconds per file, measured on a 2-core machine with a cold inductor
# cache (`--junitxml`, summed per file, the build left out); a file not listed counts as short. Only the order
# depends on them: a stale figure costs balance, never a result.
_BUILD_FIXTURES = {"embedded_cache_dir"}
_SECONDS = {"test_algorithm_runs.py": 170, "test_faults.py": 130, "test_compile.py": 120, "test_critic_server.py": 100,
            "test_model_features.py": 90, "test_end_to_end.py": 75, "test_bench_trl.py": 65, "test_security.py": 60,
            "test_async.py": 50, "test_reward_server.py": 50, "test_embedded.py": 45, "test_bench_service_split.py": 25,
            "test_demo.py": 22, "test_fuzz.py": 22, "test_generation.py": 22, "test_multiturn.py": 18}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    builds = {file_of(item) for item in items if _BUILD_FIXTURES & set(getattr(item, "fixturenames", ()))}

    def seconds(f: str) -> int:
        return _SECONDS.get(Path(f).name, 5)

    first = min(builds, key=lambda f: (-seconds(f), f), default=None)

    def rank(item: pytest.Item) -> tuple[int, int, str]:
        f = file_of(item)
        return (0 if f == first else 1 if f not in builds else 2), -seconds(f), f

    items.sort(key=rank)  # stable: tests keep their order within a file
