"""The actor's checkpoints on disk: where to resume from, what a checkpoint holds besides the policy, retention.

<run_dir>/checkpoints/step_N/ holds `actor/` (the policy in Hugging Face format), `optimizer.pt`, `rng.pt` (the
random generators' states) and `trainer_state.json` (step, data position, KL controller, the critic checkpoint of
the same step, the metric that ranks it, the config). It is written as tmp_step_N and renamed, so a directory named
step_N with a trainer_state.json is complete; tmp_step_* left by a crash are removed at the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from serving import checksums

from .config import CheckpointingConfig, RemoteConfig

log = logging.getLogger(__name__)

# The meanings of config keys a checkpoint was written under: raised when a key keeps its name but changes what it
# does, so that a resume across the change names it (MEANING_CHANGES) instead of training otherwise silently.
# 1: before 0.2.0. 2: ppo.policy_training_start_step and ppo.reward_shaping took NeMo-RL's meanings.
CONFIG_MEANINGS = 2
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"


class ResumeError(ValueError):
    """The checkpoint to resume from cannot be used; the message says which and why."""


class RunDirInUse(RuntimeError):
    """Another actor holds the run directory."""


class UnknownMetric(ValueError):
    """checkpointing.metric_name names no metric the run logs; the message lists those it does."""


def ranking_metric(name: str | None, metrics: dict[str, float] | None) -> float | None:
    """The value of checkpointing.metric_name among a step's metrics: None without a name or metrics, and where a
    validation metric is asked of a step without validation. A name missing from a step whose metrics could hold it
    raises UnknownMetric (keep_top_k would rank every checkpoint last and keep the oldest)."""
    if not name or not metrics:
        return None
    if name in metrics:
        return metrics[name]
    if name.startswith("val/") and not any(k.startswith("val/") for k in metrics):
        return None
    raise UnknownMetric(f"checkpointing.metric_name={name} is none of the metrics this run logs: "
                        f"{', '.join(sorted(k for k in metrics if not k.startswith('timers/')))}")


LOCK_FILE = ".lock"


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold <run_dir>/.lock (an exclusive flock, released by the kernel when this process ends, however it ends) for
    as long as the returned file stays open. A second actor on the same run_dir (a retried job, a second terminal)
    would resume from the first one's checkpoints and interleave its metrics and checkpoints with them: it is
    refused with RunDirInUse naming the holder's pid."""
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open until the process ends
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirInUse(f"run_dir={run_dir} is in use by another actor (pid {holder}): two runs in one directory "
                          f"would write over each other's metrics and checkpoints; stop it, or give this run its own "
                          f"run_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def is_step_name(name: str) -> bool:
    """Whether `name` is a checkpoint directory's: step_N."""
    return name.startswith("step_") and name.removeprefix("step_").isdigit()


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if is_step_name(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of)


ABANDONED = "abandoned"  # <run_dir>/checkpoints/abandoned/<when>/step_N: checkpoints of an attempt given up


def set_aside_after(root: Path, step: int) -> list[Path]:
    """Move the complete checkpoints of steps after `step` to <root>/abandoned/<UTC time>/, where no resume looks:
    a run resumed from an earlier checkpoint (or started over) goes on from `step`, and a later automatic resume
    must not pick up a checkpoint of the attempt it abandoned (its metrics rows are gone, its steps other).
    Returns where they went."""
    newer = [p for p in complete_checkpoints(root) if step_of(p) > step]
    if not newer:
        return []
    import datetime

    where = root / ABANDONED / datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    where.mkdir(parents=True)
    moved = []
    for path in newer:
        path.rename(where / path.name)
        moved.append(where / path.name)
    log.warning("the checkpoints of steps after %d (%s) belong to the attempt this run %s: moved to %s, where no "
                "resume looks (delete them when they are not needed)", step, ", ".join(p.name for p in newer),
                "started over from" if step == 0 else "resumed before", where)
    return moved


def remove_leftovers(root: Path) -> None:
    """Delete tmp_step_* directories a crash left half-written."""
    for tmp in root.glob("tmp_step_*") if root.is_dir() else []:
        log.info("removing the unfinished checkpoint %s", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def resume_point(cfg: CheckpointingConfig, root: Path) -> Path | None:
    """The checkpoint to continue from: checkpointing.resume auto (the latest complete one, if any), never, step_N
    (this run's checkpoint of step N, under `root`), or a checkpoint's path."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(cfg.resume).expanduser()
    if not (path / STATE_FILE).is_file() and is_step_name(cfg.resume) and (root / cfg.resume).is_dir():
        path = root / cfg.resume  # a bare step_N: this run's own checkpoint of that step
    if not (path / STATE_FILE).is_file():
        raise ResumeError(f"checkpointing.resume: {path} is no actor checkpoint (no {STATE_FILE}); expected auto, "
                          f"never, step_N (one of {root}) or the path of a step_N checkpoint directory")
    return path


@contextlib.contextmanager
def naming_the_checkpoint(directory: Path, what: str) -> Iterator[None]:
    """Reading `what` of checkpoint `directory` for a resume: any failure (a file cut short, not JSON, not a
    tokenizer's) is a ResumeError naming the checkpoint and the ways on."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - tokenizers' parse errors are plain Exceptions
        raise ResumeError(f"{directory}: {what} cannot be loaded ({type(e).__name__}: {e}){OTHER_CHOICES}") from None


OTHER_CHOICES = ("; resume from an earlier checkpoint (checkpointing.resume=<run_dir>/checkpoints/step_N) or start "
                 "over (checkpointing.resume=never)")


# Settings a resumed run may change without changing what it computes: where and how long it runs, what it logs
# and keeps, its servers' addresses and its thread budget
_REMOTE = (*RemoteConfig.model_fields, "url", "retries")  # how to reach a server (OpenRLHF's endpoint too)
_FREE_TO_CHANGE = ("run_dir", "host", "http_port", "auth_token_file", "num_threads", "logger.", "checkpointing.",
                   *(f"{server}.{key}" for server in ("critic", "reward") for key in _REMOTE),
                   "ppo.max_num_steps", "ppo.max_num_epochs", "ppo.val_period", "ppo.val_at_start", "ppo.val_at_end",
                   "ppo.max_val_samples", "policy.device")


def _policy_start(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    n = now.get("ppo", {}).get("policy_training_start_step", 0)
    if not n:
        return None
    return (f"ppo.policy_training_start_step={n} now means {n} critic-only steps (NeMo-RL's meaning, since 0.2.0); "
            f"this checkpoint was written when it meant {n - 1}, so the policy starts training one step later than "
            f"the run planned: set it to {n - 1} to keep the schedule")


def _both_penalties(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    shaping = saved.get("ppo", {}).get("reward_shaping", {})
    if not (shaping.get("enabled") and shaping.get("stop_properly_penalty_coef") is not None
            and shaping.get("overlong_buffer_length") is not None):
        return None
    return ("ppo.reward_shaping: this checkpoint was written when the stop-properly penalty and DAPO's overlong "
            "penalty applied together; since 0.2.0 only the stop-properly penalty applies when its coefficient is "
            "set (NeMo-RL's rule), so the shaped rewards differ from here on")


# (the CONFIG_MEANINGS that changed it, a check of the saved and the current config returning a warning or None)
MEANING_CHANGES = [(2, _policy_start), (2, _both_penalties)]


def meaning_changes(state: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What a resume from a checkpoint written under older config meanings (`config_meanings` in its state; absent
    before 0.2.0) computes otherwise than the run it continues, for the keys it sets."""
    written_under = int(state.get("config_meanings", 1))
    saved = state.get("config", {})
    return [why for version, check in MEANING_CHANGES if written_under < version
            and (why := check(saved, now)) is not None]


# Sections whose keys do nothing while their switch is off: a difference there changes nothing a run computes.
_SWITCHED = {"ppo.reward_shaping.": "ppo.reward_shaping.enabled"}


def changed_settings(saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """`key (was A, now B)` for each setting in which the config a checkpoint was saved with differs from this run's,
    other than those a resume may change freely. A key the saved config lacks (added by a later version) counts as
    changed only where this run's value is not its default (`defaults`: the config model's, same layout)."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    if not saved:  # a checkpoint that predates saving its config
        return []
    a, b, d = flat(saved), flat(now), flat(defaults or {})

    def switched_off(k: str) -> bool:  # off then and now (a default that moved between versions, say)
        return any(k.startswith(prefix) and k != switch and not a.get(switch) and not b.get(switch)
                   for prefix, switch in _SWITCHED.items())

    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not k.startswith(_FREE_TO_CHANGE)
                  and not (k not in a and k in d and b.get(k) == d[k]) and not switched_off(k))
    return [f"{k} (was {a[k]!r}, now {b.get(k)!r})" if k in a else f"{k} (not in the checkpoint's config, now "
            f"{b.get(k)!r})" for k in keys]


WEIGHTS_CRC32 = checksums.CRC32_KEY  # trainer_state.json's record of the checkpoint's files as written


def weight_sums(directory: Path) -> dict[str, str]:
    """CRC-32 of each weight file (*.safetensors) under checkpoint `directory` (the policy, an adapter, a merged
    copy), by path relative to it; `write_state` adds the optimizer and random-state files (serving/checksums.py)."""
    return checksums.sums(directory, ("actor*/*.safetensors", "actor*/config.json"))


def verify_weights(directory: Path) -> None:
    """Before a resume loads them: the weight, optimizer and random-state files are those the run wrote
    (ResumeError naming the first that is not). A checkpoint written before the sums were recorded, or whose
    trainer_state.json cannot be read (read_state says why), is not checked."""
    if (changed := checksums.recorded_change(directory, STATE_FILE)) is not None:
        raise ResumeError(f"{directory}: {changed}{OTHER_CHOICES}")


def write_state(directory: Path, state: dict[str, Any], optimizer: dict, rng: dict[str, Any]) -> None:
    """The optimizer and random states, then trainer_state.json with their CRC-32 added to `state`'s record."""
    summed = {OPTIMIZER_FILE: checksums.save_summed(optimizer, directory / OPTIMIZER_FILE),
              RNG_FILE: checksums.save_summed(rng, directory / RNG_FILE)}
    state = {**state, WEIGHTS_CRC32: {**state.get(WEIGHTS_CRC32, {}), **summed}}
    (directory / STATE_FILE).write_text(json.dumps(state, indent=2))


def read_state(directory: Path) -> tuple[dict[str, Any], dict, dict[str, Any]]:
    """(trainer state, optimizer state, rng states); the .pt files are loaded without unpickling code."""
    try:
        optimizer = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        rng = torch.load(directory / RNG_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means this checkpoint cannot be resumed
        raise ResumeError(f"{directory}: cannot load its optimizer or random states ({type(e).__name__}: {e})"
                          f"{OTHER_CHOICES}") from None
    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ResumeError(f"{directory}: cannot read its {STATE_FILE} ({type(e).__name__}: {e}){OTHER_CHOICES}") \
            from None
    return state, optimizer, rng


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, state: dict[str, Any], directory: Path,
                         settings: dict[str, Any]) -> None:
    """Load the optimizer state `saved` of checkpoint `directory` (trainer state `state`) into `optimizer`, with this
    run's `settings` (policy.optimizer.kwargs: learning rate, weight decay, betas, eps) over the saved ones, as the
    critic does: torch's load_state_dict restores the saved ones, so a resume with another learning rate trained
    on at the old one while its log named the change. The state holds one entry per trainable tensor, so a run
    that trains other tensors (another policy.num_layers_unfrozen, LoRA's target_modules) cannot take it:
    ResumeError naming the keys."""
    then = state.get("config", {}).get("policy", {})
    held = [len(g["params"]) for g in saved["param_groups"]]
    here = [len(g["params"]) for g in optimizer.param_groups]
    try:
        if held != here:
            raise ValueError(f"it holds {sum(held)} trainable tensors, this run trains {sum(here)}")
        optimizer.load_state_dict(saved)
        for group in optimizer.param_groups:
            group.update(settings)
    except ValueError as e:
        raise ResumeError(
            f"{directory}: its optimizer state does not fit this run's trainable parameters ({e}): resume with the "
            f"policy.num_layers_unfrozen ({then.get('num_layers_unfrozen')}) and policy.lora the run was started "
            "with, or checkpointing.resume=never") from None


def holds_its_critic(path: Path) -> bool:
    """Whether checkpoint `path` holds the critic's checkpoint of its step (False where the critic's Save failed)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return "critic_unsaved" not in state


def prune(root: Path, cfg: CheckpointingConfig) -> None:
    """With keep_top_k: keep the latest checkpoint, the k best by metric_name and the newest that holds its critic
    (a run whose critic Saves began failing can still resume exactly from it); delete the others."""
    if cfg.keep_top_k is None:
        return
    found = complete_checkpoints(root)
    if len(found) <= cfg.keep_top_k + 1:
        return
    latest = found[-1]
    paired = next((path for path in reversed(found) if holds_its_critic(path)), latest)

    def rank(path: Path) -> tuple[float, int]:  # the best first; without the metric last; ties: the newer first
        value = json.loads((path / STATE_FILE).read_text()).get("metric")
        if value is None:
            return float("-inf"), step_of(path)
        return (value if cfg.higher_is_better else -value), step_of(path)

    keep = {latest, paired, *sorted(found[:-1], key=rank, reverse=True)[: cfg.keep_top_k]}
    for path in found:
        if path not in keep:
            log.info("retention (keep_top_k=%d by %s): removing %s", cfg.keep_top_k, cfg.metric_name, path)
            shutil.rmtree(path, ignore_errors=True)
