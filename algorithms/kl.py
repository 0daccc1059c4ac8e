"""Per-token estimators of KL(policy || reference), and the adaptive KL coefficient."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]

# the adaptive controller moves beta by at most +-20% of n_steps / horizon per update
_ADAPTIVE_KL_ERROR_CLIP = 0.2


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: KLEstimator = "k1",
    absolute: bool = False,
    *,
    log_ratio_clamp: float = 20.0,
    output_clamp: float = 10.0,
) -> Tensor:
    """Per-token KL estimate between the current policy and the reference policy.

    With ``logr = clamp(ref_logprobs - logprobs, -log_ratio_clamp, log_ratio_clamp)``:
    ``k1 = -logr`` (unbiased, can be negative), ``k2 = logr^2 / 2``, ``k3 = exp(logr) - 1 - logr``
    (unbiased and non-negative). ``absolute`` takes ``|k|`` (use_absolute_kl). The result is clamped to
    ``[-output_clamp, output_clamp]``. Positions outside the response are not masked here; the caller masks.

    Args:
        logprobs: float [B, T], log-probs of the taken tokens under the current policy.
        ref_logprobs: float [B, T], the same under the reference policy.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``.
        absolute: return the absolute value of the estimate.
        log_ratio_clamp: bound on ``|logr|`` before the estimator (default 20).
        output_clamp: bound on the estimate's magnitude (default 10).

    Returns:
        Float [B, T] of the promoted input dtype.

    Raises:
        ValueError: for an unknown ``estimator``.
    """
    allowed = get_args(KLEstimator)
    if estimator not in allowed:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed values: {', '.join(allowed)}")
    # clamp first so exp() in k3 cannot overflow and -inf log-probs give finite values
    log_ratio = torch.clamp(ref_logprobs - logprobs, -log_ratio_clamp, log_ratio_clamp)
    if estimator == "k1":
        kl = -log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.expm1(log_ratio) - log_ratio  # expm1: accurate when the ratio is close to 1
    if absolute:
        kl = kl.abs()
    return torch.clamp(kl, -output_clamp, output_clamp)


def adaptive_kl_coef(coef: float, observed_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """One update of the adaptive KL controller (trlx / OpenRLHF ``AdaptiveKLController``).

    ``err = clip(observed_kl / target - 1, -0.2, 0.2)``; returns ``coef * (1 + err * n_steps / horizon)``:
    beta grows when the KL is above target and shrinks when it is below. The multiplier stays positive only
    while ``horizon > n_steps / 5``; a multiplier <= 0 is refused rather than turning the penalty into a
    reward (a negative beta, which the trainer would never adapt again).

    Args:
        coef: current KL coefficient beta.
        observed_kl: KL measured since the last update, in the same units as ``target``.
        target: KL target (> 0).
        horizon: controller horizon (> 0); larger means slower adaptation.
        n_steps: number of samples (or steps) since the last update.

    Returns:
        The new coefficient, of ``coef``'s sign.

    Raises:
        ValueError: if ``target`` or ``horizon`` is not positive, or the multiplier is <= 0.
    """
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target=}, {horizon=}")
    error = min(max(observed_kl / target - 1.0, -_ADAPTIVE_KL_ERROR_CLIP), _ADAPTIVE_KL_ERROR_CLIP)
    multiplier = 1.0 + error * n_steps / horizon
    if multiplier <= 0:
        raise ValueError(f"adaptive KL multiplier 1 + ({error:g}) * {n_steps} / {horizon} = {multiplier:g} "
                         f"is not positive: horizon must be > n_steps / {1 / _ADAPTIVE_KL_ERROR_CLIP:g} = "
                         f"{n_steps * _ADAPTIVE_KL_ERROR_CLIP:g}")
    return coef * multiplier
