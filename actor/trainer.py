"""The PPO loop, NeMo-Aligner's PPOTrainer.fit split across services. One step reads top to bottom:
rollouts (critic values and rewards requested per micro-batch, overlapping the actor's own log-prob
passes) -> token rewards with the KL penalty -> GAE -> critic training sent without waiting -> clipped
policy update -> metrics and checkpoints."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from algorithms import (
    compute_gae,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    token_level_rewards,
)
from embedded import resolve_model
from serving.modeling import (
    TORCH_DTYPES,
    attention_mask_from_lengths,
    max_length_of,
    pad_and_stack,
    resolve_device,
    vocab_sha256,
)
from serving.rest import add_ops_routes, start_ops_thread

from .clients import CriticClient, RewardClient, check_compatible
from .config import ActorConfig
from .data import PromptSampler, load_prompts, resolve_data_file
from .generation import Rollout, SamplingParams, TorchGenerationBackend, concat_rollouts
from .tracking import MetricsTracker, Timers

log = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """One step's experience. Per-action tensors are float32 [B, S-1] (action t produced token t+1)."""

    rollout: Rollout
    mask: torch.Tensor
    logprobs: torch.Tensor  # policy at rollout time
    ref_logprobs: torch.Tensor  # frozen reference policy
    values: torch.Tensor  # critic value of the prefix before each action
    scores: torch.Tensor  # [B] sequence reward, before KL
    components: dict[str, torch.Tensor]  # named reward components, [B] each


