"""Truncated importance sampling for off-policy (async) rollouts: the generator's log-probs differ from
the trainer's rollout-time log-probs, so each token is reweighted by ``w = exp(lp_old - lp_gen)``."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from algorithms.masked import masked_mean, masked_min_max

ImportanceKind = Literal["tis", "icepop", "seq-mask-tis"]


def truncated_importance_weights(
    old_logprobs: Tensor,
    generation_logprobs: Tensor,
    mask: Tensor,
    kind: ImportanceKind,
    low: float,
    high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token importance weights ``w = exp(old_logprobs - generation_logprobs)``, truncated.

    - ``"tis"``: ``clamp(w, low, high)``; the mask is unchanged.
    - ``"icepop"``: ``w`` where ``low <= w <= high``, else 0; the mask is unchanged (zeroed tokens still
      count in the token divisor).
    - ``"seq-mask-tis"``: a row whose geometric-mean weight ``exp(mean log w over its valid tokens)`` lies
      outside ``[low, high]`` is dropped (its weights become 0); kept rows keep their untruncated ``w`` per token,
      as NeMo-RL's and OpenRLHF's do.

    Tokens whose weight is zeroed (``icepop``, or a dropped row) still count in the loss's token divisor, as in
    NeMo-RL, so the mask passed to :func:`algorithms.losses.policy_loss` stays the caller's. A weight that is not a
    finite number (a ratio of two -inf log-probs, or one that overflows) is 0, as NeMo-RL sets it.

    Pass the result to :func:`algorithms.losses.policy_loss` as ``importance_weights``.

    Args:
        old_logprobs: float [B, T], the trainer's log-probs of the taken tokens at rollout time.
        generation_logprobs: float [B, T], the same tokens' log-probs reported by the generation engine.
        mask: bool/float [B, T], 1 on response tokens.
        kind: ``"tis"``, ``"icepop"`` or ``"seq-mask-tis"``.
        low: lower truncation bound (>= 0).
        high: upper truncation bound (>= ``low``).

    Returns:
        ``(weights, metrics)``: detached float [B, T] weights in the promoted input dtype, 0 outside the mask;
        detached 0-dim metrics over the input's valid tokens: ``is_weight_mean``, ``is_weight_min``,
        ``is_weight_max`` (of the untruncated ``w`` over the tokens where it is finite; 0 where none is),
        ``is_clipfrac`` (fraction of tokens whose weight was clamped, zeroed, dropped, or zeroed for not being
        finite) and ``is_dropped_sequences`` (number of dropped rows; 0 for ``tis`` and ``icepop``).

    Raises:
        ValueError: for an unknown ``kind`` or bounds with ``not 0 <= low <= high``.
    """
    allowed = get_args(ImportanceKind)
    if kind not in allowed:
        raise ValueError(f"unknown importance sampling kind {kind!r}; allowed values: {', '.join(allowed)}")
    if not 0.0 <= low <= high:
        raise ValueError(f"importance weight bounds need 0 <= low <= high, got {low}..{high}")
    with torch.no_grad():
        valid = mask.bool()
        dtype = torch.promote_types(old_logprobs.dtype, generation_logprobs.dtype)
        zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
        # 0 at padding so exp() cannot overflow on junk log-probs
        log_w = torch.where(valid, (old_logprobs - generation_logprobs).to(dtype), zero)
        raw = torch.exp(log_w)
        outside = valid & ((raw < low) | (raw > high))
        dropped = torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)
        if kind == "tis":
            weights, truncated = torch.clamp(raw, low, high), outside
        elif kind == "icepop":
            weights, truncated = torch.where(outside, zero, raw), outside
        else:  # seq-mask-tis
            # a log ratio that is no finite number counts as 0 in its row's mean, as NeMo-RL counts it
            seq_weight = torch.exp(masked_mean(torch.nan_to_num(log_w, nan=0.0, posinf=0.0, neginf=0.0), valid, dim=-1))
            dropped = valid.any(dim=-1) & ((seq_weight < low) | (seq_weight > high))
            truncated = valid & dropped.unsqueeze(-1)
            weights = torch.where(truncated, zero, raw)
        # a weight that is no finite number (overflowed, or from log-probs that are not) trains nothing, as in
        # NeMo-RL's loss, instead of making the step's loss NaN or infinite; it counts as zeroed
        finite_weight = torch.isfinite(weights)
        weights = torch.where(valid & finite_weight, weights, zero)
        truncated = truncated | (valid & ~finite_weight)
        # statistics of the finite weights only: one NaN would make all three NaN (null in metrics.jsonl)
        finite = valid & torch.isfinite(raw)
        weight_min, weight_max = masked_min_max(raw, finite)
        metrics = {
            "is_weight_mean": masked_mean(raw, finite),
            "is_weight_min": weight_min,
            "is_weight_max": weight_max,
            "is_clipfrac": masked_mean(truncated.to(dtype), valid),
            "is_dropped_sequences": dropped.sum().to(dtype),
        }
    return weights, metrics
