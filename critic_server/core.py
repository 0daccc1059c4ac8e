"""The critic's model work, free of gRPC and HTTP: validation, value inference, training, checkpoints.

Every method except the validators runs on the server's single model thread (serving.batching).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import pickle
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from algorithms import explained_variance, masked_mean, value_loss
from embedded import naming_the_model, resolve_model
from serving import checksums, package_version
from serving.errors import (
    DISK_FULL,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ServiceError,
    StorageFull,
)
from serving.metrics import PassObserver, no_observer
from serving.modeling import (
    TORCH_DTYPES,
    RewardNormalization,
    attention_mask_from_lengths,
    by_length,
    compiled,
    copy_remote_code,
    last_token_scores,
    length_buckets,
    load_scalar_head_model,
    load_tokenizer,
    max_length_before_loading,
    max_length_of,
    mixed_precision,
    normalization_text,
    pad_and_stack,
    per_token_scores,
    resolve_device,
    reward_normalization,
    vocab_sha256,
    warm_up,
)
from serving.prepack import KeptPacking, prepacks_passes
from serving.validation import check_lengths, check_per_action, check_tokens, token_ids

from .config import CriticConfig
from .dedupe import Ticket, TrainResult, TrainWindow, same_request

log = logging.getLogger(__name__)

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # matched whole (fullmatch): ASCII only, no '/'
TAG_RULE = "1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"
TMP_PREFIX = ".tmp-"  # cannot collide with a tag, which never starts with '.'
OLD_PREFIX = ".old-"  # a checkpoint being replaced by a Save of the same tag, until the new one is in place
LEFTOVER_AGE_S = 60.0  # a .tmp-* or .old-* directory untouched this long at start-up is a Save's leftover
AUTOSAVE_PREFIX = "autosave-"  # the tags the critic gives its own checkpoints (autosave_every)
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "critic_state.json"
WEIGHT_FILES = ("*.safetensors", "config.json")  # the value model as save_pretrained writes it (sharded or not)
MAX_EPOCHS = 64  # passes over one Train's batch


@dataclass
class TrainInput:
    """One validated Train request: the batch and the value-loss settings it is trained with."""

    tokens: torch.Tensor  # int64 [B, S], right-padded
    lengths: torch.Tensor  # int64 [B]; S for every row when the request sends none
    returns: torch.Tensor  # float32 [B, S-1]
    old_values: torch.Tensor  # float32 [B, S-1]
    mask: torch.Tensor  # float32 [B, S-1], 0 or 1
    value_clip: float
    loss_scale: float
    epochs: int = 1  # passes over the batch
    fingerprint: str = ""  # of the request it came in (dedupe.fingerprint), kept with its result under its id


class CriticCore:
    def __init__(self, cfg: CriticConfig, observe_pass: PassObserver = no_observer):
        self.cfg = cfg
        self.observe_pass = observe_pass  # each forward pass's padded tokens, for /metrics
        self.device = resolve_device(cfg.device)
        self.train_step = 0
        self.instance_id = uuid.uuid4().hex  # tells clients this process apart from the one before a restart
        self.window = TrainWindow(cfg.train.dedupe_window)
        self.source = cfg.model  # where the weights came from, as GetInfo reports it
        self.unsaved = False  # a Train was applied since the last checkpoint (or the start)

    # --- loading --------------------------------------------------------------------------------
    def max_length_hint(self) -> int | None:
        """The max_length load() will find, from the configs of the checkpoint it will start from and of the reward
        model, without loading them; None when one cannot be read."""
        cfg = self.cfg
        latest = self._start_checkpoint()
        specs = [str(latest) if latest is not None else cfg.model, *([cfg.reward_model] if cfg.reward_model else [])]
        lengths = [max_length_before_loading(spec) for spec in specs]
        return None if None in lengths else min(lengths)

    def load(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        path = self._load_critic()
        self.model.eval()
        self.normalize_values = reward_normalization(self.model.config, cfg.normalize_values, "normalize_values", path,
                                                     role="critic model", outputs="values")
        if getattr(self.model.config, "normalize_reward", False) or self.normalize_values != RewardNormalization():
            # the checkpoints say how their values were trained, for a resume here and for OpenRLHF alike
            self.model.config.normalize_reward = self.normalize_values != RewardNormalization()
        self.scores = mixed_precision(compiled(per_token_scores, cfg.compile, "compile", self.device), self.device,
                                      TORCH_DTYPES[cfg.dtype])
        prepack = prepacks_passes("prepack_weights", cfg.prepack_weights, self.device, TORCH_DTYPES[cfg.dtype], "Infer")
        # packed at an Infer, kept until a Train or Load changes the weights (serving.prepack)
        self.value_packing = KeptPacking(self.model, cfg.batching.max_tokens_per_pass, prepack)
        self.reward_model = None
        if cfg.reward_model is not None:
            rm_path = resolve_model(cfg.reward_model, key="reward_model")
            with naming_the_model("reward_model", cfg.reward_model):
                self.reward_model = load_scalar_head_model(rm_path, TORCH_DTYPES[cfg.dtype], trained_head=True,
                                                           trust_remote_code=cfg.trust_remote_code)
                rm_tokenizer = load_tokenizer(rm_path, cfg.trust_remote_code)
            self.reward_model = self.reward_model.to(self.device).eval()
            self.reward_model.requires_grad_(False)
            if vocab_sha256(rm_tokenizer) != self.vocab_sha256:
                raise SystemExit(f"reward_model {cfg.reward_model} has a different tokenizer than model {cfg.model}")
            self.max_length = min(self.max_length, max_length_of(self.reward_model))
            self.normalize_reward = reward_normalization(self.reward_model.config, cfg.normalize_reward,
                                                         "normalize_reward", cfg.reward_model)
            self.reward_packing = KeptPacking(self.reward_model, cfg.batching.max_tokens_per_pass, prepack)
        if cfg.compile:  # compiled now, before ready, not at the first Infer and Train
            seconds = warm_up(self.scores, [self.model, *([self.reward_model] if self.reward_model else [])],
                              self.device, train=self.model, packed=self._packed)
            log.info("compile=true: Infer and Train passes compiled in %.1f s", seconds)
        log.info("critic %s loaded on %s (vocab %d, max length %d, combined RM: %s)",
                 cfg.model, self.device, self.vocab_size, self.max_length, cfg.reward_model)

    @contextlib.contextmanager
    def _packed(self) -> Iterator[None]:
        """The value model (and a combined reward model) on packed weights for the block, as Infer computes."""
        with self.value_packing.packed(), \
                self.reward_packing.packed() if self.reward_model is not None else contextlib.nullcontext():
            yield

    def _start_checkpoint(self) -> Path | None:
        """The checkpoint load() tries first: the newest of this server's with resume=latest, else None."""
        found = checkpoints_newest_first(Path(self.cfg.checkpoint_dir))[0] if self.cfg.resume == "latest" else []
        return found[0] if found else None

    def _tidy_checkpoint_dir(self) -> None:
        """Leftovers of Saves cut short (the process killed while it wrote), untouched for LEFTOVER_AGE_S: a
        checkpoint moved aside whose replacement never arrived goes back in place, and half-written ones are
        removed (each the size of a whole checkpoint). A Save in progress writes continuously, so a younger one is
        left alone (after a quick restart, the next Save's retention removes it)."""
        root = Path(self.cfg.checkpoint_dir)
        if not root.is_dir():
            return
        now = time.time()
        for entry in sorted(root.iterdir()):
            if entry.is_symlink() or not entry.is_dir() or not entry.name.startswith((TMP_PREFIX, OLD_PREFIX)):
                continue
            try:
                age = now - max(p.stat().st_mtime for p in (entry, *entry.rglob("*")))
            except OSError:
                continue
            if age < LEFTOVER_AGE_S:
                continue
            final = root / entry.name.removeprefix(OLD_PREFIX)
            if entry.name.startswith(OLD_PREFIX) and not final.exists():
                entry.rename(final)
                log.warning("put back %s, moved aside by a Save of the same tag that did not finish", final)
            else:
                shutil.rmtree(entry, ignore_errors=True)
                log.info("removed %s, left by a Save that did not finish", entry)

    def _load_critic(self) -> str:
        """Load the value model, its tokenizer and optimizer: with resume=latest from the newest of this server's
        checkpoints that loads whole (weights, optimizer state, train step), else from `model`. A checkpoint that
        cannot be loaded (a save cut short by a full disk, a damaged file) is logged and the next older one tried,
        so a damaged newest checkpoint neither crash-loops the server nor is passed over silently (the actor then
        reports the train steps lost, as for any restart); when every checkpoint fails the server exits naming them
        rather than start again from `model`. Returns the path loaded."""
        cfg = self.cfg
        self._tidy_checkpoint_dir()
        failed: list[str] = []
        found, unplaced = checkpoints_newest_first(Path(cfg.checkpoint_dir)) if cfg.resume == "latest" else ([], [])
        for entry in unplaced:
            log.error("%s holds a critic's %s but no readable %s with its saved_at: not resumed from", entry,
                      OPTIMIZER_FILE, STATE_FILE)
        for checkpoint in found:
            try:
                self._load_from(str(checkpoint))
            except Exception as e:  # noqa: BLE001 - any failure: try the next older checkpoint
                reason = in_brief(e)
                failed.append(f"{checkpoint} ({reason})")
                log.error("resume=latest: the checkpoint %s cannot be loaded (%s), trying the next older one",
                          checkpoint, reason)
                continue
            self.source = str(checkpoint.resolve())
            log.info("resume=latest: resumed from %s at train step %d, the newest checkpoint in %s that loads (not "
                     "model=%s)", self.source, self.train_step, cfg.checkpoint_dir, cfg.model)
            if failed:
                log.error("resume=latest: %d newer checkpoint(s) could not be loaded, so the critic resumed from an "
                          "older one and the train steps after it are lost: %s", len(failed), "; ".join(failed))
            return str(checkpoint)
        if failed:
            raise SystemExit(f"resume=latest: none of this critic's checkpoints in checkpoint_dir={cfg.checkpoint_dir} "
                             f"can be loaded: {'; '.join(failed)}. Move the damaged ones out of checkpoint_dir, or "
                             f"start again from model={cfg.model} with resume=never")
        log.info("starting from model=%s (%s)", cfg.model, "resume=never" if cfg.resume == "never" else
                 f"no checkpoint of this server in {cfg.checkpoint_dir}")
        path = resolve_model(cfg.model, key="model")
        with naming_the_model("model", cfg.model):
            self._load_from(path)
        return path

    def _load_from(self, path: str) -> None:
        """The value model (float32 weights, which the optimizer updates; its passes compute in `dtype` under
        autocast), tokenizer and optimizer from `path`, with the training state when it is one of our checkpoints."""
        cfg = self.cfg
        if (Path(path) / STATE_FILE).is_file():  # one of our own checkpoints: its files as the Save wrote them
            verify_files(Path(path))
        self.model = load_scalar_head_model(path, torch.float32, trust_remote_code=cfg.trust_remote_code)
        self.tokenizer = load_tokenizer(path, cfg.trust_remote_code)
        self.model = self.model.to(self.device)
        self.model_dir = path  # where its own model code (trust_remote_code) lies, copied into each checkpoint
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_length = max_length_of(self.model)
        self.vocab_sha256 = vocab_sha256(self.tokenizer)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        if (Path(path) / OPTIMIZER_FILE).is_file():  # one of our own checkpoints
            self._load_training_state(Path(path))
            log.info("resumed critic optimizer state at train step %d from %s (%d Train request ids remembered)",
                     self.train_step, path, len(self.window))

    def _load_training_state(self, path: Path) -> None:
        """Optimizer moments, train step and request-id window of checkpoint `path` (at start-up and on Load);
        the configured learning rate and weight decay win over the saved ones."""
        self._apply_training_state(*self._read_training_state(path))

    def _read_training_state(self, path: Path) -> tuple[dict, int, list]:
        """What `_apply_training_state` takes, read from checkpoint `path` and checked against this critic's
        optimizer, changing nothing; FailedPrecondition naming the file otherwise."""
        file = path / OPTIMIZER_FILE
        optimizer_state = load_optimizer_state(file)
        if (why := optimizer_state_misfit(optimizer_state, self.optimizer)) is not None:
            raise FailedPrecondition(f"{file}: does not fit this critic's optimizer: {why}")
        file = path / STATE_FILE
        try:
            state = json.loads(file.read_text())
            train_step, window = int(state["train_step"]), state.get("dedupe_window", [])
            if train_step < 0 or not isinstance(window, list):
                raise ValueError("train_step must be >= 0 and dedupe_window a list")
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise FailedPrecondition(f"{file}: not a critic state ({type(e).__name__}: {e})") from e
        return optimizer_state, train_step, window

    def _apply_training_state(self, optimizer_state: dict, train_step: int, window: list) -> None:
        self.optimizer.load_state_dict(optimizer_state)
        for group in self.optimizer.param_groups:
            group.update(lr=self.cfg.train.lr, weight_decay=self.cfg.train.weight_decay)
        self.train_step = train_step
        self.window.load_json(window, replace=True)  # the ids the checkpoint had applied

    def info(self) -> dict:
        return {
            "model": self.source,
            "vocab_size": self.vocab_size,
            "max_length": self.max_length,
            "train_step": self.train_step,
            "serves_rewards": self.reward_model is not None,
            "vocab_sha256": self.vocab_sha256,
            "max_batch_size": self.cfg.batching.max_batch_size,
            "instance_id": self.instance_id,
            "reward_model": self.cfg.reward_model or "",
            "reward_normalization": normalization_text(self.normalize_reward) if self.reward_model is not None else "",
        }

    # --- inference ------------------------------------------------------------------------------
    def validate_infer(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_tokens(tokens, "tokens", self.vocab_size, self.max_length, self.cfg.max_request_rows)
        check_lengths(lengths, "lengths", tokens.shape[0], tokens.shape[1])
        lengths = lengths.long()
        return token_ids(tokens, lengths, "tokens", self.vocab_size), lengths

    def values(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The critic's values [B, S] of right-padded rows, normalised as its checkpoint says (`normalize_values`);
        0 past each row's end."""
        values = self.scores(self.model, tokens, lengths)
        if self.normalize_values == RewardNormalization():
            return values
        return self.normalize_values(values) * attention_mask_from_lengths(lengths, values.shape[1])

    @torch.inference_mode()
    def infer_batch(self, requests: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Values [B_i, S_i] (and rewards [B_i] in combined mode) for each (tokens, lengths) request, computed
        in forward passes of at most max_batch_size rows and max_tokens_per_pass padded tokens, of similar length,
        each trimmed to its longest row (padding positions are 0 either way)."""
        tokens = pad_and_stack([t for t, _ in requests])
        lengths = torch.cat([n for _, n in requests])
        self.value_packing.pack()
        values = self._in_passes(self.values, tokens, lengths)
        rewards = None
        if self.reward_model is not None:
            self.reward_packing.pack()
            rewards = self.normalize_reward(self._in_passes(
                lambda t, n: last_token_scores(self.scores(self.reward_model, t, n), n), tokens, lengths))
        rows = [t.shape[0] for t, _ in requests]
        value_parts = values.split(rows)
        reward_parts = rewards.split(rows) if rewards is not None else [None] * len(rows)
        return [(v[:, :t.shape[1]], r) for (t, _), v, r in zip(requests, value_parts, reward_parts, strict=True)]

    def _in_passes(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                   lengths: torch.Tensor) -> torch.Tensor:
        """`fn` over the Infer batch in the passes the batching config cuts it into, each on /metrics."""
        return by_length(fn, tokens, lengths, self.cfg.batching.max_batch_size, self.device,
                         self.cfg.batching.max_tokens_per_pass, observe=functools.partial(self.observe_pass, "Infer"))

    # --- training -------------------------------------------------------------------------------
    def validate_train(self, tokens: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor,
                       lengths: torch.Tensor | None = None, value_clip: float | None = None,
                       loss_scale: float | None = None, epochs: int | None = None) -> TrainInput:
        """Check a Train request; `lengths`, `value_clip`, `loss_scale` and `epochs` are None when the request
        leaves them unset (all positions valid; the server's train.value_clip and train.loss_scale; 1 pass)."""
        if epochs is not None and not 0 <= epochs <= MAX_EPOCHS:
            raise InvalidArgument(f"epochs: expected 1 to {MAX_EPOCHS} passes over the batch (0 or unset: 1), "
                                  f"got {epochs}")
        check_tokens(tokens, "tokens", self.vocab_size, self.max_length, self.cfg.max_request_rows)
        b, s = tokens.shape
        if s < 2:
            raise InvalidArgument("tokens: need at least 2 positions per row to train on actions")
        shape = (b, s - 1)
        returns = check_per_action(returns, "returns", shape)
        old_values = check_per_action(old_values, "old_values", shape)
        mask = check_per_action(mask, "mask", shape, allow_bool=True)
        if not ((mask == 0) | (mask == 1)).all():
            raise InvalidArgument("mask: entries must be 0 or 1")
        if lengths is None:
            lengths = torch.full((b,), s, dtype=torch.long)
        else:
            check_lengths(lengths, "lengths", b, s)
            lengths = lengths.long()
            # Entry t is the action that produced token t+1, which must lie before lengths[b].
            past_end = (mask > 0) & (torch.arange(s - 1)[None, :] >= lengths[:, None] - 1)
            if past_end.any():
                row, t = (int(i) for i in past_end.nonzero()[0])
                raise InvalidArgument(f"mask: entries at positions >= lengths[b] - 1 must be 0 (no action past the "
                                      f"row's end), got mask[{row}, {t}] = 1 with lengths[{row}] = {int(lengths[row])}")
        tc = self.cfg.train
        value_clip = tc.value_clip if value_clip is None else _check_setting(value_clip, "value_clip", allow_zero=True)
        loss_scale = tc.loss_scale if loss_scale is None else _check_setting(loss_scale, "loss_scale", allow_zero=False)
        tokens = token_ids(tokens, lengths, "tokens", self.vocab_size)
        return TrainInput(tokens, lengths, returns, old_values, mask, value_clip, loss_scale, epochs or 1)

    def apply_train(self, request_id: str, deadline: float | None, batch: TrainInput,
                    ticket: Ticket) -> tuple[TrainResult, bool] | None:
        """Train on `batch` unless its request id was already applied (then: the stored result, True) or its
        caller left before this started (None). `deadline` is on time.monotonic()'s clock; past it, nothing is
        applied and DeadlineExceeded is raised. Remembers the id, then autosaves when a multiple of
        autosave_every steps was crossed. Returns (result, whether it is a repeat's stored result)."""
        if not ticket.start():
            return None
        if request_id and (stored := self.window.get(request_id)) is not None:
            return same_request(request_id, stored, batch.fingerprint), True
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("deadline exceeded before the model worker reached this Train; not applied")
        step_before = self.train_step
        loss, metrics, step = self.train(batch)
        result = TrainResult(loss, metrics, step, batch.fingerprint)
        if request_id and self.cfg.train.dedupe_window > 0:
            self.window.put(request_id, result)
        self.unsaved = True
        every = self.cfg.autosave_every
        if every > 0 and step // every > step_before // every:
            try:
                path, _ = self.save(f"{AUTOSAVE_PREFIX}{step}")
                log.info("autosaved %s", path)
            except ServiceError as e:  # the Train is applied either way; the next autosave or the exit save retries
                log.error("autosave at train step %d failed: %s", step, e)
        return result, False

    def save_on_exit(self) -> str | None:
        """With autosave_every > 0, write autosave-<train_step> if a Train was applied since the last checkpoint;
        returns the path written, or None."""
        if self.cfg.autosave_every <= 0 or not self.unsaved:
            return None
        path, _ = self.save(f"{AUTOSAVE_PREFIX}{self.train_step}")
        return path

    def train(self, batch: TrainInput) -> tuple[float, dict[str, float], int]:
        """`batch.epochs` passes over the batch: one optimizer step per global batch, micro-batched by length
        (rows of similar length together, each micro-batch trimmed to its longest row), with the attention mask
        Infer builds from the lengths. The first pass takes the rows in the order sent, later ones in an order
        shuffled by a seed from the train step. A step whose loss or gradient is not finite is skipped
        (`skipped_steps`), so no request can corrupt the weights; a global batch whose mask selects no position takes
        no step (`empty_steps`), since Adam's momentum would move the weights on a zero gradient. Dropout stays off (the model stays in eval mode), as when the old values
        were computed. Returns (mean loss, metrics, the train step reached); explained variance and values_mean
        are over the first pass."""
        self.value_packing.release()  # training needs the layers' own forward, and changes the weights
        tc = self.cfg.train
        tokens, lengths, returns, old_values, mask = (batch.tokens, batch.lengths, batch.returns, batch.old_values,
                                                      batch.mask)
        rows = tokens.shape[0]
        losses: list[float] = []
        grad_norms: list[float] = []
        values_seen = torch.zeros_like(returns)
        clipped = 0.0
        skipped = empty = 0
        started = time.perf_counter()
        try:
            for epoch in range(batch.epochs):
                order = (torch.arange(rows) if epoch == 0 else
                         torch.randperm(rows, generator=torch.Generator().manual_seed(self.train_step)))
                for g in range(0, rows, tc.global_batch_size):
                    group = order[g:g + tc.global_batch_size]
                    if not mask[group].any():  # nothing to learn: a step would still move the weights (momentum)
                        empty += 1
                        continue
                    n_tokens = float(mask[group].sum())
                    self.optimizer.zero_grad(set_to_none=True)
                    loss_total = 0.0
                    for bucket in length_buckets(lengths[group], tc.micro_batch_size):
                        ms = group[bucket]
                        w = int(lengths[ms].max())
                        self.observe_pass("Train", len(ms) * w)
                        tok, n = tokens[ms, :w].to(self.device), lengths[ms].to(self.device)
                        values = self.values(tok, n)[:, :-1]

                        def rows_of(x: torch.Tensor, ms: torch.Tensor = ms, w: int = w) -> torch.Tensor:
                            return x[ms, :w - 1].to(self.device)

                        loss, stats = value_loss(values, rows_of(old_values), rows_of(returns), rows_of(mask),
                                                 clip=batch.value_clip, scale=batch.loss_scale, num_tokens=n_tokens)
                        loss.backward()
                        loss_total += float(loss.detach())
                        if epoch == 0:
                            values_seen[ms, :w - 1] = values.detach().cpu()
                        clipped += float(stats["vf_clipfrac"]) * float(mask[ms].sum())
                    max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
                    if not (math.isfinite(loss_total) and math.isfinite(grad_norm)):
                        skipped += 1
                        self.optimizer.zero_grad(set_to_none=True)
                        continue
                    self.optimizer.step()
                    self.train_step += 1
                    losses.append(loss_total)
                    grad_norms.append(grad_norm)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        n_mask = float(mask.sum().clamp(min=1))
        metrics = {
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "vf_clipfrac": clipped / (n_mask * batch.epochs),
            # nothing measured where the mask selects no position: NaN, not the 1.0 of two zero variances
            "explained_variance": float(explained_variance(values_seen, returns, mask)) if mask.any() else math.nan,
            "values_mean": float(masked_mean(values_seen, mask)),
            "returns_mean": float(masked_mean(returns, mask)),
            "lr": self.optimizer.param_groups[0]["lr"],
            "optimizer_steps": len(losses),
            "skipped_steps": skipped,
            "empty_steps": empty,
            "train_seconds": time.perf_counter() - started,
        }
        return (sum(losses) / len(losses) if losses else float("nan")), metrics, self.train_step

    # --- checkpoints ----------------------------------------------------------------------------
    def validate_tag(self, tag: str) -> str:
        """The tag, if <checkpoint_dir>/<tag> is a directory directly inside checkpoint_dir; else InvalidArgument."""
        checkpoint_path(Path(self.cfg.checkpoint_dir), tag)
        return tag

    def save(self, tag: str) -> tuple[str, int]:
        """Write <checkpoint_dir>/<tag> atomically (temp dir, then rename): safetensors weights + tokenizer +
        optimizer state + critic_state.json (train step, write time, the Train request ids' window). Then, with keep_last > 0, delete this
        server's older checkpoints beyond the newest keep_last. Returns (path, train_step)."""
        started = time.time()
        root = Path(self.cfg.checkpoint_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = checkpoint_path(root, tag)  # checked again here: the directory may have changed since the request
        if final.exists() and not (final / STATE_FILE).is_file():
            raise InvalidArgument(f"tag: {final} exists and is not a critic checkpoint (no {STATE_FILE}); "
                                  f"choose another tag")
        tmp = root / f"{TMP_PREFIX}{tag}"
        if tmp.is_symlink():  # never write through a link planted in the checkpoint directory
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            # transformers >= 5 writes model.safetensors only (its safe_serialization flag is gone): no pickle.
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            copy_remote_code(self.model.config, self.model_dir, tmp)
            # tensors and numbers: weights_only loads it
            summed = {OPTIMIZER_FILE: checksums.save_summed(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)}
            state = {"train_step": self.train_step, "saved_at": time.time(), "sequence": next_sequence(root),
                     "model": self.cfg.model,
                     "version": package_version(),
                     "dedupe_window": self.window.to_json(),
                     checksums.CRC32_KEY: {**checksums.sums(tmp, WEIGHT_FILES), **summed}}
            (tmp / STATE_FILE).write_text(json.dumps(state))
            replaced = root / f"{OLD_PREFIX}{tag}"
            if final.exists():  # moved aside, not deleted, until the new one is in place: a failure keeps it
                if replaced.is_symlink():
                    replaced.unlink()
                shutil.rmtree(replaced, ignore_errors=True)
                final.rename(replaced)
            try:
                tmp.rename(final)
            except OSError:
                if replaced.exists() and not final.exists():
                    replaced.rename(final)
                raise
            shutil.rmtree(replaced, ignore_errors=True)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint is never left behind
            failure = write_failure(e, final)
            if type(failure) is ServiceError:  # no errno: the traceback is the only clue
                log.exception("Save %s failed", tag)
            raise failure from e
        self.unsaved = False
        if self.cfg.keep_last > 0:
            prune_checkpoints(root, self.cfg.keep_last, final, started)
        if tag.startswith(AUTOSAVE_PREFIX) and self.cfg.autosave_keep > 0:
            prune_checkpoints(root, self.cfg.autosave_keep, final, started, prefix=AUTOSAVE_PREFIX)
        return str(final.resolve()), self.train_step

    def restore(self, tag: str) -> tuple[str, int]:
        """Go back to <checkpoint_dir>/<tag>, one of this server's checkpoints: weights, optimizer state, train
        step and the request-id window, all or nothing. Every part is read and checked against this critic before
        any is applied: a checkpoint that cannot be read, or does not fit the model, is FailedPrecondition naming
        the file and leaves the critic as it was. Returns (path, train_step)."""
        path = checkpoint_path(Path(self.cfg.checkpoint_dir), tag)
        if not (path / STATE_FILE).is_file() or not (path / OPTIMIZER_FILE).is_file():
            raise NotFound(f"tag: no checkpoint of this critic at {path}")
        verify_files(path)
        try:
            saved = load_scalar_head_model(str(path), torch.float32,
                                           trust_remote_code=self.cfg.trust_remote_code).state_dict()
        except Exception as e:  # truncated weights, a broken config.json: transformers' reason, under the path
            raise FailedPrecondition(f"{path}: the weights cannot be loaded: {type(e).__name__}: {e}") from e
        if (why := weights_misfit(saved, self.model.state_dict())) is not None:
            raise FailedPrecondition(f"{path}: the weights do not fit this critic's model: {why}")
        training_state = self._read_training_state(path)
        self.value_packing.release()  # packed from the weights it replaces
        self.model.load_state_dict(saved)
        self._apply_training_state(*training_state)
        self.source, self.unsaved = str(path.resolve()), False
        mark_loaded(path, next_sequence(path.parent))
        log.info("returned to checkpoint %s at train step %d", path, self.train_step)
        return str(path.resolve()), self.train_step


# what a write refused by the file system says where no OSError carries its errno (safetensors: "... (os error 28)")
_OS_ERROR = re.compile(r"os error (\d+)")


def verify_files(checkpoint: Path) -> None:
    """FailedPrecondition naming the first weight or optimizer file of `checkpoint` that is not the one its Save
    wrote (by the CRC-32 recorded in its critic_state.json; a checkpoint written before they were recorded, or with
    no readable critic_state.json, is not checked here)."""
    if (changed := checksums.recorded_change(checkpoint, STATE_FILE)) is not None:
        raise FailedPrecondition(f"{checkpoint}: {changed}")


def write_failure(error: BaseException, final: Path) -> ServiceError:
    """What a Save reports when writing checkpoint `final` failed, naming the directory and saying that nothing was
    changed: RESOURCE_EXHAUSTED for a full disk or quota, FAILED_PRECONDITION for another refusal of the file system (a
    read-only or forbidden directory), INTERNAL with the error's own words otherwise (torch.save's failures carry no
    errno; a full disk is the likely cause)."""
    code = None
    cause: BaseException | None = error
    while cause is not None and code is None:
        code = cause.errno if isinstance(cause, OSError) else None
        if code is None and (found := _OS_ERROR.search(str(cause))):
            code = int(found.group(1))
        cause = cause.__cause__ or cause.__context__
    what = f"could not write the checkpoint {final}"
    unchanged = "nothing was saved (the half-written files were removed) and the critic is unchanged"
    if code in DISK_FULL:
        return StorageFull(f"{what}: {os.strerror(code)}; {unchanged}. Free space under checkpoint_dir {final.parent}, "
                           f"then Save again")
    if code is not None:
        return FailedPrecondition(f"{what}: {os.strerror(code)}; {unchanged}. checkpoint_dir {final.parent} must be a "
                                  f"writable directory")
    return ServiceError(f"{what}: {in_brief(error)}; {unchanged}. A full disk under checkpoint_dir {final.parent} is "
                        f"the likely cause")


def in_brief(error: BaseException) -> str:
    """`Type: the first line of its message`, for a log line or a reply that names several failures."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def checkpoint_path(root: Path, tag: str) -> Path:
    """<root>/<tag> for a valid tag whose resolved path lies directly in root; else InvalidArgument naming `tag`."""
    if not _TAG.fullmatch(tag) or tag in (".", ".."):
        shown = repr(tag) if len(tag) <= 64 else f"{tag[:64]!r}... ({len(tag)} characters)"
        raise InvalidArgument(f"tag: expected {TAG_RULE}, got {shown}")
    final = root / tag
    if final.is_symlink() or final.resolve().parent != root.resolve():  # a link planted in checkpoint_dir
        raise InvalidArgument(f"tag: {final} is a link, and a checkpoint must be a directory of checkpoint_dir "
                              f"itself (a link may lead anywhere, outside it too)")
    return final


def prune_checkpoints(root: Path, keep_last: int, current: Path, started: float, prefix: str = "") -> None:
    """Delete this server's checkpoints in root whose names start with `prefix` beyond the keep_last most recently
    written (by the place recorded in their critic_state.json, `_place`; `current` is always kept), and temp directories
    left by Saves that started before `started`. Directories without a readable critic_state.json are never touched.
    A failure to delete is logged, not raised: the checkpoint just written is complete."""
    ours: list[tuple[tuple[int, float], str, Path]] = []
    stale: list[Path] = []
    for entry in root.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        if entry.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            if entry.stat().st_mtime < started:
                stale.append(entry)
        elif entry != current and entry.name.startswith(prefix) and (place := _place(entry)) is not None:
            ours.append((place, entry.name, entry))
    ours.sort(reverse=True)
    for path in stale + [p for _, _, p in ours[keep_last - 1:]]:
        named = path
        try:
            if not path.name.startswith((TMP_PREFIX, OLD_PREFIX)):
                # out of the checkpoints' names first: a process killed while it deletes leaves a temp directory,
                # which the next start tidies, not a checkpoint with half its files that every start passes over
                doomed = path.with_name(f"{TMP_PREFIX}pruned-{path.name}")
                path.rename(doomed)
                path = doomed
            shutil.rmtree(path)
            log.info("removed %s (%s=%d)", named, "autosave_keep" if prefix else "keep_last", keep_last)
        except OSError as e:
            log.warning("could not remove old checkpoint %s: %s", named, e)


def checkpoints_newest_first(root: Path) -> tuple[list[Path], list[Path]]:
    """The checkpoints in root this server wrote, the last written first (by the place in their
    critic_state.json, `_place`); and the directories that hold a critic's optimizer state but no readable critic_state.json,
    which cannot be placed in time."""
    if not root.is_dir():
        return [], []
    ours, unplaced = [], []
    for entry in root.iterdir():
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.name.startswith((TMP_PREFIX, OLD_PREFIX)):
                continue
            if (place := _place(entry)) is not None:
                ours.append((place, entry.name, entry))
            elif (entry / OPTIMIZER_FILE).is_file():
                unplaced.append(entry)
        except OSError as e:  # a directory this process may not read: passed over, not a crash loop at every start
            log.error("%s cannot be read (%s): passed over as a checkpoint", entry, e.strerror or e)
    return [entry for _, _, entry in sorted(ours, reverse=True)], sorted(unplaced)


def _place(directory: Path) -> tuple[int, float] | None:
    """Where a checkpoint of this server stands in the critic's history, later ones greater: its `sequence` (one
    more than the directory's highest when it was written, or returned to by a Load), then the time of the same
    event (`saved_at`, or `loaded_at` after a Load: a restart after an actor's resume comes back where the Load put
    the critic, not on the newer checkpoints of the attempt the resume abandoned). The sequence comes first so a
    clock that jumped, or a host whose clock runs behind another's on a shared volume, does not reorder them;
    checkpoints written before it existed count as 0. None if the directory is not a checkpoint."""
    try:
        state = json.loads((directory / STATE_FILE).read_text())
        times = [state["saved_at"], state.get("loaded_at", state["saved_at"])]
        sequence = state.get("sequence", 0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    ok = all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in times)
    if not ok or not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 0:
        return None
    return sequence, float(max(times))


def next_sequence(root: Path) -> int:
    """One more than the highest `sequence` of the checkpoints in root (1 in an empty directory)."""
    places = (_place(entry) for entry in root.iterdir() if entry.is_dir() and not entry.is_symlink()
              and not entry.name.startswith((TMP_PREFIX, OLD_PREFIX))) if root.is_dir() else ()
    return 1 + max((place[0] for place in places if place is not None), default=0)


def mark_loaded(checkpoint: Path, sequence: int) -> None:
    """Record in the checkpoint's critic_state.json that a Load returned the critic to it (`loaded_at` and
    `sequence`), replaced whole; a failure to write it is logged (a restart before the next checkpoint may then
    resume a newer one)."""
    file = checkpoint / STATE_FILE
    try:
        state = json.loads(file.read_text())
        state["loaded_at"], state["sequence"] = time.time(), sequence
        tmp = file.with_name(f"{STATE_FILE}.tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(file)
    except (OSError, ValueError, TypeError) as e:
        log.warning("could not record the Load in %s (%s): a restart before the next checkpoint resumes the newest "
                    "one written", file, e)


def weights_misfit(saved: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> str | None:
    """Why the state dict `saved` cannot replace `ours` whole (names missing or extra, shapes that differ), or None.
    torch's load_state_dict copies the tensors that match before it raises for the rest."""
    missing, extra = sorted(ours.keys() - saved.keys()), sorted(saved.keys() - ours.keys())
    shapes = [f"{k} {tuple(saved[k].shape)} where {tuple(ours[k].shape)} is expected"
              for k in sorted(ours.keys() & saved.keys()) if saved[k].shape != ours[k].shape]
    parts = [f"{what} {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
             for what, names in (("missing", missing), ("unexpected", extra), ("shape of", shapes)) if names]
    return "; ".join(parts) or None


def optimizer_state_misfit(state: object, optimizer: torch.optim.Optimizer) -> str | None:
    """Why `state` cannot be this optimizer's state_dict (its parameter groups and their sizes, the moments' shapes),
    or None. torch checks the groups when it loads, but a moment of another shape fails only at the next step."""
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) \
            or not isinstance(state.get("state"), dict):
        return "expected a dict with 'state' and 'param_groups'"
    ours = optimizer.param_groups
    theirs = state["param_groups"]
    if len(theirs) != len(ours) or any(not isinstance(g, dict) or len(g.get("params", ())) != len(o["params"])
                                       for g, o in zip(theirs, ours)):
        sizes = [len(g.get("params", ())) if isinstance(g, dict) else "?" for g in theirs]
        return (f"{len(theirs)} parameter groups of {sizes} parameters, where {len(ours)} of "
                f"{[len(o['params']) for o in ours]} are expected")
    params = [p for o in ours for p in o["params"]]
    ids = [i for g in theirs for i in g["params"]]
    for index, param in zip(ids, params):
        entry = state["state"].get(index) if isinstance(index, int) else None
        for name, moment in (entry.items() if isinstance(entry, dict) else ()):
            if isinstance(moment, torch.Tensor) and moment.dim() > 0 and moment.shape != param.shape:
                return (f"{name} of parameter {index} has shape {tuple(moment.shape)}, the parameter "
                        f"{tuple(param.shape)}")
    return None


def load_optimizer_state(file: Path) -> dict:
    """An optimizer state_dict saved by Save, on the CPU (`load_state_dict` moves each tensor to its parameter's
    device, leaving AdamW's step counters on the CPU as it keeps them). Loaded with weights_only=True (explicitly,
    whatever torch's default): tensors, numbers and containers only, so a crafted file cannot run code while
    unpickling. A file that cannot be loaded is FailedPrecondition naming it."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = next((line for line in lines if "Unsupported global" in line), None)  # torch's is a page long
        if reason is None:  # not a refused global: the file is no pickle at all (truncated, overwritten)
            detail = next((line for line in lines if line.startswith("Unsupported operand")), "not a pickle")
            raise FailedPrecondition(f"{file}: cannot be read as an optimizer state ({detail})") from e
        raise FailedPrecondition(
            f"{file}: the optimizer state cannot be loaded with torch.load(weights_only=True), which refuses anything "
            f"but tensors and plain containers ({reason}); a critic server's Save never writes such a file: delete it "
            f"to start with a fresh optimizer") from e
    except Exception as e:  # a truncated or foreign file: torch's own reason, under the file's name
        raise FailedPrecondition(f"{file}: cannot be read as an optimizer state: {type(e).__name__}: {e}") from e


def _check_setting(value: float, field: str, allow_zero: bool) -> float:
    """A per-request loss setting: finite, and >= 0 (allow_zero) or > 0."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise InvalidArgument(f"{field}: expected a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)
