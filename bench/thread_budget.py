"""The thread budget side by side: `make demo`'s run with one torch thread per server and the rest to the actor,
against every process taking torch's default (one thread per core each), alternating, in one run.

    python -m bench.thread_budget [--repeats 2] [--config configs/ppo.yaml]

Prints the wall-clock seconds of each run (servers' start-up included) and of its training steps, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def demo(budget: str, config: str, run_dir: Path) -> tuple[float, float]:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "actor.demo", "--config", config, "--thread-budget", budget, f"run_dir={run_dir}",
           "checkpointing.enabled=false"]
    result = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return wall, sum(r["timers/step_time"] for r in rows if r["step"] > 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", default=str(ROOT / "configs" / "ppo.yaml"))
    args = parser.parse_args(argv)
    times: dict[str, list[tuple[float, float]]] = {"none": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for budget, runs in times.items():
                runs.append(demo(budget, args.config, Path(tmp) / f"{budget}-{i}"))
                wall, steps = runs[-1]
                print(f"--thread-budget {budget}: {wall:.1f} s wall, {steps:.1f} s in training steps", flush=True)
    med = {b: (statistics.median(w for w, _ in t), statistics.median(s for _, s in t)) for b, t in times.items()}
    print(f"\n{len(os.sched_getaffinity(0))} cores; medians of {args.repeats} runs each:")
    for b, (wall, steps) in med.items():
        print(f"  {b:5s} {wall:6.1f} s wall  {steps:6.1f} s steps")
    print(f"  budget speed-up: {med['none'][0] / med['auto'][0]:.2f}x wall, {med['none'][1] / med['auto'][1]:.2f}x steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
