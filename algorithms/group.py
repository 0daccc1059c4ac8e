"""Group-relative advantage estimators without a critic: GRPO, GDPO, Reinforce++, and group statistics.

A group is the set of generations of one prompt: ``group_ids`` is an int64 Tensor [B], samples with equal
ids form one group (ids need not be contiguous or sorted). ``valid`` is an optional bool Tensor [B] of the
samples that count in a group's baseline and std (default: all). Sequence-level results are [B]; the
``*_advantages`` estimators broadcast them to the valid tokens of ``mask`` [B, T].

Baselines and stds are computed from differences of rewards inside each group, so a group of equal rewards
gives advantages and stds of exactly 0 in any dtype (the float32 mean of a constant group is not exactly its
members, and dividing that residue by a ~0 std is the near-constant group trap).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from algorithms.advantages import normalize_advantages
from algorithms.masked import widened

# |std| below this counts as 0: float32 residue of a near-constant group must not be divided by
_STD_TOLERANCE = 1e-6


def _dense_slots(group_ids: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """Place each sample in a dense [G, N] grid: row = its group, column = its rank inside the group.

    Returns ``(row, col, G, N)`` with ``row, col`` int64 [B], G the number of groups and N the largest
    group size.
    """
    _, row, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    # stable sort keeps the batch order inside a group, so ranks are deterministic
    order = torch.argsort(row, stable=True)
    starts = torch.cumsum(counts, dim=0) - counts
    col = torch.empty_like(row)
    col[order] = torch.arange(row.numel(), device=row.device) - starts[row[order]]
    return row, col, counts.numel(), int(counts.max()) if counts.numel() else 0


def _group_stats(
    scores: Tensor,
    group_ids: Tensor,
    leave_one_out: bool,
    valid: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample ``(r - baseline, baseline, std)``, each [B] in ``scores.dtype``; see :func:`group_baseline`.

    Sample i's reference set is the valid members of its group, minus i itself under leave-one-out.
    Everything is computed from differences of rewards so that equal rewards give exactly 0:
    leave-one-out uses ``A_i = mean_j (r_i - r_j)`` and the std of the others shifted by the first of them (in
    float64, never relative to ``r_i``, whose outlier would swamp their spread); the mean baseline shifts the
    group by its first valid member, so all members share one std. Groups with at most one valid sample give
    ``A = 0``, ``b = r``, ``std = 0``; a reference set of one gives ``std = 0``.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores and group_ids must both be [B], got {tuple(scores.shape)}, "
                         f"{tuple(group_ids.shape)}")
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    # invalid scores (possibly NaN) never enter a sum: they only need a finite placeholder
    safe = torch.where(valid, scores, zero)
    if scores.numel() == 0:
        return safe, safe, safe
    row, col, n_groups, size = _dense_slots(group_ids)
    dense = scores.new_zeros(n_groups, size)
    dense[row, col] = safe
    present = torch.zeros(n_groups, size, dtype=torch.bool, device=scores.device)
    present[row, col] = valid
    n_valid = present.sum(dim=-1).to(scores.dtype)  # [G]

    if leave_one_out:
        others = present[row] & (torch.arange(size, device=scores.device) != col.unsqueeze(-1))  # [B, N]
        n_ref = others.sum(dim=-1).to(scores.dtype)
        diff = safe.unsqueeze(-1) - dense[row]  # r_i - r_j
        advantage = torch.where(others, diff, zero).sum(dim=-1) / n_ref.clamp(min=1)
        # the std of the others from their own values, shifted by the first of them, in float64: deviations
        # taken relative to r_i cancel catastrophically when r_i is an outlier (1e30 beside rewards of ~1)
        wide = widened(dense)[row]  # [B, N]
        pivot = wide.gather(-1, others.to(torch.int8).argmax(dim=-1, keepdim=True))  # [B, 1]
        wide_zero, wide_n = torch.zeros((), dtype=wide.dtype, device=wide.device), n_ref.to(wide.dtype)
        shifted = torch.where(others, wide - pivot, wide_zero)
        mean_shift = shifted.sum(dim=-1, keepdim=True) / wide_n.clamp(min=1).unsqueeze(-1)
        deviation = torch.where(others, shifted - mean_shift, wide_zero)  # r_j - b_i
        var = deviation.square().sum(dim=-1) / (wide_n - 1).clamp(min=1)
        std = torch.where(n_ref > 1, var.sqrt().to(scores.dtype), zero)
    else:
        # first valid member of each group (argmax returns the first maximum); any member would do
        first = present.to(torch.int8).argmax(dim=-1, keepdim=True)
        reference = dense.gather(-1, first)  # [G, 1]
        shifted = torch.where(present, dense - reference, zero)  # [G, N]
        mean_shift = shifted.sum(dim=-1) / n_valid.clamp(min=1)
        deviation = torch.where(present, shifted - mean_shift.unsqueeze(-1), zero)
        var = widened(deviation).square().sum(dim=-1) / (n_valid - 1).clamp(min=1)  # float64: no overflow
        std = torch.where(n_valid > 1, var.sqrt().to(scores.dtype), zero)[row]
        advantage = (safe - reference.squeeze(-1)[row]) - mean_shift[row]

    enough = n_valid[row] > 1
    advantage = torch.where(enough, advantage, zero)
    baseline = torch.where(enough, safe - advantage, scores)
    std = torch.where(enough, std, zero)
    return advantage, baseline, std


def _broadcast(sequence_values: Tensor, mask: Tensor) -> Tensor:
    """[B] values on the valid tokens of ``mask`` [B, T], 0 elsewhere."""
    zero = torch.zeros((), dtype=sequence_values.dtype, device=sequence_values.device)
    return torch.where(mask.bool(), sequence_values.unsqueeze(-1), zero)


def group_baseline(
    scores: Tensor,
    group_ids: Tensor,
    leave_one_out: bool,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-sample group baseline and the unbiased std of the same reference set.

    Mean baseline: the mean and std over the valid members of the sample's group. Leave-one-out:
    ``b_i = sum_{j != i, valid} r_j / n_valid_others`` and the std over those others. A group with at most
    one valid sample gives ``b = r`` (so ``A = 0``) and ``std = 0``; a reference set of a single sample has
    ``std = 0``. An invalid sample's baseline is computed from its group's valid members.

    Args:
        scores: float [B], one reward per sample.
        group_ids: int64 [B], equal ids = generations of one prompt.
        leave_one_out: exclude the sample itself from its baseline.
        valid: bool [B] of samples that count in baselines and stds; None means all.

    Returns:
        ``(baseline, std)``, both float [B] in ``scores.dtype``.
    """
    _, baseline, std = _group_stats(scores, group_ids, leave_one_out, valid)
    return baseline, std


