"""Where the actor's per-step metrics go: metrics.jsonl, TensorBoard, a progress bar, reward_curve.png,
and Prometheus gauges on the actor's own /metrics."""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from .generation import GENERATION_COUNTS

log = logging.getLogger(__name__)


class Timers:
    """Accumulating wall-clock timers, reported as `timers/<name>` seconds per step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    @contextmanager
    def only(self, name: str):
        """Time the block as `name` alone: timers run inside it are not counted (validation's generation is
        validation's time, not the step's `generate`, which the breakdown adds to it)."""
        saved, start = dict(self.totals), time.perf_counter()
        try:
            yield
        finally:
            self.totals = saved
            self.totals[name] = saved.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"timers/{k}": v for k, v in self.totals.items()}
        self.totals = {}
        return out


# (label, timers summed) of the step-time breakdown; "other" is the rest of the step (metrics, the advantage
# computation, Python between phases). A checkpoint is written after its step's row, outside the step's time.
PHASES = (
    ("generation", ("generate",)),
    ("log-probs", ("logprobs", "init_logprobs")),
    ("transfer", ("transfer",)),
    ("critic/reward wait", ("critic_wait",)),
    ("actor train", ("train_time",)),
    ("critic train wait", ("critic_train_wait",)),
    ("validation", ("validation_time",)),
)


def step_breakdown(step: int, metrics: dict[str, float]) -> str:
    """One line: where the step's wall-clock time went, by phase, with the critic's own training time (which
    overlaps the actor's training) in brackets; also stores timers/other in `metrics`."""
    total = metrics.get("timers/step_time", 0.0)
    parts, accounted = [], 0.0
    for label, names in PHASES:
        seconds = sum(metrics.get(f"timers/{n}", 0.0) for n in names)
        if seconds > 0 or label in ("generation", "actor train"):
            parts.append(f"{label} {seconds:.2f}")
            accounted += seconds
    metrics["timers/other"] = max(total - accounted, 0.0)
    parts.append(f"other {metrics['timers/other']:.2f}")
    critic = metrics.get("timers/critic_train")
    overlap = f" [critic trained {critic:.2f} s alongside]" if critic is not None else ""
    return f"step {step} time {total:.2f} s: " + " | ".join(parts) + overlap


def _readable_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a line that is not a JSON row with a step (the torn last line of a process killed, or
    a disk that filled, while writing it) is skipped with a warning naming it."""
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
                continue
        except json.JSONDecodeError:
            pass
        log.warning("%s:%d: not a whole metrics row (cut off by a crash?); left out: %.80r", path, lineno, line)
    return rows


# metric -> (Prometheus gauge, help) on the actor's /metrics
GAUGES = {
    "step": ("ppo_actor_step", "Last finished PPO step"),
    "train_rollouts/rewards": ("ppo_actor_reward_mean", "Mean reward of the last step's rollouts"),
    "train_rollouts/init_policy_kl": ("ppo_actor_init_policy_kl", "KL to the reference policy"),
    "train_optim/loss": ("ppo_actor_loss", "Actor loss of the last step"),
    "critic/loss": ("ppo_actor_critic_loss", "Critic loss of the last step"),
    "timers/step_time": ("ppo_actor_step_seconds", "Wall-clock seconds of the last step"),
    "async/buffer_size": ("ppo_actor_async_buffer_size", "Groups left in the async replay buffer"),
    "async/trajectory_age_max": ("ppo_actor_async_trajectory_age_max", "Oldest trained group's age in steps"),
    "async/evictions": ("ppo_actor_async_evictions", "Groups evicted as too old in the last step"),
}


class MetricsTracker:
    def __init__(self, run_dir: Path, total_steps: int, registry: CollectorRegistry, tensorboard: bool = True,
                 resume_step: int | None = None):
        """A new run rewrites metrics.jsonl; a resumed one keeps its rows up to `resume_step` and appends."""
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        kept: list[dict] = []
        if resume_step is not None and path.is_file():
            kept = [r for r in _readable_rows(path) if r["step"] <= resume_step]  # later rows are recomputed
            tmp = path.with_name(path.name + ".tmp")  # replaced whole, so a crash here cannot lose the rows kept
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            tmp.replace(path)
        self.jsonl = path.open("a" if resume_step is not None else "w", encoding="utf-8")
        # a resumed run hides the events a crashed attempt wrote past its checkpoint, as metrics.jsonl drops its rows
        purge = None if resume_step is None else resume_step + 1
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge) if tensorboard else None
        self.bar = tqdm(total=total_steps, initial=resume_step or 0, desc="ppo", unit="step", dynamic_ncols=True)
        self.history: list[dict] = [{k: (float("nan") if v is None else v) for k, v in r.items()} for r in kept]
        # each gauge is registered with the first value it gets: a run without a critic, or a synchronous one, exports
        # no critic or async series at all, rather than a 0 that reads as a perfect critic or an empty buffer
        self.registry, self.gauges = registry, {}
        # but for the step, which exists from the start: the last finished one (0 before any, as a resume found it)
        self.gauges["step"] = Gauge(*GAUGES["step"], registry=registry)
        self.gauges["step"].set(resume_step or 0)
        # per-step counts (what ran since the previous row) summed into Prometheus counters, for rate()
        self.counters = {f"generation/{name}": Counter(f"ppo_actor_generation_{name}", what, registry=registry)
                         for name, what in GENERATION_COUNTS.items()}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        # Strict JSON: a non-finite value (no tokens, every critic step skipped) is written as null.
        self.jsonl.write(json.dumps({k: v if math.isfinite(v) else None for k, v in record.items()}) + "\n")
        self.jsonl.flush()
        for k, v in record.items():
            if self.tb is not None and k != "step" and math.isfinite(v):
                self.tb.add_scalar(k, v, step)
            if k in GAUGES:
                if k not in self.gauges:
                    self.gauges[k] = Gauge(*GAUGES[k], registry=self.registry)
                self.gauges[k].set(v)
            elif k in self.counters and v > 0:
                self.counters[k].inc(v)
        if self.tb is not None:
            self.tb.flush()
        if step > 0:  # step 0 is validation before training
            self.bar.update(1)
        shown = {"reward": "train_rollouts/rewards", "kl": "train_rollouts/init_policy_kl", "critic": "critic/loss"}
        # what the run has: no critic=nan on a run without a critic (NaN reads as a failure)
        self.bar.set_postfix({name: f"{record[key]:.3f}" for name, key in shown.items() if key in record})

    def write(self, text: str) -> None:
        """Print above the progress bar."""
        self.bar.write(text)

    def plot_reward_curve(self) -> Path:
        # matplotlib's object API with the Agg canvas: no pyplot state or backend selection (a third of its import)
        from matplotlib.figure import Figure

        train = [r for r in self.history if "train_rollouts/rewards" in r]
        steps = [r["step"] for r in train]
        fig = Figure(figsize=(6, 3.5), dpi=120)
        ax = fig.add_subplot()
        ax.plot(steps, [r["train_rollouts/rewards"] for r in train], marker="o", label="reward (rollouts)")
        for key in sorted({k for r in train for k in r if k.startswith("train_rollouts/reward/")}):
            ax.plot(steps, [r.get(key, float("nan")) for r in train], linestyle="--",
                    label=key.removeprefix("train_rollouts/"))
        if any("val/rewards" in r for r in self.history):
            vs = [(r["step"], r["val/rewards"]) for r in self.history if "val/rewards" in r]
            ax.plot(*zip(*vs), marker="s", label="reward (validation)")
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.run_dir / "reward_curve.png"
        fig.savefig(path)
        return path

    def close(self) -> None:
        self.bar.close()
        for what, close in (("TensorBoard events", self.tb.close if self.tb is not None else None),
                            ("metrics.jsonl", self.jsonl.close)):
            try:
                if close is not None:
                    close()
            except OSError as e:  # a full disk: what was written stays; the error that stopped the run is reported
                log.warning("could not finish writing the %s in %s: %s", what, self.run_dir, e)
