"""`python -m actor --config FILE [key=value ...]`: run PPO against the critic and reward servers."""

from __future__ import annotations

from serving.startup import stop_at_once_until_serving

stop_at_once_until_serving("actor", "training began; the same command starts it again")  # first: imports take seconds

import errno
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from serving.config import parse_cli
from serving.startup import imports_without_gc

from .config import ActorConfig

FLAGS = {
    "--http-port": ("http_port", "REST port for /health, /ready, /metrics (0 disables)"),
    "--host": ("host", "interface of the REST endpoints"),
    "--run-dir": ("run_dir", "where metrics, TensorBoard events and checkpoints go"),
    "--auth-token-file": ("auth_token_file", "file holding the servers' bearer token (else $PPO_SERVICES_AUTH_TOKEN)"),
}


def _quiet_about_a_full_disk(args: threading.ExceptHookArgs) -> None:
    """TensorBoard's writer thread dies on a full disk with its own traceback; the training thread meets the same
    error at its next write and the run ends with one line saying so (main), so the thread's is left out."""
    from serving.errors import DISK_FULL

    if isinstance(args.exc_value, OSError) and args.exc_value.errno in DISK_FULL:
        return
    threading.__excepthook__(args)


def _error(message: str) -> None:
    """`error: <message>` on its own line of stderr while the step's progress bar may be drawn there (printed as is,
    it went on the bar's line, where `grep '^error:'` missed it)."""
    from tqdm import tqdm

    tqdm.write(f"error: {message}", file=sys.stderr)


def _under(path: object, directory: str) -> bool:
    """Whether `path` (an OSError's filename) lies in `directory`."""
    if not isinstance(path, str | bytes | os.PathLike):
        return False
    return Path(os.fsdecode(path)).resolve().is_relative_to(Path(directory).resolve())


def _stop_ids_past_the_vocabulary(cfg: ActorConfig) -> str | None:
    """The error for policy.generation.stop_token_ids the policy can never sample (an id at or past the vocabulary of
    its config.json, so the stop never fires), naming the key; None when they fit, or when the model's config cannot
    be read here (loading the model then says why)."""
    import transformers

    from embedded import ModelNotFound, resolve_model

    ids = cfg.policy.generation.stop_token_ids
    if not ids:
        return None
    try:
        path = resolve_model(cfg.policy.model_name, key="policy.model_name")
        model_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=cfg.policy.trust_remote_code)
    except (OSError, ValueError, ModelNotFound):
        return None
    vocab = getattr(model_config.get_text_config(), "vocab_size", None)
    past = [i for i in ids if vocab is not None and i >= vocab]
    if not past:
        return None
    return (f"policy.generation.stop_token_ids={ids}: {', '.join(map(str, past))} "
            f"{'is' if len(past) == 1 else 'are'} past the vocabulary of {cfg.policy.model_name} ({vocab} ids, 0 to "
            f"{vocab - 1}), so the policy can never sample {'it' if len(past) == 1 else 'them'} and the stop would "
            "never fire")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per reward POST (reward.source=openrlhf) otherwise
    cfg = parse_cli(ActorConfig, argv, "PPO actor: trains the policy against remote critic and reward servers.", FLAGS,
                    writes=("run_dir",))
    # torch and transformers only now: a config error above exits at once, not after seconds of imports
    with imports_without_gc():
        import transformers

        from embedded import ModelNotFound
        from serving.codec import retain_freed_memory
        from serving.errors import DISK_FULL  # a full disk: the run stops saying so, without a traceback
        from serving.modeling import CompileUnavailable, DeviceUnavailable
        from serving.rest import PortTaken, bind_failure
        from serving.security import SecurityError

        from .advantages import MissingRewardComponents
        from .async_rollouts import RolloutWorkerError
        from .checkpoints import ResumeError, RunDirInUse, UnknownMetric
        from .clients import IncompatibleServer, RemoteError
        from .data import DataError
        from .environments import BadEnvironment
        from .models import ModelSetupError
        from .rollouts import DynamicSamplingError, PolicyDiverged
        from .trainer import PPOTrainer

    transformers.utils.logging.disable_progress_bar()
    retain_freed_memory()  # large messages reuse warm pages (serving/codec.py)
    threading.excepthook = _quiet_about_a_full_disk

    if (why := _stop_ids_past_the_vocabulary(cfg)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    try:
        trainer = PPOTrainer(cfg)
    except SecurityError as e:  # a TLS or token file that cannot be used: a config error, exit 2 as the servers'
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PortTaken:
        print(f"error: {bind_failure(cfg.host, cfg.http_port, 'HTTP', 'http_port')}", file=sys.stderr)
        return 1
    except (RemoteError, IncompatibleServer, DataError, ResumeError, ModelSetupError, BadEnvironment,
            CompileUnavailable, DeviceUnavailable, ModelNotFound, RunDirInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        trainer.fit()
        # the run is complete and checkpointed: a SIGTERM from here on (a pod deleted as the job ends) would otherwise
        # end the process by the signal while it closes, or while the interpreter shuts down
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (RemoteError, IncompatibleServer, DynamicSamplingError, MissingRewardComponents, BadEnvironment,
            RolloutWorkerError, PolicyDiverged) as e:
        _error(f"{e}")
        return 1
    except UnknownMetric as e:  # a config error found at the first checkpoint: the checkpoint is written
        _error(f"{e}; the run stopped after its checkpoint, and resumes from it with the name corrected")
        return 2
    except OSError as e:
        refused = e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and _under(e.filename, cfg.run_dir)
        if e.errno not in DISK_FULL and not refused:
            raise
        _error(f"cannot write the run's files under {cfg.run_dir}: {e}; "
               f"{'make it writable' if refused else 'make room there'} and start the same command again: it resumes "
               f"from the latest complete checkpoint")
        return 1
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