def _grpo_sequence_advantages(
    scores: Tensor,
    group_ids: Tensor,
    leave_one_out: bool,
    normalize: bool,
    valid: Tensor | None,
    epsilon: float,
) -> Tensor:
    """GRPO advantage per sample [B]; see :func:`grpo_advantages`."""
    advantage, _, std = _group_stats(scores, group_ids, leave_one_out, valid)
    if normalize:
        # std <= epsilon counts as 0 (fp32 residue of a near-constant group): keep A unscaled there
        advantage = torch.where(std > epsilon, advantage / (std + epsilon), advantage)
    if valid is not None:
        advantage = torch.where(valid.bool(), advantage, torch.zeros_like(advantage))
    return advantage


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    leave_one_out: bool = True,
    normalize: bool = True,
    valid: Tensor | None = None,
    epsilon: float = 1e-6,
) -> Tensor:
    """GRPO: group-relative advantage ``A = r - b`` of each sample, on its response tokens.

    ``b`` and ``std`` are those of :func:`group_baseline`. With ``normalize``, ``A / (std + epsilon)`` where
    ``std > epsilon``; a smaller std is treated as 0 and ``A`` is left unscaled (near-constant float32 groups
    would otherwise blow up). Groups with at most one valid sample, and invalid samples, get ``A = 0``.

    Args:
        scores: float [B], one reward per sample.
        group_ids: int64 [B], equal ids = generations of one prompt.
        mask: bool/float [B, T], 1 on response tokens.
        leave_one_out: leave-one-out baseline (default) instead of the group mean.
        normalize: divide by the group std.
        valid: bool [B] of samples that count in baselines and stds; None means all.
        epsilon: added to the std, and the threshold below which the std counts as 0.

    Returns:
        Float [B, T] in ``scores.dtype``, 0 outside the mask.
    """
    advantage = _grpo_sequence_advantages(scores, group_ids, leave_one_out, normalize, valid, epsilon)
    return _broadcast(advantage, mask)


