"""PPO actor and critic losses, and per-token quantities computed from logits.

Aggregation is token-level: the masked sum of per-token losses divided by a token count. Pass
``num_tokens`` = the number of valid tokens in the whole global batch (summed over micro-batches and
data-parallel ranks) so that the micro-batch losses add up to the full-batch loss and its gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from algorithms.masked import masked_mean, masked_sum, masked_var

_EV_VAR_FLOOR = 1e-8  # keeps explained variance finite when the returns are constant


def _token_mean(per_token: Tensor, mask: Tensor, num_tokens: float | None) -> Tensor:
    """Masked sum of ``per_token`` over ``num_tokens`` (default: the local valid count, at least 1)."""
    if num_tokens is None:
        return masked_mean(per_token, mask)
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return masked_sum(per_token, mask) / num_tokens


def _masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Min and max of ``x`` over valid entries; both 0 when there are none."""
    valid = mask.bool().expand_as(x)
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    # fill with +-inf rather than index, so there is no host sync on GPU
    x_min = torch.where(valid, x, inf).amin()
    x_max = torch.where(valid, x, -inf).amax()
    any_valid = valid.any()
    return torch.where(any_valid, x_min, zero), torch.where(any_valid, x_max, zero)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss, aggregated at token level.

    Per token, with ``r = exp(logprobs - old_logprobs)``:
    ``max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))`` (clip_high > clip_low is DAPO clip-higher).

    Args:
        logprobs: float [B, T], current policy log-probs of the taken tokens (carries the gradient).
        old_logprobs: float [B, T], log-probs at rollout time.
        advantages: float [B, T], per-token advantages (already whitened if desired).
        mask: bool/float [B, T], 1 on tokens that count in the loss.
        clip_low: lower clip range epsilon.
        clip_high: upper clip range epsilon.
        num_tokens: divisor of the masked sum; the global valid-token count when this is one micro-batch
            of a larger batch. ``None`` uses this batch's own count.

    Returns:
        ``(loss, metrics)``: a 0-dim loss, and detached 0-dim metrics over valid tokens:
        ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``clipfrac`` (fraction of tokens whose loss comes from
        the clipped branch), ``approx_kl`` (mean of ``(r - 1) - log r``, the non-negative k3 estimator of
        KL(old || current)).
    """
    valid = mask.bool()
    # zero the log-ratio outside the mask so padding cannot overflow exp() and send NaN into the gradients
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = _token_mean(per_token, mask, num_tokens)

    with torch.no_grad():
        ratio_min, ratio_max = _masked_min_max(ratio, mask)
        metrics = {
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
        }
    return loss, {name: value.detach() for name, value in metrics.items()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - V) / max(Var(R), 1e-8)`` over valid tokens (biased variances).

    1 is a perfect critic, 0 is no better than predicting the mean return, negative is worse.

    Args:
        values: float [B, T], critic predictions.
        returns: float [B, T], targets.
        mask: bool/float [B, T].

    Returns:
        0-dim tensor in the promoted dtype.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    return 1.0 - var_residual / torch.clamp(var_returns, min=_EV_VAR_FLOOR)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    scale: float = 1.0,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, aggregated at token level.

    ``V_clip = V_old + clamp(V - V_old, -clip, clip)``;
    ``loss = 0.5 * scale * mean(max((V - R)^2, (V_clip - R)^2))``. ``clip <= 0`` disables clipping.

    Args:
        values: float [B, T], current critic values (carries the gradient).
        old_values: float [B, T], critic values at rollout time.
        returns: float [B, T], GAE returns (never whitened).
        mask: bool/float [B, T].
        clip: clip range around ``old_values``; ``<= 0`` disables it.
        scale: loss multiplier.
        num_tokens: as in :func:`policy_loss`.

    Returns:
        ``(loss, metrics)``: a 0-dim loss, and detached 0-dim metrics over valid tokens: ``vf_clipfrac``
        (fraction of tokens whose loss comes from the clipped value), ``explained_variance``,
        ``values_mean``, ``returns_mean``.
    """
    unclipped = (values - returns).square()
    if clip > 0:
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (clipped_values - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    else:
        per_token = unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    loss = 0.5 * scale * _token_mean(per_token, mask, num_tokens)

    with torch.no_grad():
        metrics = {
            "vf_clipfrac": clipfrac,
            "explained_variance": explained_variance(values, returns, mask),
            "values_mean": masked_mean(values, mask),
            "returns_mean": masked_mean(returns, mask),
        }
    return loss, {name: value.detach() for name, value in metrics.items()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position.

    ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(logits)`` (stable for large logits). Computed one
    row of the batch at a time so only one [T, V] temporary is alive.

    Args:
        logits: float [B, T, V].

    Returns:
        Float [B, T] in ``logits.dtype``.
    """
    rows = []
    for row in logits:
        log_probs = F.log_softmax(row, dim=-1)
        rows.append(-(log_probs.exp() * log_probs).sum(dim=-1))
    return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:-1])


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under the softmax of its logits.

    Equal to ``log_softmax(logits).gather(-1, labels)``, computed one batch row at a time; in fp32/fp64 as
    ``logit[label] - logsumexp(logits)`` so the full [T, V] log-softmax is never materialised.

    Args:
        logits: float [B, T, V].
        labels: int64 [B, T], token ids in ``[0, V)``.

    Returns:
        Float [B, T] in ``logits.dtype``.
    """
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):
        index = row_labels.unsqueeze(-1)
        if row_logits.dtype in (torch.float32, torch.float64):
            picked = row_logits.gather(-1, index).squeeze(-1)
            rows.append(picked - torch.logsumexp(row_logits, dim=-1))
        else:
            # logsumexp loses too much precision in bf16/fp16; a per-row log_softmax is still small
            rows.append(F.log_softmax(row_logits, dim=-1).gather(-1, index).squeeze(-1))
    return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:-1])
