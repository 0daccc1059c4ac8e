"""The training loop, NeMo-Aligner's PPOTrainer.fit split across services and grown to NeMo-RL's estimators.
One step reads top to bottom: rollouts (whole prompt groups; critic values and rewards requested per generation
batch, overlapping the actor's own log-prob passes) -> KL to the reference -> reward scaling and shaping ->
advantages from the configured estimator -> critic training sent without waiting -> clipped policy update ->
KL controller -> metrics and checkpoints. Every algorithmic choice was made once, in __init__."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import grpc
import torch
from fastapi import FastAPI
from transformers import AutoTokenizer

from algorithms import (
    adaptive_kl_coef,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    policy_loss,
    truncated_importance_weights,
)
from embedded import naming_the_model, resolve_model
from serving import package_version
from serving.metrics import process_registry
from serving.modeling import (
    TORCH_DTYPES,
    PassLimits,
    causal_lm_logits,
    compiled,
    length_buckets,
    max_length_of,
    mixed_precision,
    resolve_device,
    set_thread_budget,
    torch_threads,
    warm_up,
)
from serving.prepack import prepacked_linears, prepacks_passes
from serving.rest import add_ops_routes, start_ops_thread

from . import checkpoints
from .advantages import AdvantageInputs, RewardPipeline, build_advantages
from .async_rollouts import AsyncRollouts, RolloutWorkerError, SyncRollouts
from .clients import IncompatibleServer, RemoteError, TrainResult, draining
from .config import ActorConfig, PolicyConfig
from .data import (
    RUN_ID_FILE,
    PromptFormat,
    PromptSampler,
    existing_prompt_file,
    load_prompts,
    new_run_id,
    run_id_of,
)
from .environments import BadEnvironment
from .generation import SamplingParams, TorchGenerationBackend, eos_token_ids
from .models import load_models, padding_id
from .multiturn import episode_metrics, multi_turn_collector
from .rollouts import PolicyDiverged, RolloutBatch, RolloutCollector
from .servers import CriticShared, NotFinite, Servers
from .tracking import MetricsTracker, Timers, step_breakdown

log = logging.getLogger(__name__)


# failures that end a run after its last finished step is checkpointed, as the log names them
RUN_ENDING_FAILURES = {CriticShared: "the critic is trained by another client too",
                       NotFinite: "a server returned rewards or values that are not numbers",
                       IncompatibleServer: "a server restarted with a model this run cannot use",
                       RemoteError: "a server is unavailable",
                       RolloutWorkerError: "the generation worker failed", BadEnvironment: "the environment failed"}
STOPS_THE_RUN = tuple(RUN_ENDING_FAILURES)
STALLED_STEPS = 3  # steps in a row without a policy or critic update (every optimizer step non-finite) before a stop


def pass_limits(pol: PolicyConfig) -> tuple[PassLimits, PassLimits]:
    """How the policy's training micro-batches and its log-prob passes are cut: by padded tokens with
    policy.dynamic_batching enabled (NeMo-RL's key), else by train_micro_batch_size and logprob_batch_size rows."""
    db = pol.dynamic_batching
    if db.enabled:
        return (PassLimits(tokens=db.train_mb_tokens, width_multiple=db.sequence_length_round),
                PassLimits(tokens=db.logprob_mb_tokens, width_multiple=db.sequence_length_round))
    return PassLimits(rows=pol.train_micro_batch_size), PassLimits(rows=pol.logprob_batch_size)


class PPOTrainer:
    def __init__(self, cfg: ActorConfig):
        self.cfg = cfg
        self.timers = Timers()
        self.registry = process_registry()
        self.ready = False
        self.stop_requested, self.stop_signal = False, ""
        self.stalled_steps = 0  # steps in a row whose every policy, or critic, optimizer step was skipped as non-finite
        self.critic_unsaved: list[int] = []  # steps checkpointed without the critic (its Save failed)
        self.policy_updated = False  # whether the step in progress has begun to change the policy's weights
        self.run_dir = Path(cfg.run_dir)
        self.run_lock = checkpoints.lock_run_dir(self.run_dir)  # before anything in it is read or written
        self.ops = None
        if cfg.http_port:
            app = FastAPI(title="actor", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
            add_ops_routes(app, self.registry, lambda: self.ready)
            self.ops = start_ops_thread(app, cfg.host, cfg.http_port)

        p, pol, gen = cfg.ppo, cfg.policy, cfg.policy.generation
        torch.manual_seed(p.seed)
        set_thread_budget(cfg.num_threads)
        self.device = resolve_device(pol.device, "policy.device")
        dtype = TORCH_DTYPES[pol.precision]
        d = cfg.data
        fmt = PromptFormat.from_files(d.prompt_file, d.apply_chat_template, d.system_prompt_file)
        train_file = existing_prompt_file(d.train_file, "data.train_file")
        val_file = existing_prompt_file(d.val_file, "data.val_file") if p.validates else None
        checkpoints.remove_leftovers(self.run_dir / "checkpoints")
        self.resume_from = checkpoints.resume_point(cfg.checkpointing, self.run_dir / "checkpoints")
        if self.resume_from:
            checkpoints.verify_weights(self.resume_from)
        policy_path = (str(self.resume_from / "actor") if self.resume_from
                       else resolve_model(pol.model_name, key="policy.model_name"))
        with naming_the_model("policy.model_name", pol.model_name) if not self.resume_from else \
                checkpoints.naming_the_checkpoint(self.resume_from, "its tokenizer"):
            self.tokenizer = AutoTokenizer.from_pretrained(policy_path, trust_remote_code=pol.trust_remote_code)
        # frozen layers, LoRA adapters, the reference's placement: actor/models.py
        self.models = load_models(pol, self.resume_from, self.device, dtype,
                                  with_reference=not p.skip_reference_policy_logprobs_calculation)
        self.policy, self.reference = self.models.policy, self.models.reference
        embedding_rows = self.policy.get_input_embeddings().num_embeddings
        self.pad_id = padding_id(self.tokenizer, embedding_rows, policy_path)
        # every pass over whole sequences (training, log-probs) goes through this; generation's decode step has its
        # own switch (policy.generation.compile)
        # (policy.precision=bfloat16: under autocast, the float32 weights computing in bf16)
        self.logits = mixed_precision(compiled(causal_lm_logits, pol.compile, "policy.compile", self.device),
                                      self.device, dtype)
        # the no-grad log-prob passes through weights prepacked for oneDNN (CPU, float32), eager or compiled
        self.prepack_logprobs = prepacks_passes("policy.generation.prepack_weights", gen.prepack_weights, self.device,
                                                dtype, "the log-prob")
        # made before the servers are waited for, so policy.generation.compile without a compiler is refused at once
        backend = TorchGenerationBackend(self.policy, self.pad_id, self.device, tokenizer=self.tokenizer,
                                         compile_decode=gen.compile, compute_dtype=dtype, prepack=gen.prepack_weights,
                                         cuda_graphs=gen.cuda_graphs)
        if not p.async_grpo.enabled:  # compiled now, while the servers may still be starting (the async worker's
            backend.warm_up()         # own backend compiles on its first rollout, in its thread)
        if pol.compile:  # likewise the training and log-prob passes, so the first step runs at full speed
            log.info("policy.compile=true: training and log-prob passes compiled in %.1f s", self.warm_up_passes())
        self.optimizer = torch.optim.AdamW(self.models.trainable, **pol.optimizer.kwargs.model_dump())
        eos = eos_token_ids(self.tokenizer, getattr(self.policy, "generation_config", None))
        if not eos and not gen.ignore_eos:
            log.warning("the tokenizer of %s has no EOS token, nor does the policy's generation config: responses end "
                        "only at policy.generation.max_new_tokens, stop_token_ids or stop_strings", policy_path)
        stops = tuple(dict.fromkeys((*(() if gen.ignore_eos else eos), *(gen.stop_token_ids or []))))
        strings = tuple(gen.stop_strings or ())
        self.sampling = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_k or 0, gen.top_p, stops, strings)
        self.val_sampling = SamplingParams(gen.max_new_tokens, gen.val_temperature, gen.val_top_k or 0, gen.val_top_p, stops,
                                           strings)

        self.train_prompts = load_prompts(train_file, d.prompt_key, self.tokenizer, d.max_input_seq_length,
                                          d.label_key, fmt, embedding_rows)
        self.val_prompts = (load_prompts(val_file, d.prompt_key, self.tokenizer, d.max_input_seq_length, d.label_key,
                                         fmt, embedding_rows)[: p.max_val_samples] if val_file else [])
        log.info("prompts: %d for training from %s, %d for validation%s; the first as the policy reads it "
                 "(special tokens shown): %r", len(self.train_prompts), d.train_file, len(self.val_prompts),
                 f" from {d.val_file}" if self.val_prompts else "", self.tokenizer.decode(self.train_prompts[0].ids))
        if len(self.train_prompts) < p.num_prompts_per_step:
            log.warning("%s holds %d prompts, fewer than ppo.num_prompts_per_step=%d: every step repeats prompts and "
                        "passes over the file more than once (ppo.max_num_epochs counts those passes)", d.train_file,
                        len(self.train_prompts), p.num_prompts_per_step)
        self.sampler = PromptSampler(self.train_prompts, p.seed, d.shuffle)
        self.shuffle_gen = torch.Generator().manual_seed(p.seed + 1)

        self.run_id_kept = (self.run_dir / RUN_ID_FILE).is_file()  # an earlier start of this run made it
        self.run_id = run_id_of(self.run_dir)
        # the ids this run can send: prompts and pad are held to the embedding rows, as sampling is
        self.servers = Servers(cfg, self.tokenizer, max_length_of(self.policy), self.train_prompts, self.val_prompts,
                               min(len(self.tokenizer), embedding_rows))
        self.critic = self.servers.critic
        # with an environment, each generation batch is a batch of multi-turn episodes (actor/multiturn.py)
        collector = (RolloutCollector if cfg.env.name is None else
                     multi_turn_collector(cfg, self.tokenizer, self.servers.reward, self.servers.max_length))
        self.episode_metrics = (lambda mask: {}) if cfg.env.name is None else episode_metrics
        self.train_passes, self.logprob_passes = pass_limits(pol)
        self.collector = collector(
            policy=self.policy, reference=self.reference,
            backend=backend,
            critic=self.critic, score=self.servers.score, pad_id=self.pad_id, device=self.device,
            generation_batch_size=pol.generation_batch_size, logprob_passes=self.logprob_passes, timers=self.timers,
            reuse_logprobs=gen.reuse_logprobs, shared_threads=cfg.num_threads_shared, logits=self.logits,
            prepack=self.prepack_logprobs)
        self.rollouts = (AsyncRollouts(self.collector, self.sampler, self.sampling, p, self.policy, self.pad_id,
                                       self.device, pol.generation_batch_size, self.timers, gen.compile)
                         if p.async_grpo.enabled else SyncRollouts(self.collector, self.sampler, self.sampling, p))

        self.estimator, self.finish_advantages = build_advantages(p.adv_estimator)
        self.shape_rewards = RewardPipeline(cfg)
        self.kl_coef = p.kl_controller.init_kl_coef  # beta of the KL in the reward, moved by an adaptive controller
        self.start_step = self.restore(self.resume_from) if self.resume_from else self._start_the_critic()
        checkpoints.set_aside_after(self.run_dir / "checkpoints", self.start_step)  # an older resume, or never
        self.tracker = MetricsTracker(self.run_dir, p.max_num_steps, self.registry, cfg.logger.tensorboard_enabled,
                                      resume_step=self.start_step if self.resume_from else None)

    def warm_up_passes(self) -> float:
        """Compile `self.logits` now, on dummy batches, for each way a step calls it, at the thread count it runs
        with there (a compiled CPU kernel is built for one; another count compiles again): without gradients on the
        reference and, when its log-probs are not generation's, the policy (the rollout's log-prob passes, at
        num_threads_shared), and forward and backward on the policy in its training state (the update, at
        num_threads_shared while the critic trains beside it). Weights, gradients, optimizer state and the random
        streams (LoRA dropout draws from them) are left as they were; returns the seconds it took."""
        cfg = self.cfg
        no_grad = [] if cfg.policy.generation.reuse_logprobs else [self.policy]
        seconds = 0.0
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            with torch_threads(cfg.num_threads_shared), \
                    self.reference.resident() if self.reference is not None else nullcontext() as reference:
                models = [*no_grad, *([reference] if reference is not None else [])]

                def packed() -> ExitStack:  # as the log-prob passes compute (RolloutCollector.logprobs)
                    stack = ExitStack()
                    for m in models:
                        stack.enter_context(prepacked_linears(m, 16, enabled=self.prepack_logprobs))
                    return stack

                if models:
                    seconds += warm_up(self.logits, models, self.device, grad_free=torch.no_grad, packed=packed)
            with torch_threads(self.update_threads()), self.models.training():
                seconds += warm_up(self.logits, [], self.device, train=self.policy)
        return seconds

    def update_threads(self) -> int:
        """torch threads of the policy update: num_threads_shared while the critic trains beside it (GAE), else
        unchanged (0)."""
        return self.cfg.num_threads_shared if self.cfg.trains_critic else 0

    # --- the policy update ----------------------------------------------------------------------
    def _group_order(self, group_ids: torch.Tensor) -> torch.Tensor:
        """A permutation of the rows that shuffles whole groups and keeps each group's rows together."""
        groups = torch.unique_consecutive(group_ids)
        order = groups[torch.randperm(len(groups), generator=self.shuffle_gen)]
        return torch.cat([(group_ids == g).nonzero().squeeze(1) for g in order])

    def train_policy(self, batch: RolloutBatch, advantages: torch.Tensor, loss_mask: torch.Tensor,
                     is_weights: torch.Tensor | None) -> dict[str, float]:
        """ppo_epochs passes; one optimizer step per train_global_batch_size samples, micro-batched; the loss is
        normalised by the global batch's token (or sequence) count so micro-batches add up to it exactly."""
        pol, lf = self.cfg.policy, self.cfg.loss_fn
        aggregation = "token" if lf.token_level_loss else "sequence"
        tokens, lengths = batch.rollout.tokens, batch.rollout.lengths
        sums = dict.fromkeys(("ppo_ratio", "ppo_ratio_clamped", "dual_clipfrac", "approx_kl", "entropy", "kl_penalty"), 0.0)
        n_tokens_seen, ratio_min, ratio_max = 0.0, float("inf"), float("-inf")
        loss_sum, grad_norm_sum, n_steps, skipped, empty = 0.0, 0.0, 0, 0, 0
        max_norm = pol.max_grad_norm if pol.max_grad_norm > 0 else float("inf")
        # The policy stays in eval mode: no dropout, so the first epoch's ratio is 1 (NeMo-Aligner too; in
        # float32 up to rounding, in bf16 within its rounding, since the log-prob and training passes batch rows apart).
        for _ in range(self.cfg.ppo.ppo_epochs):
            order = self._group_order(batch.group_ids)
            for g in range(0, len(order), pol.train_global_batch_size):
                idx = order[g:g + pol.train_global_batch_size]
                if not loss_mask[idx].any():  # nothing to learn: a step would still move the weights (momentum)
                    empty += 1
                    continue
                n_tokens = float(loss_mask[idx].sum().clamp(min=1))
                n_seqs = float((loss_mask[idx].sum(1) > 0).sum().clamp(min=1))
                self.optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for bucket in length_buckets(lengths[idx], self.train_passes):
                    mi = idx[bucket]  # rows of similar length, trimmed to the longest: no work on padding
                    w = self.train_passes.width(int(lengths[mi].max()), tokens.shape[1])

                    def rows(x: torch.Tensor | None, mi: torch.Tensor = mi, w: int = w) -> torch.Tensor | None:
                        return None if x is None else x[mi, :w - 1].to(self.device)

                    tok, n = tokens[mi, :w].to(self.device), lengths[mi].to(self.device)
                    mk = rows(loss_mask)
                    logits = self.logits(self.policy, tok, n)[:, :-1].float()
                    lp = logprobs_from_logits(logits, tok[:, 1:])
                    pg_loss, stats = policy_loss(
                        lp, rows(batch.logprobs), rows(advantages), mk, clip_low=lf.ratio_clip_min,
                        clip_high=lf.ratio_clip_max, num_tokens=n_tokens, clip_c=lf.ratio_clip_c, aggregation=aggregation,
                        num_sequences=n_seqs, ref_logprobs=rows(batch.ref_logprobs),
                        kl_coef=lf.reference_policy_kl_penalty, kl_type=lf.reference_policy_kl_type,
                        importance_weights=rows(is_weights))
                    with torch.set_grad_enabled(lf.entropy_bonus != 0):  # a metric only, unless it is in the loss
                        entropy = entropy_from_logits(logits)
                    loss = pg_loss - lf.entropy_bonus * aggregate_loss(entropy, mk, aggregation, n_tokens, n_seqs)
                    loss.backward()
                    step_loss += float(loss.detach())
                    k = float(mk.sum())
                    if k > 0:
                        n_tokens_seen += k
                        for name, key in (("ppo_ratio", "ratio_mean"), ("ppo_ratio_clamped", "clipfrac"),
                                          ("dual_clipfrac", "dual_clipfrac"), ("approx_kl", "approx_kl"),
                                          ("kl_penalty", "kl_penalty")):
                            sums[name] += float(stats.get(key, 0.0)) * k
                        sums["entropy"] += float(masked_sum(entropy.detach(), mk))
                        ratio_min = min(ratio_min, float(stats["ratio_min"]))
                        ratio_max = max(ratio_max, float(stats["ratio_max"]))
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm))
                if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):  # never into the weights
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                self.optimizer.step()
                loss_sum, grad_norm_sum, n_steps = loss_sum + step_loss, grad_norm_sum + grad_norm, n_steps + 1
        if n_steps and not all(bool(torch.isfinite(w).all()) for w in self.policy.parameters() if w.requires_grad):
            raise PolicyDiverged(
                f"the policy's weights are not finite after this step's update (policy.optimizer.kwargs.lr="
                f"{self.optimizer.param_groups[0]['lr']:g}; a learning rate too large for the model?): the run stops "
                f"without saving them; the latest complete checkpoint in {self.run_dir / 'checkpoints'} is from "
                f"before")
        if skipped:
            log.warning("%d policy optimizer steps skipped: their loss or gradient was not finite (a learning rate or "
                        "advantages too large?); the weights are as before them", skipped)
        if empty and not n_steps and not skipped:
            log.warning("no sample has a token in the policy loss (cut off before EOS with ppo.overlong_filtering, or "
                        "masked): the policy is not updated this step")
        nan = float("nan")  # written as null: no step, or no token, to average over
        return {
            "train_optim/loss": loss_sum / n_steps if n_steps else nan,
            **{f"train_optim/{k}": v / n_tokens_seen if n_tokens_seen else nan for k, v in sums.items()},
            "train_optim/ppo_ratio_min": ratio_min if n_tokens_seen else nan,
            "train_optim/ppo_ratio_max": ratio_max if n_tokens_seen else nan,
            "train_optim/grad_norm": grad_norm_sum / n_steps if n_steps else nan,
            "train_optim/lr": self.optimizer.param_groups[0]["lr"],
            "train_optim/optimizer_steps": float(n_steps),
            "train_optim/skipped_steps": float(skipped),
            "train_optim/empty_steps": float(empty),
        }

    def _count_stalled(self, metrics: dict[str, float], critic: TrainResult | None, batch: RolloutBatch) -> None:
        """Stop (PolicyDiverged) after STALLED_STEPS steps in a row in which every optimizer step of the policy, or
        of the critic, was skipped as non-finite: the run would go on spending its compute without training (rewards
        huge but finite, from a reward model gone wrong, do that)."""
        policy = metrics.get("train_optim/skipped_steps", 0) > 0 and metrics.get("train_optim/optimizer_steps") == 0
        value = critic is not None and critic.metrics.get("skipped_steps", 0) > 0 \
            and critic.metrics.get("optimizer_steps", 0) == 0
        self.stalled_steps = self.stalled_steps + 1 if policy or value else 0
        if self.stalled_steps >= STALLED_STEPS:
            raise PolicyDiverged(
                f"{self.stalled_steps} steps in a row took no {'policy' if policy else 'critic'} optimizer step: every "
                f"loss or gradient was not finite (this step's rewards: mean {float(batch.rewards.mean()):.4g}, "
                f"largest magnitude {float(batch.rewards.abs().max()):.4g}; a reward source gone wrong, or a "
                f"learning rate too large); the run stops with the weights of its last finished update")

    # --- one step -------------------------------------------------------------------------------
    def step(self, step: int) -> tuple[dict[str, float], RolloutBatch]:
        cfg, t = self.cfg, self.timers
        p, lf, kc = cfg.ppo, cfg.loss_fn, cfg.ppo.kl_controller
        self.servers.watch_critic()
        self.servers.watch_reward()
        with t("rollout_time"):
            try:
                batch, gen_batches = self.rollouts.collect(step)
            except RemoteError as e:  # a server restarted with other settings may refuse what the run sends: say
                if e.code == grpc.StatusCode.INVALID_ARGUMENT:  # that (IncompatibleServer), not only its refusal
                    self.servers.watch_reward()
                raise
        # again: a server restarted with other settings while it scored (or valued) this step's batches would have
        # mixed two meanings of reward in it
        self.servers.watch_reward()
        self.servers.watch_critic()  # a critic that restarted while it valued them: checked before they are used
        self.servers.require_finite(batch)
        r, mask = batch.rollout, batch.mask

        kl = torch.zeros_like(mask)
        if batch.ref_logprobs is not None:
            kl = kl_penalty(batch.logprobs, batch.ref_logprobs, kc.kl_type, absolute=kc.use_absolute_kl) * mask
        rewards = self.shape_rewards(batch.rewards, r.response_lengths, r.ended)
        components = {k: self.shape_rewards(v, r.response_lengths, r.ended) for k, v in batch.components.items()}
        values = None if batch.values is None else batch.values * mask
        advantages, returns = self.estimator(AdvantageInputs(
            rewards=rewards, components=components, group_ids=batch.group_ids, mask=mask, values=values,
            kl_penalty=self.kl_coef * kl))
        raw_advantages = advantages
        advantages = self.finish_advantages(advantages, mask)

        # samples cut off by max_new_tokens get no policy gradient, yet counted in baselines and critic targets
        loss_mask = mask * r.ended[:, None].float() if p.overlong_filtering else mask
        is_weights, is_metrics = None, {}
        if lf.use_importance_sampling_correction:
            is_weights, is_metrics = truncated_importance_weights(
                batch.logprobs, r.logprobs, loss_mask, lf.truncated_importance_sampling_type or "tis",
                lf.truncated_importance_sampling_ratio_min if lf.truncated_importance_sampling_type else 0.0,
                lf.truncated_importance_sampling_ratio if lf.truncated_importance_sampling_type else float("inf"))

        critic_train = None
        if returns is not None and self.critic is not None:  # not awaited: the critic trains while the policy does
            vl = cfg.value_loss_fn
            with t("transfer"):
                critic_train = self.critic.train(r.tokens, r.lengths, returns, values, mask, vl.cliprange or 0.0,
                                                 vl.scale, request_id=f"{self.run_id}/{step}/0",
                                                 epochs=cfg.critic.ppo_epochs)
        metrics: dict[str, float] = {}
        if step > p.policy_training_start_step:  # that many critic-only steps first (NeMo-RL's meaning)
            # the critic trains at the same time: on a shared machine the actor keeps to its share of the cores
            self.policy_updated = True  # from here a failure leaves step N-1's weights behind (fit)
            with t("train_time"), torch_threads(self.update_threads()), \
                    self.models.training():
                metrics = self.train_policy(batch, advantages, loss_mask, is_weights)
        self.rollouts.update_weights(self.policy)  # the async generation worker's next batch uses them
        kl_per_sample, kl_coef = float(kl.sum(1).mean()), self.kl_coef
        if kc.type == "adaptive" and self.kl_coef > 0:  # with the update: a step that fails after it (the critic away
            # for its Train) is checkpointed as itself, and must hold the coefficient the next step uses
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl_per_sample, kc.target, kc.horizon, batch.size)
        with t("critic_train_wait"):
            critic = critic_train.result() if critic_train is not None else None
        self._count_stalled(metrics, critic, batch)

        metrics.update({
            "train_rollouts/kl_coef": kl_coef,
            "train_rollouts/rollout_size": float(batch.size),
            "train_rollouts/num_groups": float(len(torch.unique(batch.group_ids))),
            "train_rollouts/dynamic_sampling_gen_batches": float(gen_batches),
            "train_rollouts/rewards": float(batch.rewards.mean()),
            "train_rollouts/shaped_rewards": float(rewards.mean()),
            "train_rollouts/init_policy_kl": kl_per_sample,
            "train_rollouts/rewards_with_kl": float((rewards - kl_coef * kl.sum(1)).mean()),
            "train_rollouts/response_lengths": float(r.response_lengths.float().mean()),
            "train_rollouts/prompt_lengths": float(r.prompt_lengths.float().mean()),
            "train_rollouts/fraction_of_samples_properly_ended": float(r.ended.float().mean()),
            "train_rollouts/loss_tokens_fraction": float(loss_mask.sum() / mask.sum().clamp(min=1)),
            **{f"train_rollouts/{k}": float(v.mean()) for k, v in batch.components.items()},
            **self.episode_metrics(mask),
            **{f"train_optim/{k}": float(v) for k, v in is_metrics.items()},
        })
        if critic is not None:
            self.servers.critic_at(critic)
            if critic.metrics.get("skipped_steps"):
                log.warning("step %d: the critic skipped %d of its optimizer steps, whose loss or gradient was not "
                            "finite (returns too large for its value head?); its weights are as before them", step,
                            int(critic.metrics["skipped_steps"]))
            metrics.update({"critic/loss": critic.loss, "critic/train_step": float(critic.train_step),
                            "critic/restarts": float(self.servers.critic_restarts),
                            **{f"critic/{k}": v for k, v in critic.metrics.items() if k != "train_seconds"}})
            if "train_seconds" in critic.metrics:  # the server's own training time, a wall-clock timer like ours
                metrics["timers/critic_train"] = critic.metrics["train_seconds"]
        # advantages as the estimator gave them, before whitening (NeMo-Aligner logs these too)
        stats = {"advantages": raw_advantages, "returns": returns, "values": values}
        for name, x in stats.items():
            if x is not None:
                metrics[f"train_rollouts/{name}_mean"] = float(masked_mean(x, mask))
                metrics[f"train_rollouts/{name}_std"] = float(masked_var(x, mask).sqrt())
        return metrics, batch

    def validate(self) -> dict[str, float]:
        """Generation on the first ppo.max_val_samples validation prompts (greedy unless val_temperature > 0).
        Rewards are as the reward source gives them (no scaling or shaping), averaged over samples; lengths are
        response tokens averaged over samples."""
        with self.timers.only("validation_time"):
            batch = self.collector.generate(self.val_prompts, self.val_sampling, seed=0,
                                            batch_size=self.cfg.ppo.val_batch_size, train=False)
        r = batch.rollout
        return {"val/rewards": float(batch.rewards.mean()),
                "val/response_lengths": float(r.response_lengths.float().mean()),
                "val/fraction_of_samples_properly_ended": float(r.ended.float().mean()),
                **{f"val/{k}": float(v.mean()) for k, v in batch.components.items()}}

    def samples_table(self, batch: RolloutBatch, n: int) -> str:
        r = batch.rollout
        lines = []
        for i in range(min(n, r.tokens.shape[0])):
            prompt = self.tokenizer.decode(r.tokens[i, : r.prompt_lengths[i]], skip_special_tokens=True)
            response = self.tokenizer.decode(r.tokens[i, r.prompt_lengths[i]: r.lengths[i]], skip_special_tokens=True)
            label = "" if batch.labels is None else f" | label {batch.labels[i]!r}"
            lines.append(f"  reward {float(batch.rewards[i]):+.3f} | {prompt} | {response}{label}")
        return "\n".join(lines)

    # --- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, step: int, metrics: dict[str, float] | None = None, wait_for_critic: bool = True,
                        train_unconfirmed: bool = False) -> Path:
        """<run_dir>/checkpoints/step_N/: the policy (Hugging Face format), optimizer, random states and
        trainer_state.json, everything an exact resume needs (actor/checkpoints.py); checkpoint.json names the
        critic checkpoint the critic server wrote for the same step. Written as tmp_step_N, then renamed. The
        critic's Save waits out an outage unless `wait_for_critic` is off (a run ending on a server's outage, which
        it has waited out already)."""
        root = self.run_dir / "checkpoints"
        tmp, final = root / f"tmp_step_{step}", root / f"step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.models.save(tmp, self.tokenizer)
        critic_tag, critic_path, unsaved = f"{self.run_id}-step_{step}", None, {}  # the run's namespace on the critic
        if self.critic is not None and train_unconfirmed:  # the step's Train went out; whether it landed is unknown
            instance, train_step = self.servers.critic_seen
            unsaved = {"critic_unsaved": {"error": f"step {step}'s critic Train was sent but not confirmed before the "
                                                   f"run stopped", "instance_id": instance, "train_step": train_step,
                                          "train_unconfirmed": True}}
        elif self.critic is not None:
            instance, train_step = self.servers.critic_seen
            try:
                critic_path, saved_step = self.critic.save(critic_tag, retry=wait_for_critic)
                if saved_step != train_step:  # it restarted (its Save retried on the new process) and lost steps
                    raise RemoteError(
                        f"the critic server {self.cfg.critic.address} restarted before this Save and resumed at "
                        f"train step {saved_step}, where this run had left it at {train_step}: its checkpoint "
                        f"{critic_path} does not hold this step's critic")
            except RemoteError as e:  # the actor's own state is still worth keeping, with where it left the critic
                log.error("checkpoint of step %d without the critic: %s", step, e)
                self.critic_unsaved.append(step)
                critic_path = None
                unsaved = {"critic_unsaved": {"error": str(e), "instance_id": instance, "train_step": train_step}}
        meta = {"step": step, "actor": str((final / "actor").resolve()), "critic": critic_path,
                "consumed_samples": self.sampler.consumed, "epoch": self.sampler.epoch, "kl_coef": self.kl_coef}
        (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2))
        try:
            metric, unknown = checkpoints.ranking_metric(self.cfg.checkpointing.metric_name, metrics), None
        except checkpoints.UnknownMetric as e:  # the checkpoint is written all the same; nothing is pruned by it
            metric, unknown = None, e
        position = self._position()
        state = {**meta, **unsaved, checkpoints.WEIGHTS_CRC32: checkpoints.weight_sums(tmp),
                 "run_id": self.run_id, "critic_tag": critic_tag if critic_path else None,
                 "reward_serves": self.servers.reward_serves,
                 "next_group": position["next_group"], "metric": metric, "stalled_steps": position["stalled_steps"],
                 "version": package_version(), "config_meanings": checkpoints.CONFIG_MEANINGS,
                 "python_random": position["python"][1], "config": self.cfg.model_dump(mode="json")}
        rng = {k: position[k] for k in ("torch", "shuffle", "sampler", "cuda")}
        checkpoints.write_state(tmp, state, self.optimizer.state_dict(), rng)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if unknown is not None:
            raise unknown
        checkpoints.prune(root, self.cfg.checkpointing)
        return final

    def _checkpointed(self, step: int) -> bool:
        return (self.run_dir / "checkpoints" / f"step_{step}").exists()

    def restore(self, directory: Path) -> int:
        """Continue from a checkpoint: optimizer, data position, random states, KL coefficient, and the critic
        returned to its checkpoint of the same step. Returns the step the checkpoint finished."""
        state, optimizer, rng = checkpoints.read_state(directory)
        now = self.cfg.model_dump(mode="json")
        if changed := checkpoints.changed_settings(state.get("config", {}), now,
                                                   type(self.cfg).model_construct().model_dump(mode="json")):
            log.warning("resuming %s with settings that differ from those it was saved with: %s; the steps from "
                        "here are not those of an uninterrupted run", directory, "; ".join(changed))
        for why in checkpoints.meaning_changes(state, now):
            log.warning("resuming %s (written by version %s): %s", directory, state.get("version", "before 0.2.0"),
                        why)
        checkpoints.load_optimizer_state(self.optimizer, optimizer, state, directory,
                                         self.cfg.policy.optimizer.kwargs.model_dump())
        self._return_to({**rng, "python": (3, tuple(state["python_random"]), None), "kl_coef": state["kl_coef"],
                         "next_group": state["next_group"],
                         "stalled_steps": int(state.get("stalled_steps", 0))})  # 3 in a row stop a run, resumed too
        then, now = state.get("reward_serves"), self.servers.reward_serves
        if then is not None and now is not None and then != now:  # as Servers.watch_reward checks during a run
            raise checkpoints.ResumeError(
                f"{directory} was written while the reward server served {then}, and {self.cfg.reward.address} now "
                f"serves {now}: the rewards would change meaning from the resumed step on; restart the reward server "
                f"as it was, or start a new run (checkpointing.resume=never or another run_dir)")
        if self.critic is not None:
            if state["critic_tag"] is None:
                self._resume_without_a_critic_checkpoint(directory, state)
            else:
                try:
                    path, train_step = self.critic.load(state["critic_tag"])
                except RemoteError as e:
                    if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                        raise
                    way_on = self._earlier_checkpoint(directory, state["step"])
                    if e.code == grpc.StatusCode.NOT_FOUND and state.get("critic"):
                        # the critic restarted on another checkpoint_dir (a new volume): the way on may be to point
                        # it at the old one, which the checkpoint records, rather than give up the step
                        way_on = (f"the critic's checkpoint was written to {state['critic']}: if the critic server "
                                  f"now uses another checkpoint_dir, restart it with --checkpoint-dir "
                                  f"{Path(state['critic']).parent} (or copy that checkpoint into its own) and resume "
                                  f"again; otherwise {way_on}")
                    raise checkpoints.ResumeError(
                        f"{directory}: the critic server {self.cfg.critic.address} cannot return to its checkpoint of "
                        f"that step ({e}); {way_on}") from None
                self.servers.critic_returned_to(train_step)
                log.info("the critic returned to %s (train step %d)", path, train_step)
        log.info("resuming after step %d from %s (%d samples consumed)", state["step"], directory,
                 state["consumed_samples"])
        return int(state["step"])

    def _start_the_critic(self) -> int:
        """A run that starts at step 1 checkpoints the critic as it finds it (`<run_id>-step_0`, with checkpointing
        on). The same command started again before the run's first checkpoint was complete (its process killed
        early) returns the critic there, so the run starts again exactly as it first did: the critic had trained on
        the dead attempt's steps, and its request ids were taken. Without that checkpoint the run goes on under a new
        run id, with the critic as it is. Returns 0, the step the run resumes after."""
        if self.critic is None:
            return 0
        tag, train_step = f"{self.run_id}-step_0", self.servers.critic_seen[1]
        again = ("starts over (checkpointing.resume=never)" if self.cfg.checkpointing.resume == "never" else
                 "starts again at step 1 (no checkpoint of it is complete)")
        if self.run_id_kept:
            try:
                path, train_step = self.critic.load(tag)
            except RemoteError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
                old, self.run_id = self.run_id, new_run_id(self.run_dir)
                log.warning("run %s %s, and the critic holds no checkpoint of its start (%s): it goes on as run %s, "
                            "with the critic as it is", old, again, tag, self.run_id)
            else:
                self.servers.critic_returned_to(train_step)
                log.info("run %s %s: the critic returned to %s, where the run first found it (train step %d)",
                         self.run_id, again, path, train_step)
                return 0
        if train_step:
            log.warning("the critic server %s has taken %d optimizer steps already (its own checkpoint, resumed, or "
                        "another run's training): this run trains it on from there", self.cfg.critic.address,
                        train_step)
        if self.cfg.checkpointing.enabled:
            try:
                self.critic.save(tag)
            except RemoteError as e:  # the run itself can go on
                log.error("the critic's state at the run's start could not be saved, so a restart before the first "
                          "checkpoint goes on with the critic as it then is: %s", e)
        return 0

    def _resume_without_a_critic_checkpoint(self, directory: Path, state: dict[str, Any]) -> None:
        """A checkpoint whose critic Save failed resumes exactly only if the critic is still where that step left it:
        at the same train step (the same process, or one that resumed its own checkpoint of that step; a critic serves
        one run, so no one else took it there). Otherwise it stops naming the newest checkpoint that holds its critic.
        A checkpoint of a run without a critic (or written before this was recorded) keeps the critic as it is, with
        a warning."""
        unsaved = state.get("critic_unsaved")
        if unsaved is None:
            log.warning("%s holds no critic checkpoint: the critic keeps its present weights", directory)
            return
        instance, train_step = self.servers.critic_seen
        if unsaved.get("train_unconfirmed") and train_step > unsaved["train_step"]:  # the step's Train landed
            log.info("%s: the critic server %s took that step's training (train step %d) before the run stopped: "
                     "resuming with it as it is", directory, self.cfg.critic.address, train_step)
            return
        if unsaved.get("train_unconfirmed") and train_step == unsaved["train_step"]:
            log.warning("%s: the critic server %s never took that step's training (train step %d): the run goes on "
                        "with a critic one Train behind the uninterrupted run's", directory, self.cfg.critic.address,
                        train_step)
            return
        if train_step == unsaved["train_step"]:  # a critic serves one run: no one else took it to that step
            how = ("the same process" if instance == unsaved["instance_id"] else
                   "a restart that resumed its own checkpoint of that step")
            log.info("%s holds no critic checkpoint (its Save failed), but the critic server %s is still where that "
                     "step left it (%s, train step %d): resuming with it as it is", directory,
                     self.cfg.critic.address, how, train_step)
            return
        raise checkpoints.ResumeError(
            f"{directory} holds no critic checkpoint (the critic's Save failed: {unsaved['error']}), and the critic "
            f"server {self.cfg.critic.address} is no longer where that step left it (train step "
            f"{unsaved['train_step']} of process {unsaved['instance_id'][:8]}; now train step {train_step} of process "
            f"{instance[:8]}), so the run cannot go on exactly from it: "
            f"{self._earlier_checkpoint(directory, state['step'])}")

    @staticmethod
    def _earlier_checkpoint(directory: Path, step: int) -> str:
        """The way on from a checkpoint that cannot be resumed: the newest earlier one that holds its critic."""
        paired = [p for p in checkpoints.complete_checkpoints(directory.parent)
                  if checkpoints.step_of(p) < step and checkpoints.holds_its_critic(p)]
        if paired:
            return (f"resume from {paired[-1]}, the newest earlier checkpoint that holds its critic "
                    f"(checkpointing.resume={paired[-1]}), or start over (checkpointing.resume=never)")
        return "no earlier checkpoint of this run holds its critic: start over (checkpointing.resume=never)"

    def _position(self) -> dict[str, Any]:
        """What a step moves besides the weights: the data position, the group counter, the random states, the KL
        coefficient and the count of stalled steps; what a checkpoint keeps of them and a resume returns to
        (`_return_to`). Also taken before each step, so that the checkpoint of the last finished step, written when
        the next one fails before its policy update, holds that step's position and not one partway through the
        next (its prompts skipped on resume)."""
        sampler = self.sampler.state_dict()
        return {"sampler": {**sampler, "order": list(sampler["order"])}, "next_group": self.collector.next_group,
                "torch": torch.get_rng_state(), "shuffle": self.shuffle_gen.get_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "kl_coef": self.kl_coef, "stalled_steps": self.stalled_steps}

    def _return_to(self, position: dict[str, Any]) -> None:
        self.sampler.load_state_dict(position["sampler"])
        self.collector.next_group, self.kl_coef = position["next_group"], position["kl_coef"]
        torch.set_rng_state(position["torch"])
        self.shuffle_gen.set_state(position["shuffle"])
        random.setstate(position["python"])
        if position["cuda"] and torch.cuda.is_available():  # a machine with fewer GPUs restores those it has
            torch.cuda.set_rng_state_all(position["cuda"][: torch.cuda.device_count()])
        self.stalled_steps = position["stalled_steps"]

    def fit(self) -> list[dict]:
        cfg, p = self.cfg, self.cfg.ppo
        ck_by = cfg.checkpointing.must_save_by_s
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self.ready = True
        n_print = cfg.logger.num_val_samples_to_print
        if p.val_at_start and not self.start_step:
            self.tracker.log(0, {**self.validate(), **self.timers.pop()})
        last_batch, step = None, self.start_step
        if self.start_step >= p.max_num_steps:
            self.tracker.write(f"nothing to train: the run resumed after step {self.start_step}, and "
                               f"ppo.max_num_steps={p.max_num_steps}; raise it to train further")
        started = time.monotonic()
        for step in range(self.start_step + 1, p.max_num_steps + 1):
            if self.sampler.finished_epochs >= p.max_num_epochs:
                self.tracker.write(f"stopping before step {step}: ppo.max_num_epochs={p.max_num_epochs} passes done")
                step -= 1
                break
            start = time.perf_counter()
            before, self.policy_updated = self._position(), False
            try:
                metrics, last_batch = self.step(step)
            except STOPS_THE_RUN as e:  # keep what is done, then stop; never over a checkpoint already written (it
                # may hold the critic's, which is now out of reach)
                done = step if self.policy_updated else step - 1  # the step whose weights the policy holds
                if cfg.checkpointing.enabled and done > self.start_step and not self._checkpointed(done):
                    why = next(text for cls, text in RUN_ENDING_FAILURES.items() if isinstance(e, cls))
                    if self.policy_updated:  # step N-1's weights are gone: the policy is step N's (a pod deleted
                        # while the actor waited for the critic's Train, say), so that is the checkpoint
                        path = self.save_checkpoint(step, wait_for_critic=False, train_unconfirmed=True)
                        critic = ", its critic training unconfirmed" if self.critic is not None else ""
                        self.tracker.write(f"{why}: checkpoint of step {step} (its policy update done{critic}, its "
                                           f"metrics row not written) at {path}")
                    else:  # the step took prompts and random numbers: back to where step N-1 left them
                        self._return_to(before)
                        path = self.save_checkpoint(step - 1, wait_for_critic=False)
                        self.tracker.write(f"{why}: checkpoint of step {step - 1} at {path}")
                raise
            if step == self.start_step + 1 and n_print:
                self.tracker.write(f"samples before training (step {step}):\n" + self.samples_table(last_batch, n_print))
            out_of_time = ck_by is not None and time.monotonic() - started >= ck_by
            end = step == p.max_num_steps or self.sampler.finished_epochs >= p.max_num_epochs  # the run's own end
            last = end or self.stop_requested or out_of_time  # a stop's last step is checkpointed, not validated:
            if (p.val_period and step % p.val_period == 0) or (end and p.val_at_end):  # it is no end of the run
                metrics.update(self.validate())
            metrics.update(self.rollouts.metrics())  # generation/*: this step's decode work, its validation's too
            metrics.update(self.timers.pop())
            metrics["timers/step_time"] = time.perf_counter() - start
            self.tracker.write(step_breakdown(step, metrics))
            metrics["consumed_samples"] = float(self.sampler.consumed)
            self.tracker.log(step, metrics)
            ck = cfg.checkpointing
            if ck.enabled and (last or (ck.save_period and step % ck.save_period == 0)):
                written = time.perf_counter()  # after the step's row: not part of its step_time
                path = self.save_checkpoint(step, metrics)
                self.tracker.write(f"step {step}: checkpoint {path} ({time.perf_counter() - written:.2f} s)")
            if self.stop_requested:
                self.tracker.write(f"stopping after step {step} ({self.stop_signal})")
                break
            if out_of_time:
                self.tracker.write(f"stopping after step {step}: checkpointing.checkpoint_must_save_by "
                                   f"({ck.checkpoint_must_save_by}) reached")
                break
        if cfg.checkpointing.enabled and step > self.start_step and not self._checkpointed(step):
            self.save_checkpoint(step)  # stopped early by max_num_epochs
        if self.critic_unsaved and self.critic_unsaved[-1] == step:
            log.error("the critic's Save failed for %d checkpoint(s) of this run, the last one (step %d) included "
                      "(the reasons are logged above): the critic's trained weights are only in the running critic "
                      "server %s. Keep it running until they are saved (its Save with a tag of your own, once the "
                      "cause is fixed), or they are lost; a resume from step %d needs that critic where it is now",
                      len(self.critic_unsaved), step, cfg.critic.address, step)
        if n_print and last_batch is not None:
            self.tracker.write("samples after training:\n" + self.samples_table(last_batch, n_print))
        if cfg.logger.reward_curve_enabled:
            self.tracker.write(f"reward curve: {self.tracker.plot_reward_curve()}")
        return self.tracker.history

    def _request_stop(self, signum, frame) -> None:
        """The first SIGTERM (or SIGINT): finish the step, checkpoint, exit 0; /ready answers 503 from now on, and
        a server outage met while stopping is waited out for at most clients.DRAIN_OUTAGE_S. A second one: stop at
        once, exit 128 + the signal's number, keeping the latest complete checkpoint (each is written whole, then
        renamed, and the run directory's lock goes with the process). It ends the process from the handler: an
        exception raised into whatever the main thread was doing (once, the middle of a gRPC call's set-up) left
        the channels' close waiting forever, the process and its lock with it."""
        name = signal.Signals(signum).name
        if self.stop_requested:
            for stream in (sys.stdout, sys.stderr):  # what the run printed so far, unless it is printing right now
                with contextlib.suppress(Exception):
                    stream.flush()
            os.write(2, f"error: stopped at once by a second {name}; a restart resumes from the latest complete "
                        f"checkpoint in {self.run_dir / 'checkpoints'}\n".encode())  # no print: it may be mid-write
            os._exit(128 + signum)
        self.stop_requested, self.stop_signal, self.ready = True, name, False
        draining.set()
        log.warning("%s: finishing the step in progress, then checkpointing and stopping (a second %s stops at "
                    "once)", name, name)

    def close(self) -> None:
        self.ready = False
        self.rollouts.close()
        self.tracker.close()
        self.servers.close()
        if self.ops is not None:
            self.ops.should_exit = True
        self.run_lock.close()  # the next actor on this run_dir may start
