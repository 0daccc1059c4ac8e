"""Pure PPO math: tensors in, tensors out; no I/O, no config objects.

Shape conventions: ``B`` samples, ``T`` action positions, ``V`` vocabulary; ``mask`` is bool or float
[B, T] with 1 on response-token actions. All reductions run over masked-in entries only.
"""

from algorithms.advantages import compute_gae, token_level_rewards
from algorithms.kl import KLEstimator, kl_penalty
from algorithms.losses import (
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from algorithms.masked import masked_count, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "KLEstimator",
    "compute_gae",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_count",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "token_level_rewards",
    "value_loss",
]
