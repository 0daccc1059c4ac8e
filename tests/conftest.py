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
def embedded_cache() -> Path:
    """Build (or reuse) the embedded default once; every server subprocess inherits PPO_SERVICES_CACHE."""
    cache = Path(os.environ.setdefault("PPO_SERVICES_CACHE", str(ROOT / ".cache" / "test")))
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
