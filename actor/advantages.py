"""From rewards to advantages, chosen by name once from the config: the reward pipeline (scaling, then
shaping), the advantage estimators of `ppo.adv_estimator.name`, and the whitening that follows them.

Each estimator is a thin adapter from `AdvantageInputs` to one pure function of `algorithms/`; the step calls
`estimator(inputs)` and never branches on the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from algorithms import (
    clip_advantages,
    gae_advantages,
    gae_lambda_per_sample,
    gdpo_advantages,
    grpo_advantages,
    masked_whiten,
    normalize_advantages,
    overlong_penalty,
    raw_reward_advantages,
    reinforce_plus_plus_advantages,
    scale_rewards,
    stop_properly_penalty,
    token_level_rewards,
)

from .config import ActorConfig, AdvEstimatorConfig


@dataclass
class AdvantageInputs:
    """What every estimator may read. Per-token tensors are float32 [B, T] on response actions."""

    rewards: Tensor  # [B] sequence rewards after scaling and shaping
    components: dict[str, Tensor]  # [B] each, after scaling and shaping
    group_ids: Tensor  # int64 [B]
    mask: Tensor  # 1 on response actions
    values: Tensor | None  # critic values, masked; None without a critic
    kl_penalty: Tensor  # beta * KL per token when the KL is in the reward, else zeros


class MissingRewardComponents(ValueError):
    """The reward source did not report the components an estimator needs."""


# inputs -> (advantages [B, T], returns [B, T] for the critic or None)
Estimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]
Whitening = Callable[[Tensor, Tensor], Tensor]


def _gae(cfg: AdvEstimatorConfig) -> Estimator:
    lambda_value = cfg.gae_lambda if cfg.gae_lambda_value is None else cfg.gae_lambda_value

    def estimate(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
        assert x.values is not None
        rewards = token_level_rewards(x.rewards, x.kl_penalty, x.mask, 1.0)  # kl_penalty already carries beta
        lambda_policy = gae_lambda_per_sample(x.mask, cfg.gae_lambda, cfg.gae_lambda_policy, cfg.length_adaptive_alpha)
        return gae_advantages(rewards, x.values, x.mask, cfg.gae_gamma, lambda_value, lambda_policy)
    return estimate


def _raw_reward(cfg: AdvEstimatorConfig) -> Estimator:
    def estimate(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
        return raw_reward_advantages(x.rewards, x.mask) - x.kl_penalty * x.mask, None
    return estimate


def _grpo(cfg: AdvEstimatorConfig) -> Estimator:
    def estimate(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
        return grpo_advantages(x.rewards, x.group_ids, x.mask, leave_one_out=cfg.use_leave_one_out_baseline,
                               normalize=cfg.normalize_rewards), None
    return estimate


def _gdpo(cfg: AdvEstimatorConfig) -> Estimator:
    def estimate(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
        names = cfg.reward_components or sorted(x.components)
        missing = [n for n in names if n not in x.components]
        if missing or len(names) < 2:
            raise MissingRewardComponents(f"ppo.adv_estimator.name=gdpo needs at least two reward components; the reward source "
                             f"reports {sorted(x.components)}, ppo.adv_estimator.reward_components asks for {names}")
        weights = cfg.reward_weights or [1.0] * len(names)
        stacked = torch.stack([x.components[n] for n in names])
        return gdpo_advantages(stacked, weights, x.group_ids, x.mask, leave_one_out=cfg.use_leave_one_out_baseline,
                               normalize=cfg.normalize_rewards), None
    return estimate


def _reinforce_plus_plus(cfg: AdvEstimatorConfig) -> Estimator:
    def estimate(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
        kl = x.kl_penalty if bool(x.kl_penalty.any()) else None
        return reinforce_plus_plus_advantages(x.rewards, x.group_ids, x.mask, cfg.minus_baseline, kl), None
    return estimate


ESTIMATORS: dict[str, Callable[[AdvEstimatorConfig], Estimator]] = {
    "gae": _gae,
    "raw_reward": _raw_reward,
    "grpo": _grpo,
    "gdpo": _gdpo,
    "reinforce_plus_plus": _reinforce_plus_plus,
}


def _identity(advantages: Tensor, mask: Tensor) -> Tensor:
    return advantages


def build_advantages(cfg: AdvEstimatorConfig) -> tuple[Estimator, Whitening]:
    """The estimator of `cfg.name` and the normalisation applied after it: GAE whitens (rsqrt(var + 1e-8)),
    raw_reward normalises (rsqrt(clamp(var, 1e-8))), the group estimators normalise inside; then the optional
    advantage clip."""
    whiten: Whitening = _identity
    if cfg.normalize_advantages and cfg.name == "gae":
        whiten = masked_whiten
    elif cfg.normalize_advantages and cfg.name == "raw_reward":
        whiten = normalize_advantages
    low, high = cfg.advantage_clip_low, cfg.advantage_clip_high

    def finish(advantages: Tensor, mask: Tensor) -> Tensor:
        return clip_advantages(whiten(advantages, mask), low, high) * mask

    return ESTIMATORS[cfg.name](cfg), finish


def reward_shaping(cfg: ActorConfig) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """`ppo.reward_shaping` as one function of (rewards, response_lengths, ended), NeMo-RL's choice: none unless
    enabled; the stop-properly penalty where its coefficient is set; DAPO's overlong penalty otherwise."""
    sh = cfg.ppo.reward_shaping
    if not sh.enabled:
        return lambda rewards, lengths, ended: rewards
    if (coef := sh.stop_properly_penalty_coef) is not None:
        return lambda rewards, lengths, ended: stop_properly_penalty(rewards, ended, coef)
    longest = sh.max_response_length or cfg.policy.generation.max_new_tokens
    return lambda rewards, lengths, ended: rewards + overlong_penalty(
        lengths, longest, sh.overlong_buffer_length, sh.overlong_buffer_penalty)


class RewardPipeline:
    """Sequence rewards -> what the estimators train on: `ppo.reward_scaling`, then `ppo.reward_shaping` (DAPO's
    overlong penalty or the stop-properly penalty), applied alike to the reward and every component. The batch
    keeps the rewards as given, for logging and dynamic sampling."""

    def __init__(self, cfg: ActorConfig):
        self.scaling, self.shape = cfg.ppo.reward_scaling, reward_shaping(cfg)

    def __call__(self, rewards: Tensor, response_lengths: Tensor, ended: Tensor) -> Tensor:
        s = self.scaling
        if s.enabled:
            rewards = scale_rewards(rewards, s.source_min, s.source_max, s.target_min, s.target_max)
        return self.shape(rewards, response_lengths, ended)
