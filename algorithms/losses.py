"""PPO actor and critic losses, and per-token quantities computed from logits.

Token-level aggregation divides the masked sum of per-token losses by a token count; sequence-level
aggregation averages each row over its tokens and divides the sum over rows by a sequence count. Pass the
counts of the whole global batch (``num_tokens``, ``num_sequences``: summed over micro-batches and
data-parallel ranks) so that the micro-batch losses add up to the full-batch loss and its gradients.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from algorithms.kl import kl_penalty
from algorithms.masked import accumulated, masked_count, masked_mean, masked_min_max, masked_sum, masked_var

_EV_VAR_FLOOR = 1e-8  # keeps explained variance finite when the returns are constant
# |log r| bound before exp() in the surrogate (verl's): exp(100) = inf, whose backward gives 0 * inf = NaN
_LOG_RATIO_CLAMP = 20.0


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    aggregation: Literal["token", "sequence"] = "token",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """Reduce a per-token loss (or bonus, e.g. the entropy) to a scalar the way :func:`policy_loss` does.

    ``"token"``: masked sum over ``num_tokens`` (default: the local valid count, at least 1).
    ``"sequence"``: each row's mean over its valid tokens, summed over rows with >= 1 valid token, over
    ``num_sequences`` (default: the local count of such rows, at least 1). With the global counts, the
    results of micro-batches of whole rows add up to the full batch's.

    Args:
        per_token: float [B, T].
        mask: bool/float [B, T], 1 on tokens that count.
        aggregation: ``"token"`` or ``"sequence"``.
        num_tokens: divisor of the token-level sum.
        num_sequences: divisor of the sequence-level sum.

    Returns:
        0-dim tensor in ``per_token.dtype``, summed and divided in at least float32 (an fp16 sum of 80k
        tokens' losses overflows).

    Raises:
        ValueError: for an unknown ``aggregation`` or a non-positive divisor.
    """
    wide = accumulated(per_token)
    if aggregation == "token":
        if num_tokens is None:
            return masked_mean(wide, mask).to(per_token.dtype)
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        return (masked_sum(wide, mask) / num_tokens).to(per_token.dtype)
    if aggregation != "sequence":
        raise ValueError(f"unknown aggregation {aggregation!r}; allowed values: token, sequence")
    counts = masked_count(wide, mask, dim=-1)
    has_tokens = counts > 0
    per_sequence = masked_sum(wide, mask, dim=-1) / counts.clamp(min=1)
    total = torch.where(has_tokens, per_sequence, torch.zeros_like(per_sequence)).sum()
    if num_sequences is None:
        return (total / has_tokens.sum().clamp(min=1)).to(per_token.dtype)
    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    return (total / num_sequences).to(per_token.dtype)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_tokens: float | None = None,
    *,
    clip_c: float | None = None,
    aggregation: Literal["token", "sequence"] = "token",
    num_sequences: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss, with optional dual clip, importance weights and KL-to-reference.

    Per token, with ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``:
    ``L = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))`` (clip_high > clip_low is DAPO clip-higher);
    dual clip where ``A < 0`` only: ``L = min(L, -clip_c A)``; then ``L *= importance_weights`` (detached);
    then ``L += kl_coef * kl_penalty(logprobs, ref_logprobs, kl_type)`` when ``kl_coef > 0`` and
    ``ref_logprobs`` is given (this term carries gradient through ``logprobs``).

    The log-ratio is clamped to ``[-20, 20]`` before ``exp`` (as verl does; the KL estimators clamp at the
    same bound): a token beyond it gets no gradient through the ratio, where ``exp(100) = inf`` gave a finite
    loss and a NaN gradient that lost the whole optimizer step. Inside the bound nothing changes; the ratio
    metrics see the clamped ratio.

    Aggregation (:func:`aggregate_loss`) ``"token"``: masked sum over ``num_tokens`` (default: this batch's
    valid-token count). ``"sequence"``: each row's mean over its valid tokens, summed over rows with >= 1
    valid token, over ``num_sequences`` (default: this batch's count of such rows). Pass the global counts
    when this call is one micro-batch (whole rows) of a larger batch: micro-batch losses and gradients then
    add up to the full-batch ones in both modes.

    Args:
        logprobs: float [B, T], current policy log-probs of the taken tokens (carries the gradient).
        old_logprobs: float [B, T], log-probs at rollout time.
        advantages: float [B, T], per-token advantages (already whitened if desired).
        mask: bool/float [B, T], 1 on tokens that count in the loss.
        clip_low: lower clip range epsilon.
        clip_high: upper clip range epsilon.
        num_tokens: divisor of the token-level sum (global valid-token count); None: local count.
        clip_c: dual-clip constant c > 1 (``ratio_clip_c``); None disables the dual clip.
        aggregation: ``"token"`` or ``"sequence"``.
        num_sequences: divisor of the sequence-level sum (global count of rows with a valid token).
        ref_logprobs: float [B, T], reference policy log-probs; needed for the KL term and its metric.
        kl_coef: beta of the KL term in the loss; 0 leaves it out.
        kl_type: KL estimator, ``"k1"``, ``"k2"`` or ``"k3"`` (see :func:`algorithms.kl.kl_penalty`).
        importance_weights: float [B, T] per-token weights of the surrogate (e.g. truncated IS); detached.

    Returns:
        ``(loss, metrics)``: a 0-dim loss, and detached 0-dim metrics over valid tokens:
        ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``clipfrac`` (fraction of tokens whose surrogate comes
        from the clipped branch), ``dual_clipfrac`` (fraction where the dual clip was active), ``approx_kl``
        (mean of ``(r - 1) - log r``, the non-negative k3 estimator of KL(old || current)), ``kl_penalty``
        (mean per-token KL to the reference, unscaled; 0 without ``ref_logprobs``).

    Raises:
        ValueError: for ``clip_c <= 1``, an unknown ``aggregation`` or KL estimator, or a non-positive
            ``num_tokens`` / ``num_sequences``.
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual clip constant clip_c must be > 1, got {clip_c}")
    if aggregation not in ("token", "sequence"):
        raise ValueError(f"unknown aggregation {aggregation!r}; allowed values: token, sequence")
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # zero the log-ratio outside the mask so padding cannot overflow exp() and send NaN into the gradients;
    # clamp it inside, for the same reason
    log_ratio = torch.clamp(logprobs - old_logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    log_ratio = torch.where(valid, log_ratio, zero)
    ratio = torch.exp(log_ratio)
    advantages = torch.where(valid, advantages, zero)  # junk advantages at padding would NaN the gradient too
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(valid)
    if clip_c is not None:
        # only for A < 0: there -c A > 0 caps the loss of a huge ratio; for A > 0 it would be a wrong floor
        dual_bound = -clip_c * advantages
        dual_active = valid & (advantages < 0) & (per_token > dual_bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, dual_bound), per_token)
    if importance_weights is not None:
        per_token = per_token * torch.where(valid, importance_weights.detach(), zero)

    kl = None
    if ref_logprobs is not None:
        # padding may hold -inf/NaN log-probs: give the estimator zeros there so its gradient stays finite
        safe_logprobs = torch.where(valid, logprobs, zero)
        safe_ref = torch.where(valid, ref_logprobs, zero)
        with torch.set_grad_enabled(torch.is_grad_enabled() and kl_coef > 0):  # metric only: no graph
            kl = kl_penalty(safe_logprobs, safe_ref, kl_type)  # type: ignore[arg-type]
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl

    loss = aggregate_loss(per_token, mask, aggregation, num_tokens, num_sequences)

    with torch.no_grad():
        ratio_min, ratio_max = masked_min_max(ratio, mask)
        metrics = {
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "dual_clipfrac": masked_mean(dual_active.to(ratio.dtype), mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "kl_penalty": zero if kl is None else masked_mean(kl, mask),
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
    valid = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # mask the differences before squaring: the backward of x^2 is 2x * grad, and 2 NaN * 0 is still NaN
    unclipped = torch.where(valid, values - returns, zero).square()
    if clip > 0:
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = torch.where(valid, clipped_values - returns, zero).square()
        per_token = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    else:
        per_token = unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    loss = 0.5 * scale * aggregate_loss(per_token, mask, "token", num_tokens)

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

    ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(logits)`` (stable for large logits). Logits of
    ``-inf`` (masked vocabulary entries, p = 0) contribute 0 to the entropy and get a 0 gradient; each
    position needs at least one finite logit. Computed one row of the batch at a time so only one [T, V]
    temporary is alive.

    Args:
        logits: float [B, T, V].

    Returns:
        Float [B, T] in ``logits.dtype``.
    """
    rows = []
    for row in logits:
        log_probs = F.log_softmax(row, dim=-1)
        # 0 * -inf is NaN, and so is its gradient even behind a where: replace log p before the product
        safe_log_probs = torch.where(torch.isneginf(log_probs), torch.zeros_like(log_probs), log_probs)
        rows.append(-(log_probs.exp() * safe_log_probs).sum(dim=-1))
    return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:-1])


