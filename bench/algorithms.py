"""Learning curves of every example config on the embedded task, side by side in one run.

    python -m bench.algorithms [--steps 20] [--configs ppo grpo ...]

Runs `python -m actor.demo --config configs/<name>.yaml` for each config (each starts the servers it needs on
loopback, as `make demo` does), then writes one plot of all curves (docs/algorithm_curves.png) and the table in
docs/algorithms.md between its `bench:algorithms` markers. The ground truth is the task's positive-word fraction
(`reward/positive_fraction`), which every config reports whatever it trains on.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["ppo", "grpo", "gdpo", "reinforce_pp", "dapo", "async_grpo", "multiturn"]
DOC = ROOT / "docs" / "algorithms.md"
PLOT = ROOT / "docs" / "algorithm_curves.png"
TRUTH = "train_rollouts/reward/positive_fraction"
# multi-turn episodes report no reward components: their reward is the reward model's score of the last answer, the
# closest measure of the same truth (the table says so)
EPISODE_TRUTH = "train_rollouts/rewards"


def truth(row: dict) -> float:
    return row[TRUTH] if TRUTH in row else row[EPISODE_TRUTH]


def run(name: str, steps: int, out: Path) -> tuple[list[dict], float]:
    run_dir = out / name
    cmd = [sys.executable, "-m", "actor.demo", "--config", str(ROOT / "configs" / f"{name}.yaml"),
           f"run_dir={run_dir}", f"ppo.max_num_steps={steps}", "checkpointing.enabled=false"]
    start = time.monotonic()
    result = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0], elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-algorithms")
    parser.add_argument("--no-docs", action="store_true", help="print the table only; leave docs/ alone")
    args = parser.parse_args(argv)

    results = {}
    for name in args.configs:
        print(f"running {name} ({args.steps} steps) ...", flush=True)
        results[name] = run(name, args.steps, args.out)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, (rows, _) in results.items():
        ax.plot([r["step"] for r in rows], [truth(r) for r in rows], marker="o", markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("positive-word fraction of rollouts")
    ax.set_title("embedded task, ground-truth reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()

    lines = ["| config | estimator | samples/step | truth, step 1 | truth, last 3 | gap to 1.0 closed | s/step | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (rows, elapsed) in results.items():
        first = truth(rows[0])
        last3 = sum(truth(r) for r in rows[-3:]) / len(rows[-3:])
        step_s = sum(r["timers/step_time"] for r in rows) / len(rows)
        lines.append(f"| `configs/{name}.yaml` | {_estimator(name)} | {int(rows[0]['train_rollouts/rollout_size'])} | {first:.3f} | "
                     f"{last3:.3f} | {(last3 - first) / max(1 - first, 1e-9):.0%} | {step_s:.2f} | {elapsed:.0f} |")
    if any(TRUTH not in rows[0] for rows, _ in results.values()):
        lines.append("")
        lines.append("Episodes (`multiturn.yaml`) report no reward components: their column is the learned reward model's "
                     "score of each episode's last answer.")
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        fig.savefig(PLOT)
        stamp = (f"Measured by `python -m bench.algorithms --steps {args.steps}` on {platform.machine()}, "
                 f"{_cpus()} CPU cores, no GPU; each config runs alone (servers included).")
        text = DOC.read_text()
        block = f"<!-- bench:algorithms -->\n{stamp}\n\n{table}\n<!-- /bench:algorithms -->"
        DOC.write_text(re.sub(r"<!-- bench:algorithms -->.*<!-- /bench:algorithms -->", lambda _: block, text,
                              flags=re.DOTALL))
        print(f"wrote {PLOT.relative_to(ROOT)} and the table in {DOC.relative_to(ROOT)}")
    plt.close(fig)
    return 0


def _estimator(name: str) -> str:
    sys.path.insert(0, str(ROOT))
    from actor.config import ActorConfig
    from serving.config import load_config

    return load_config(ActorConfig, ROOT / "configs" / f"{name}.yaml").ppo.adv_estimator.name


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
