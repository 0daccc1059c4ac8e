"""The embedded default: a tiny tokenizer, SFT policy and reward model, built locally on first use.

The task (see `embedded.task`): prompts are 2-5 topic words and "=>"; responses are positive, negative
and filler words; the reward is the fraction of positive words. The SFT policy says ~25% positive
words (mean reward ~0.25), and the reward model is accurate on every positive fraction, so PPO can
push the policy towards ~0.9 within minutes on a CPU.

    assets = ensure_built()                      # builds once (< 1 min), then reuses the cache
    resolve_model("embedded:policy")             # -> str path of the SFT policy checkpoint
    resolve_model("embedded:reward")             # -> str path of the reward-model checkpoint
    resolve_model("/some/dir") == "/some/dir"    # a local directory or a hub id is returned as it is

Assets live in `<cache>/embedded-v<N>/`, where <cache> is the `cache_dir` argument, else the
`PPO_SERVICES_CACHE` environment variable, else `~/.cache/ppo-services`. A build goes into a temporary
sibling directory that is renamed into place when complete, under a file lock, so processes that
start together build once and the others wait.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

BUILD_VERSION = 1  # bump whenever the task or the build changes, so stale caches are not reused
CACHE_ENV = "PPO_SERVICES_CACHE"
MARKER = "build.json"
EMBEDDED_PREFIX = "embedded:"

__all__ = ["CACHE_ENV", "CacheUnusable", "EmbeddedAssets", "default_cache_dir", "ensure_built", "resolve_model"]


@dataclass(frozen=True)
class EmbeddedAssets:
    """Paths of a complete build. `tokenizer` is the policy directory (every model dir has a copy)."""

    root: Path
    tokenizer: Path
    policy: Path
    reward_model: Path
    prompts_train: Path
    prompts_eval: Path

    @classmethod
    def at(cls, root: Path) -> EmbeddedAssets:
        return cls(
            root=root,
            tokenizer=root / "policy",
            policy=root / "policy",
            reward_model=root / "reward_model",
            prompts_train=root / "prompts_train.jsonl",
            prompts_eval=root / "prompts_eval.jsonl",
        )


def default_cache_dir() -> Path:
    """`$PPO_SERVICES_CACHE` if set (and non-empty), else `~/.cache/ppo-services`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ppo-services").expanduser()


def _is_complete(root: Path) -> bool:
    return (root / MARKER).is_file()


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _build_into(cache: Path, root: Path) -> None:
    """Build into a temporary sibling of `root`, write the marker last, then rename it into place.
    The caller holds the lock."""
    from embedded.build import build  # heavy imports (torch, transformers) only when building

    for stale in cache.glob(f".{root.name}.tmp-*"):
        log.warning("removing an incomplete build left behind: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if root.exists():  # a directory without marker: not ours, or damaged
        log.warning("removing incomplete assets at %s", root)
        shutil.rmtree(root)
    tmp = cache / f".{root.name}.tmp-{os.getpid()}"
    try:
        build(tmp)
        marker = {"version": BUILD_VERSION, "files": _file_hashes(tmp)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ModelNotFound(ValueError):
    """A model setting names no model: an unknown embedded name, a local path with no directory there, a file, or a
    spec transformers could not load (`naming_the_model`). The message names the setting's key."""


class CacheUnusable(ModelNotFound):
    """The embedded default cannot be built where its cache is: the message names the setting that chose it."""


def _check_writable(cache: Path, from_argument: bool) -> None:
    """Create `cache` and write in it, or raise CacheUnusable naming where it came from ($PPO_SERVICES_CACHE, the
    argument, or the default): a file there, or a path that cannot be created, failed deep in the build with a bare
    FileExistsError or FileNotFoundError."""
    setting = ("the cache directory" if from_argument else
               f"{CACHE_ENV}={os.environ[CACHE_ENV]}" if os.environ.get(CACHE_ENV) else
               f"the default cache {cache} (set {CACHE_ENV} to another directory)")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cache).close()
    except OSError as e:
        why = "a file, not a directory" if isinstance(e, FileExistsError | NotADirectoryError) else e.strerror or str(e)
        raise CacheUnusable(f"{setting}: cannot hold the embedded default models ({cache}: {why}); name a writable "
                            "directory") from None


def ensure_built(cache_dir: str | os.PathLike[str] | None = None) -> EmbeddedAssets:
    """Return the embedded assets, building them first unless a complete build is cached.

    Safe to call from several processes at once: one builds (about 30 s on one CPU core), the others
    block on `<cache>/embedded-v<N>.lock` until it is done and then reuse its result.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = cache / f"embedded-v{BUILD_VERSION}"
    if _is_complete(root):
        return EmbeddedAssets.at(root)
    _check_writable(cache, from_argument=cache_dir is not None)
    lock = FileLock(str(cache / f"{root.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is building the embedded default in %s; waiting", cache)
        lock.acquire()
    try:
        if not _is_complete(root):
            log.info("building the embedded default into %s", root)
            _build_into(cache, root)
    finally:
        lock.release()
    return EmbeddedAssets.at(root)




@contextlib.contextmanager
def naming_the_model(key: str, spec: str) -> Iterator[None]:
    """Within the block, an OSError of transformers loading the model `spec` (a hub id it could not fetch, a directory
    without a model's weights in it) or its ValueError (a directory without a tokenizer it can build) is raised again
    as ModelNotFound naming the setting `key`."""
    try:
        yield
    except ModelNotFound:
        raise
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"{key}={spec}: {e}") from e


def resolve_model(spec: str, cache_dir: str | os.PathLike[str] | None = None, key: str = "model") -> str:
    """Map `"embedded:policy"` / `"embedded:reward"` to the built checkpoint directories (building them
    if needed); return any other string (a local directory, `~` expanded, or a hub id) for `from_pretrained`.

    Raises ModelNotFound, naming `key`, for another `"embedded:..."` name (a typo), for an empty directory, and for a
    spec that can only be a local path (absolute, or starting with `.` or `~`) or is a file, where there is no
    directory: transformers would read it as a hub id and fail with a message about repository names.
    """
    if not spec.startswith(EMBEDDED_PREFIX):
        path = Path(spec).expanduser()
        if path.is_dir():
            if not any(path.iterdir()):  # transformers would say "Unrecognized model", naming no setting
                raise ModelNotFound(f"{key}={spec}: an empty directory, where a model (config.json and weights) or a "
                                    "tokenizer is expected")
            return str(path)
        if path.exists():
            raise ModelNotFound(f"{key}={spec}: a file, where a model directory (config.json and weights) or a hub "
                                "id is expected")
        if path.is_absolute() or spec.startswith((".", "~")):
            raise ModelNotFound(f"{key}={spec}: no such directory")
        return spec
    name = spec[len(EMBEDDED_PREFIX) :]
    if name not in ("policy", "reward"):
        raise ModelNotFound(f"{key}={spec}: unknown embedded model; expected 'embedded:policy' or 'embedded:reward'")
    assets = ensure_built(cache_dir)
    return str(assets.policy if name == "policy" else assets.reward_model)
