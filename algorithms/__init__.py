"""Pure PPO math: tensors in, tensors out; no I/O, no config objects.

Shape conventions: ``B`` samples, ``T`` action positions, ``V`` vocabulary; ``mask`` is bool or float
[B, T] with 1 on response-token actions. All reductions run over masked-in entries only.

Modules: ``masked`` (reductions), ``kl`` (KL estimators, adaptive coefficient), ``advantages`` (token
rewards, GAE, raw reward), ``group`` (GRPO, GDPO, Reinforce++, group statistics), ``shaping`` (reward scaling
and shaping), ``importance`` (truncated importance sampling), ``losses`` (actor and critic losses).
"""

from algorithms.advantages import (
    clip_advantages,
    compute_gae,
    gae_advantages,
    gae_lambda_per_sample,
    normalize_advantages,
    raw_reward_advantages,
    token_level_rewards,
)
from algorithms.group import (
    gdpo_advantages,
    group_baseline,
    group_reward_std,
    groups_with_signal,
    grpo_advantages,
    reinforce_plus_plus_advantages,
)
from algorithms.importance import ImportanceKind, truncated_importance_weights
from algorithms.kl import KLEstimator, adaptive_kl_coef, kl_penalty
from algorithms.losses import (
    aggregate_loss,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from algorithms.masked import (
    masked_count,
    masked_mean,
    masked_min_max,
    masked_sum,
    masked_var,
    masked_whiten,
)
from algorithms.shaping import overlong_penalty, scale_rewards, stop_properly_penalty

__all__ = [
    "ImportanceKind",
    "KLEstimator",
    "adaptive_kl_coef",
    "aggregate_loss",
    "clip_advantages",
    "compute_gae",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "gae_lambda_per_sample",
    "gdpo_advantages",
    "group_baseline",
    "group_reward_std",
    "groups_with_signal",
    "grpo_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_count",
    "masked_mean",
    "masked_min_max",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_advantages",
    "overlong_penalty",
    "policy_loss",
    "raw_reward_advantages",
    "reinforce_plus_plus_advantages",
    "scale_rewards",
    "stop_properly_penalty",
    "token_level_rewards",
    "truncated_importance_weights",
    "value_loss",
]
