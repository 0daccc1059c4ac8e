"""Does async training pay on this machine? configs/async_grpo.yaml run synchronously and asynchronously, side by side.

    python -m bench.async_overlap [--steps 20] [--rounds 2] [--no-docs]

Each setting is `python -m actor.demo --config configs/async_grpo.yaml` (the reward server on loopback, as `make demo`
runs it) with the overrides below; the rounds alternate the settings' order. Seconds per step are the median of
`timers/step_time` after the first two steps; the ratio is the synchronous run's median over the setting's, in the
same round. The table goes into docs/algorithms.md between its `bench:async` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "algorithms.md"
CONFIG = ROOT / "configs" / "async_grpo.yaml"
# (name, overrides); the demo gives the actor the cores the reward server leaves (1 of 2 here)
SETTINGS = [
    ("synchronous", ["ppo.async_grpo.enabled=false"]),
    ("async, age 0", ["ppo.async_grpo.max_trajectory_age_steps=0"]),
    ("async, age 1", []),
    ("async, age 1, actor 2 threads", ["num_threads=2"]),
    ("async, age 1, actor 2 threads, worker 1", ["num_threads=2", "ppo.async_grpo.num_threads=1"]),
]


def run(overrides: list[str], steps: int, run_dir: Path) -> tuple[float, float | None]:
    """(median seconds per step after the first two, mean generation_hidden_fraction or None)."""
    cmd = [sys.executable, "-m", "actor.demo", "--config", str(CONFIG), f"run_dir={run_dir}",
           f"ppo.max_num_steps={steps}", "checkpointing.enabled=false", "ppo.val_period=0", *overrides]
    result = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                         f"{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 2]
    hidden = [r["async/generation_hidden_fraction"] for r in rows if "async/generation_hidden_fraction" in r]
    return statistics.median(r["timers/step_time"] for r in rows), (sum(hidden) / len(hidden) if hidden else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-async")
    parser.add_argument("--no-docs", action="store_true", help="print the table only; leave docs/ alone")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the first two steps are not measured)")

    seconds: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    hidden: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    for r in range(args.rounds):
        order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
        for i, (name, overrides) in enumerate(order):
            print(f"round {r + 1}: {name} ...", flush=True)
            s, h = run(overrides, args.steps, args.out / f"round{r}-{i}")
            seconds[name].append(s)
            if h is not None:
                hidden[name].append(h)

    sync = seconds["synchronous"]
    lines = ["| setting | s/step (rounds) | sync / setting (rounds) | median | generation hidden |",
             "|---|---|---|---|---|"]
    for name, _ in SETTINGS:
        ratios = [a / b for a, b in zip(sync, seconds[name], strict=True)]
        shown = f"{sum(hidden[name]) / len(hidden[name]):.0%}" if hidden[name] else "-"
        lines.append(f"| {name} | {', '.join(f'{s:.3f}' for s in seconds[name])} | "
                     f"{', '.join(f'{x:.2f}x' for x in ratios)} | **{statistics.median(ratios):.2f}x** | {shown} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        stamp = (f"Measured by `python -m bench.async_overlap --steps {args.steps} --rounds {args.rounds}` on "
                 f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPU cores, no GPU.")
        block = f"<!-- bench:async -->\n{stamp}\n\n{table}\n<!-- /bench:async -->"
        text = DOC.read_text()
        if "<!-- bench:async -->" not in text:
            raise SystemExit(f"{DOC} has no bench:async markers")
        DOC.write_text(re.sub(r"<!-- bench:async -->.*<!-- /bench:async -->", lambda _: block, text, flags=re.DOTALL))
        print(f"wrote the table in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
