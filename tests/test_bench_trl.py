"""The side-by-side benchmark against TRL (bench/trl_ppo.py) runs end to end at --tiny size: not timed, only that
both sides complete and the report comes out. Our side always runs (this venv); TRL's only where .venv-bench has
trl (`make bench-env`), since trl is never installed into the dev environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"


def trl_available() -> tuple[bool, str]:
    if not BENCH_PYTHON.exists():
        return False, f"{BENCH_PYTHON.relative_to(ROOT)} does not exist (make bench-env creates it)"
    probe = subprocess.run([str(BENCH_PYTHON), "-c", "import trl.experimental.ppo"], capture_output=True, text=True,
                           env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}, check=False)
    if probe.returncode != 0:
        return False, f"{BENCH_PYTHON.relative_to(ROOT)} cannot import trl.experimental.ppo: {probe.stderr[-300:]}"
    return True, ""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, bool, str]:
    """One --tiny run of W1 (4 PPO epochs, the critic trained every epoch: the most code paths): both sides when
    the bench environment has trl, else ours alone."""
    have_trl, why = trl_available()
    out = tmp_path_factory.mktemp("bench") / "result.json"
    cmd = [sys.executable, "-m", "bench.trl_ppo", "--tiny", "--workload", "W1", "--json", str(out)]
    cmd += ["--trl-python", str(BENCH_PYTHON)] if have_trl else ["--skip-trl"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result, have_trl, why


def test_our_side_runs_and_reports_its_phases(tiny_run):
    result, _, _ = tiny_run
    out = result.stdout
    assert "W1 training-heavy" in out
    assert re.search(r"round 1 ours: \d+ s wall, step times [\d.]+, [\d.]+", out), out
    assert "ours, median seconds per step by timer" in out and "train_time" in out, out
    assert "model passes and the decode step eager" in out, out
    # the actor's own generation counts, read back from its metrics.jsonl: every decode forward eager here
    forwards = re.search(r"decode forwards (\d+), (\d+) of them compiled", out)
    assert forwards and int(forwards[1]) > 0 and int(forwards[2]) == 0, out
    assert re.search(r"ours: \d+ GFLOP/step .* of peak", out), out


def test_trl_side_runs_and_ratios_are_printed(tiny_run):
    result, have_trl, why = tiny_run
    if not have_trl:
        pytest.skip(f"TRL side not run: {why}")
    out = result.stdout
    assert re.search(r"round 1 trl : \d+ s wall, step times [\d.]+, [\d.]+", out), out
    # the per-round row (flagged "(disturbed)" when other work on the machine competed: not timed here)
    assert re.search(r"^\s+1\s+trl\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x( +\(disturbed\))?$", out, re.MULTILINE), out
    assert re.search(r"median ours/TRL: [\d.]+x .* target >= 1.3x", out), out
    assert re.search(r"W1: [\d.]+x \(target >= 1.3x\)", out), out


def test_the_bf16_path_runs_on_both_sides_in_bf16():
    """--precision bfloat16, the GPU bench's setting, on the CPU at --tiny size: both sides in bf16 mixed precision
    (TRL's bf16=True on float32 trained weights) and the peak taken in bf16 (the --device cuda path needs a GPU)."""
    have_trl, _ = trl_available()
    cmd = [sys.executable, "-m", "bench.trl_ppo", "--tiny", "--workload", "W2", "--precision", "bfloat16"]
    cmd += ["--trl-python", str(BENCH_PYTHON)] if have_trl else ["--skip-trl"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "training efficiency vs the bfloat16 matmul peak" in result.stdout, result.stdout
    assert re.search(r"ours: \d+ GFLOP/step .* of peak", result.stdout), result.stdout
    if have_trl:
        assert "weights float32 on cpu, bf16 mixed precision" in result.stdout, result.stdout