def logprobs_from_logits(logits: Tensor, labels: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Log-probability of each label under the softmax of its logits.

    Equal to ``log_softmax(logits).gather(-1, labels)``, computed one batch row at a time; in fp32/fp64 as
    ``logit[label] - logsumexp(logits)`` so the full [T, V] log-softmax is never materialised.

    Args:
        logits: float [B, T, V].
        labels: int64 [B, T], token ids in ``[0, V)``.
        dtype: compute in this dtype, each row converted on its own: bf16 logits with ``dtype=torch.float32`` give
            the same values as ``logits.float()`` would, without a float32 copy of the whole [B, T, V] tensor
            (for a large vocabulary, gigabytes). Default: ``logits.dtype``.

    Returns:
        Float [B, T] in ``dtype`` (default ``logits.dtype``).
    """
    dtype = dtype or logits.dtype
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):
        row_logits = row_logits.to(dtype)
        index = row_labels.unsqueeze(-1)
        if row_logits.dtype in (torch.float32, torch.float64):
            picked = row_logits.gather(-1, index).squeeze(-1)
            rows.append(picked - torch.logsumexp(row_logits, dim=-1))
        else:
            # logsumexp loses too much precision in bf16/fp16; a per-row log_softmax is still small
            rows.append(F.log_softmax(row_logits, dim=-1).gather(-1, index).squeeze(-1))
    return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:-1], dtype=dtype)
