"""Per-token estimators of KL(policy || reference)."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]

# bounds from the reference formulas: log-ratio before the estimator, estimate after it
_LOG_RATIO_CLAMP = 20.0
_KL_CLAMP = 10.0


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: KLEstimator = "k1",
    absolute: bool = False,
) -> Tensor:
    """Per-token KL estimate between the current policy and the reference policy.

    With ``logr = clamp(ref_logprobs - logprobs, -20, 20)``:
    ``k1 = -logr`` (unbiased, can be negative), ``k2 = logr^2 / 2``, ``k3 = exp(logr) - 1 - logr``
    (unbiased and non-negative). ``absolute`` takes ``|k|`` (use_absolute_kl). The result is clamped to
    [-10, 10]. Positions outside the response are not masked here; the caller masks.

    Args:
        logprobs: float [B, T], log-probs of the taken tokens under the current policy.
        ref_logprobs: float [B, T], the same under the reference policy.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``.
        absolute: return the absolute value of the estimate.

    Returns:
        Float [B, T] of the promoted input dtype.

    Raises:
        ValueError: for an unknown ``estimator``.
    """
    allowed = get_args(KLEstimator)
    if estimator not in allowed:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed values: {', '.join(allowed)}")
    # clamp first so exp() in k3 cannot overflow and -inf log-probs give finite values
    log_ratio = torch.clamp(ref_logprobs - logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if estimator == "k1":
        kl = -log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.expm1(log_ratio) - log_ratio  # expm1: accurate when the ratio is close to 1
    if absolute:
        kl = kl.abs()
    return torch.clamp(kl, -_KL_CLAMP, _KL_CLAMP)