def gdpo_advantages(
    components: Tensor,
    weights: Sequence[float],
    group_ids: Tensor,
    mask: Tensor,
    leave_one_out: bool = True,
    normalize: bool = True,
    valid: Tensor | None = None,
) -> Tensor:
    """GDPO: a GRPO advantage per reward component, weighted, summed, then normalized over the batch.

    ``A = sum_k w_k A_k`` with ``A_k`` the sequence-level GRPO advantage of component k (same options as
    :func:`grpo_advantages`, epsilon 1e-6); then ``(A - mean) / std`` with the mean and unbiased std over the
    valid samples, computed in float64 (only ``A - mean`` when std < 1e-6). Invalid samples get 0.

    Args:
        components: float [K, B], K >= 2 reward components (``reward/<name>``).
        weights: K floats (``reward_weights``).
        group_ids: int64 [B].
        mask: bool/float [B, T], 1 on response tokens.
        leave_one_out: leave-one-out baseline per component.
        normalize: divide each component's advantage by its group std.
        valid: bool [B] of samples that count; None means all.

    Returns:
        Float [B, T] in ``components.dtype``, 0 outside the mask.

    Raises:
        ValueError: if ``components`` is not [K, B] with K >= 2, or ``len(weights) != K``.
    """
    if components.dim() != 2 or components.shape[0] < 2:
        raise ValueError(f"GDPO needs components of shape [K >= 2, B], got {tuple(components.shape)}")
    if len(weights) != components.shape[0]:
        raise ValueError(f"GDPO got {len(weights)} weights for {components.shape[0]} reward components")
    combined = torch.zeros_like(components[0])
    for weight, component in zip(weights, components, strict=True):
        combined = combined + weight * _grpo_sequence_advantages(
            component, group_ids, leave_one_out, normalize, valid, _STD_TOLERANCE
        )
    keep = torch.ones_like(combined, dtype=torch.bool) if valid is None else valid.bool()
    wide = widened(combined)  # float64: the float32 square of a combined advantage of 1e20 is inf
    zero = torch.zeros((), dtype=wide.dtype, device=wide.device)
    n = keep.sum().to(wide.dtype)
    mean = torch.where(keep, wide, zero).sum() / n.clamp(min=1)
    centered = torch.where(keep, wide - mean, zero)
    std = (centered.square().sum() / (n - 1).clamp(min=1)).sqrt()
    # one valid sample has no spread; a ~0 std is only centered, never divided by
    spread = (n > 1) & (std >= _STD_TOLERANCE)
    normalized = torch.where(spread, centered / std.clamp(min=_STD_TOLERANCE), centered)
    return _broadcast(normalized.to(combined.dtype), mask)


def reinforce_plus_plus_advantages(
    scores: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    minus_baseline: bool,
    kl_penalty: Tensor | None = None,
) -> Tensor:
    """Reinforce++: ``A = r - group_mean`` (or ``r``), minus the per-token KL, normalized over the batch.

    The baseline is the mean over the whole group (not leave-one-out; a group of one gets ``A = 0``). With
    ``kl_penalty`` (use_kl_in_reward), ``A_t -= kl_penalty_t`` on valid tokens. Finally
    :func:`algorithms.advantages.normalize_advantages` over the valid tokens (biased var,
    ``rsqrt(clamp(var, 1e-8))``), so pass the whole global batch.

    Args:
        scores: float [B], one reward per sample.
        group_ids: int64 [B].
        mask: bool/float [B, T], 1 on response tokens.
        minus_baseline: subtract the group mean.
        kl_penalty: float [B, T], per-token KL already multiplied by beta; None for no KL term.

    Returns:
        Float [B, T] in ``scores.dtype``, 0 outside the mask.
    """
    if minus_baseline:
        sequence, _, _ = _group_stats(scores, group_ids, leave_one_out=False, valid=None)
    else:
        sequence = scores
    advantages = _broadcast(sequence, mask)
    if kl_penalty is not None:
        # where, not multiply: the KL at padding may be junk and must not reach the statistics
        advantages = torch.where(mask.bool(), advantages - kl_penalty.to(advantages.dtype), advantages)
    return normalize_advantages(advantages, mask)


def group_reward_std(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Unbiased std of the rewards of each sample's group (dynamic sampling).

    Args:
        scores: float [B].
        group_ids: int64 [B].

    Returns:
        Float [B] in ``scores.dtype``; 0 for groups of one sample and for groups of equal rewards.
    """
    _, _, std = _group_stats(scores, group_ids, leave_one_out=False, valid=None)
    return std


def groups_with_signal(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Which samples belong to a group whose rewards differ (DAPO dynamic sampling keeps these).

    A group has signal when its unbiased reward std (:func:`group_reward_std`) exceeds 1e-6; the tolerance
    absorbs float32 residue and a group of one sample never has signal.

    Args:
        scores: float [B].
        group_ids: int64 [B].

    Returns:
        Bool [B], equal for all members of a group.
    """
    return group_reward_std(scores, group_ids) > _STD_TOLERANCE