class PPOTrainer:
    def __init__(self, cfg: ActorConfig):
        self.cfg = cfg
        self.timers = Timers()
        self.registry = CollectorRegistry()
        self.ready = False
        self.stop_requested = False
        self.run_dir = Path(cfg.run_dir)
        self.ops = None
        if cfg.http_port:
            app = FastAPI(title="actor", docs_url=None, redoc_url=None)
            add_ops_routes(app, self.registry, lambda: self.ready)
            self.ops = start_ops_thread(app, cfg.host, cfg.http_port)

        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        dtype = TORCH_DTYPES[cfg.dtype]
        policy_path = resolve_model(cfg.policy)
        self.tokenizer = AutoTokenizer.from_pretrained(policy_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(self.device)
        self.reference = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.reference or cfg.policy), dtype=dtype)
        self.reference.to(self.device).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.ppo.lr, weight_decay=cfg.ppo.weight_decay)
        self.backend = TorchGenerationBackend(self.policy, self.pad_id, self.device)
        g = cfg.generation
        self.sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_k, g.top_p,
                                       (self.tokenizer.eos_token_id, *g.stop_token_ids))
        self.greedy = SamplingParams(g.max_new_tokens, 0.0, 0, 1.0, self.sampling.stop_token_ids)

        d = cfg.data
        self.train_prompts = load_prompts(resolve_data_file(d.train_file), d.prompt_key, self.tokenizer, d.max_prompt_length)
        self.val_prompts = (load_prompts(resolve_data_file(d.val_file), d.prompt_key, self.tokenizer, d.max_prompt_length)
                            if cfg.val_check_interval else [])
        self.sampler = PromptSampler(self.train_prompts, cfg.seed, d.shuffle)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)

        self.critic = CriticClient(cfg.critic)
        self.reward = RewardClient(cfg.reward) if cfg.reward.source == "server" else None
        self._check_servers()
        self.tracker = MetricsTracker(self.run_dir, cfg.max_steps, self.registry)

    def _check_servers(self) -> None:
        longest = max(len(p) for p in self.train_prompts + self.val_prompts)
        needed = longest + self.cfg.generation.max_new_tokens
        why = f"the longest prompt ({longest} tokens) + generation.max_new_tokens ({self.cfg.generation.max_new_tokens})"
        if max_length_of(self.policy) < needed:
            raise SystemExit(f"the policy accepts at most {max_length_of(self.policy)} tokens, but {why} need {needed}")
        sha, vocab = vocab_sha256(self.tokenizer), len(self.tokenizer)
        critic_info = self.critic.info()
        check_compatible("critic", critic_info, sha, vocab, needed, why)
        if self.reward is not None:
            check_compatible("reward", self.reward.info(), sha, vocab, needed, why)
        elif not critic_info.serves_rewards:
            raise SystemExit("reward.source=critic needs a combined RM + critic server (critic_server --reward-model ...)")

    # --- rollouts -------------------------------------------------------------------------------
    def logprobs(self, model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Log-prob of each next token, float32 [B, S-1], in micro-batches, without gradients."""
        out = []
        mbs = self.cfg.ppo.micro_batch_size
        with torch.no_grad():
            for i in range(0, tokens.shape[0], mbs):
                tok, n = tokens[i:i + mbs].to(self.device), lengths[i:i + mbs].to(self.device)
                logits = model(input_ids=tok, attention_mask=attention_mask_from_lengths(n, tok.shape[1])).logits
                out.append(logprobs_from_logits(logits[:, :-1].float(), tok[:, 1:]).cpu())
        return torch.cat(out)

    def generate_rollouts(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> RolloutBatch:
        """Generate per micro-batch; after each, send the critic and reward requests and compute the
        policy and reference log-probs while the servers work."""
        t = self.timers
        parts = []
        mbs = self.cfg.ppo.rollout_micro_batch_size
        for i in range(0, len(prompts), mbs):
            with t("generate"):
                r = self.backend.generate(prompts[i:i + mbs], params, seed=seed * 100_003 + i)
            values = self.critic.infer(r.tokens, r.lengths)
            scores = self.reward.score(r.tokens, r.lengths, r.prompt_lengths) if self.reward else None
            with t("logprobs"):
                lp = self.logprobs(self.policy, r.tokens, r.lengths)
            with t("init_logprobs"):
                ref = self.logprobs(self.reference, r.tokens, r.lengths)
            parts.append((r, values, scores, lp, ref))
        with t("critic_wait"):
            remote = [(v.result(), s.result() if s else None) for _, v, s, _, _ in parts]
        rollout = concat_rollouts([p[0] for p in parts], self.pad_id)
        values = pad_and_stack([v for (v, _), _ in remote])
        if self.reward is not None:
            scores = torch.cat([s[0] for _, s in remote])
            names = remote[0][1][1].keys()
            components = {k: torch.cat([s[1][k] for _, s in remote]) for k in names}
        else:
            scores, components = torch.cat([rw for (_, rw), _ in remote]), {}
        return RolloutBatch(
            rollout=rollout,
            mask=rollout.action_mask(),
            logprobs=pad_and_stack([p[3] for p in parts]),
            ref_logprobs=pad_and_stack([p[4] for p in parts]),
            values=values[:, :-1],
            scores=scores.float(),
            components=components,
        )

    # --- the policy update ----------------------------------------------------------------------
    def train_policy(self, batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
        """ppo_epochs passes; one optimizer step per global batch, micro-batched; token-level loss (the
        micro-batch losses add up to the global batch's loss)."""
        p = self.cfg.ppo
        tokens, lengths, mask = batch.rollout.tokens, batch.rollout.lengths, batch.mask
        weighted: dict[str, float] = dict.fromkeys(("ppo_ratio", "ppo_ratio_clamped", "approx_kl", "entropy"), 0.0)
        n_tokens_seen, ratio_min, ratio_max = 0.0, float("inf"), float("-inf")
        loss_sum, grad_norm_sum, n_steps = 0.0, 0.0, 0
        max_norm = p.grad_clip if p.grad_clip > 0 else float("inf")
        # The policy stays in eval mode: no dropout, so the first epoch's ratio is exactly 1 (NeMo-Aligner too).
        for _ in range(p.ppo_epochs):
            perm = torch.randperm(tokens.shape[0], generator=self.shuffle_gen)
            for g in range(0, len(perm), p.global_batch_size):
                idx = perm[g:g + p.global_batch_size]
                n_tokens = float(mask[idx].sum().clamp(min=1))
                self.optimizer.zero_grad(set_to_none=True)
                for m in range(0, len(idx), p.micro_batch_size):
                    mi = idx[m:m + p.micro_batch_size]
                    w = int(lengths[mi].max())  # trim the micro-batch to its longest row
                    tok, n = tokens[mi, :w].to(self.device), lengths[mi].to(self.device)
                    mk = mask[mi, :w - 1].to(self.device)
                    logits = self.policy(input_ids=tok, attention_mask=attention_mask_from_lengths(n, w)).logits[:, :-1].float()
                    lp = logprobs_from_logits(logits, tok[:, 1:])
                    pg_loss, stats = policy_loss(lp, batch.logprobs[mi, :w - 1].to(self.device),
                                                 advantages[mi, :w - 1].to(self.device), mk,
                                                 clip_low=p.ratio_eps, clip_high=p.ratio_eps, num_tokens=n_tokens)
                    entropy_sum = masked_sum(entropy_from_logits(logits), mk)
                    loss = pg_loss - p.entropy_bonus * entropy_sum / n_tokens
                    loss.backward()
                    loss_sum += float(loss.detach())
                    k = float(mk.sum())
                    if k > 0:
                        n_tokens_seen += k
                        for name, key in (("ppo_ratio", "ratio_mean"), ("ppo_ratio_clamped", "clipfrac"), ("approx_kl", "approx_kl")):
                            weighted[name] += float(stats[key]) * k
                        weighted["entropy"] += float(entropy_sum.detach())
                        ratio_min = min(ratio_min, float(stats["ratio_min"]))
                        ratio_max = max(ratio_max, float(stats["ratio_max"]))
                grad_norm_sum += float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm))
                self.optimizer.step()
                n_steps += 1
        return {
            "train_optim/loss": loss_sum / n_steps,
            **{f"train_optim/{k}": v / max(n_tokens_seen, 1.0) for k, v in weighted.items()},
            "train_optim/ppo_ratio_min": ratio_min,
            "train_optim/ppo_ratio_max": ratio_max,
            "train_optim/grad_norm": grad_norm_sum / n_steps,
            "train_optim/lr": self.optimizer.param_groups[0]["lr"],
        }

    # --- one step -------------------------------------------------------------------------------
    def step(self, step: int) -> tuple[dict[str, float], RolloutBatch]:
        p, t = self.cfg.ppo, self.timers
        with t("rollout_time"):
            batch = self.generate_rollouts(self.sampler.take(p.num_rollout_samples), self.sampling, seed=self.cfg.seed + step)
        mask = batch.mask
        kl = kl_penalty(batch.logprobs, batch.ref_logprobs, p.kl_estimator, absolute=p.use_absolute_kl) * mask
        rewards = token_level_rewards(batch.scores, kl, mask, p.kl_coef)
        advantages, returns = compute_gae(rewards, batch.values * mask, mask, p.gamma, p.lam)
        if p.normalize_advantages:
            advantages = masked_whiten(advantages, mask)

        critic_train = self.critic.train(batch.rollout.tokens, returns, batch.values * mask, mask)  # not awaited
        with t("train_time"):
            metrics = self.train_policy(batch, advantages)
        with t("critic_train_wait"):
            critic = critic_train.result()

        r = batch.rollout
        metrics.update({
            "train_rollouts/rollout_size": float(r.tokens.shape[0]),
            "train_rollouts/rewards": float(batch.scores.mean()),
            "train_rollouts/init_policy_kl": float(kl.sum(1).mean()),
            "train_rollouts/rewards_with_kl": float(rewards.sum(1).mean()),
            "train_rollouts/response_lengths": float(r.response_lengths.float().mean()),
            "train_rollouts/prompt_lengths": float(r.prompt_lengths.float().mean()),
            "train_rollouts/fraction_of_samples_properly_ended": float(r.ended.float().mean()),
            **{f"train_rollouts/{k}": float(v.mean()) for k, v in batch.components.items()},
            "critic/loss": critic.loss,
            "critic/train_step": float(critic.train_step),
            **{f"critic/{k}": v for k, v in critic.metrics.items()},
        })
        for name, x in (("advantages", advantages), ("returns", returns), ("values", batch.values)):
            metrics[f"train_rollouts/{name}_mean"] = float(masked_mean(x, mask))
            metrics[f"train_rollouts/{name}_std"] = float(masked_var(x, mask).sqrt())
        return metrics, batch

    def validate(self) -> dict[str, float]:
        with self.timers("validation_time"):
            batch = self.generate_rollouts(self.val_prompts[: self.cfg.num_val_samples], self.greedy, seed=0)
        return {"val/rewards": float(batch.scores.mean()),
                "val/response_lengths": float(batch.rollout.response_lengths.float().mean()),
                **{f"val/{k}": float(v.mean()) for k, v in batch.components.items()}}

    def samples_table(self, batch: RolloutBatch, n: int) -> str:
        r = batch.rollout
        lines = []
        for i in range(min(n, r.tokens.shape[0])):
            prompt = self.tokenizer.decode(r.tokens[i, : r.prompt_lengths[i]], skip_special_tokens=True)
            response = self.tokenizer.decode(r.tokens[i, r.prompt_lengths[i]: r.lengths[i]], skip_special_tokens=True)
            lines.append(f"  reward {float(batch.scores[i]):+.3f} | {prompt} | {response}")
        return "\n".join(lines)

    # --- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        """<run_dir>/checkpoints/step_N/: actor/ (Hugging Face format), checkpoint.json naming the
        critic checkpoint the critic server wrote. Written as tmp_step_N, then renamed."""
        root = self.run_dir / "checkpoints"
        tmp, final = root / f"tmp_step_{step}", root / f"step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.policy.save_pretrained(tmp / "actor")
        self.tokenizer.save_pretrained(tmp / "actor")
        critic_path = self.critic.save(f"step_{step}")
        meta = {"step": step, "actor": str((final / "actor").resolve()), "critic": critic_path,
                "consumed_samples": self.sampler.consumed, "epoch": self.sampler.epoch}
        (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def fit(self) -> list[dict]:
        cfg = self.cfg
        signal.signal(signal.SIGTERM, self._request_stop)
        self.ready = True
        last_batch = None
        for step in range(1, cfg.max_steps + 1):
            start = time.perf_counter()
            metrics, last_batch = self.step(step)
            if step == 1 and cfg.log_samples:
                self.tracker.write("samples before training (step 1):\n" + self.samples_table(last_batch, cfg.log_samples))
            if cfg.val_check_interval and (step % cfg.val_check_interval == 0 or step == 1 or step == cfg.max_steps):
                metrics.update(self.validate())
            metrics.update(self.timers.pop())
            metrics["timers/step_time"] = time.perf_counter() - start
            metrics["consumed_samples"] = float(self.sampler.consumed)
            self.tracker.log(step, metrics)
            last = step == cfg.max_steps or self.stop_requested
            if last or (cfg.save_interval and step % cfg.save_interval == 0):
                path = self.save_checkpoint(step)
                self.tracker.write(f"step {step}: checkpoint {path}")
            if self.stop_requested:
                self.tracker.write(f"stopping after step {step} (SIGTERM)")
                break
        if cfg.log_samples and last_batch is not None:
            self.tracker.write("samples after training:\n" + self.samples_table(last_batch, cfg.log_samples))
        curve = self.tracker.plot_reward_curve()
        self.tracker.write(f"reward curve: {curve}")
        return self.tracker.history

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True

    def close(self) -> None:
        self.ready = False
        self.tracker.close()
        self.critic.close()
        if self.reward is not None:
            self.reward.close()
        if self.ops is not None:
            self.ops.should_exit = True
