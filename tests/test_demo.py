"""`make demo`'s command, run as a user runs it: the system must visibly learn within the time budget."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.service_procs import ROOT


def test_demo_learns_and_cleans_up(embedded_cache, tmp_path):
    run_dir = tmp_path / "demo"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "actor.demo", f"run_dir={run_dir}"], check=False, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]["train_rollouts/rewards"]
    last3 = sum(r["train_rollouts/rewards"] for r in rows[-3:]) / 3
    assert last3 - first >= 0.5 * (1.0 - first), f"reward {first:.3f} -> {last3:.3f} closes under half the gap"
    # The learned reward model must track the ground truth, or the curve would only show reward hacking.
    truth = sum(r["train_rollouts/reward/positive_fraction"] for r in rows[-3:]) / 3
    assert abs(truth - last3) < 0.1, (truth, last3)

    assert (run_dir / "reward_curve.png").is_file() and list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / f"step_{len(rows)}" / "actor" / "model.safetensors").is_file()
    run_id = (run_dir / "run_id").read_text().strip()  # critic checkpoints live in the run's namespace
    assert (run_dir / "checkpoints" / "critic" / f"{run_id}-step_{len(rows)}" / "model.safetensors").is_file()
    assert "samples before training" in out and "samples after training" in out
    assert "critic server stopped (exit code 0)" in out and "reward server stopped (exit code 0)" in out
    assert elapsed < 300, f"the demo took {elapsed:.0f} s; the budget is 5 minutes on 2 CPU cores"
