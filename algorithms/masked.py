"""Reductions over the valid (masked-in) entries of a tensor.

Conventions shared by the whole package: ``mask`` is a bool or float tensor that broadcasts to ``x``;
a nonzero entry marks a valid position (for PPO: a token the policy generated). Invalid positions never
contribute to a result, even when they hold NaN or inf. Sums and counts accumulate in at least float32
(fp16/bf16 are widened, :func:`accumulated`); results come back in the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _valid(x: Tensor, mask: Tensor) -> Tensor:
    """``mask`` as a bool tensor of ``x``'s shape."""
    return mask.bool().expand_as(x)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def accumulated(x: Tensor) -> Tensor:
    """``x`` in at least float32 for summing or counting it: fp16 holds no count above 65504 (80k tokens gave
    a count of inf and a mean of 0) and bf16 counts exactly only to 256 (1001 tokens were 1000). ``x`` itself
    when it is float32 or float64."""
    return x.to(_accumulator(x.dtype))


def _sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None) -> Tensor:
    """Sum of the valid entries of ``x``, in :func:`accumulated`'s dtype."""
    wide = accumulated(x)
    # where, not multiply: 0 * NaN in padding would poison the sum
    kept = torch.where(_valid(x, mask), wide, torch.zeros((), dtype=wide.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x`` over valid entries, accumulated in at least float32 (:func:`accumulated`).

    Args:
        x: any float tensor, e.g. [B, T].
        mask: bool/float, broadcastable to ``x``.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``x.dtype`` tensor with ``dim`` removed (a 0-dim tensor when ``dim`` is None).
    """
    return _sum(x, mask, dim).to(x.dtype)


def masked_count(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Number of valid entries of ``x``, reduced like :func:`masked_sum`.

    In ``x.dtype``, or float32 for fp16/bf16 ``x`` (which hold exact counts only up to 2048 and 256).
    """
    valid = _valid(x, mask).to(_accumulator(x.dtype))
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over valid entries; 0 (not NaN) where there are none.

    Sum and count in at least float32 (:func:`accumulated`), so 80k fp16 tokens average right. Shapes and
    dtype as :func:`masked_sum`.
    """
    # clamp the count so an empty mask gives 0 / 1 = 0
    return (_sum(x, mask, dim) / masked_count(x, mask, dim).clamp(min=1)).to(x.dtype)


def masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Min and max of ``x`` over all valid entries.

    Returns:
        ``(min, max)``, two 0-dim ``x.dtype`` tensors; both 0 when there is no valid entry.
    """
    valid = _valid(x, mask)
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    # fill with +-inf rather than index, so there is no host sync on GPU
    x_min = torch.where(valid, x, inf).amin()
    x_max = torch.where(valid, x, -inf).amax()
    any_valid = valid.any()
    return torch.where(any_valid, x_min, zero), torch.where(any_valid, x_max, zero)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = False) -> Tensor:
    """Variance of ``x`` over all valid entries (a 0-dim ``x.dtype`` tensor, computed in at least float32).

    Biased (divide by n) by default; ``unbiased`` divides by n - 1. Returns 0 when there are too few valid
    entries to define it (n == 0, or n <= 1 when unbiased) instead of NaN.
    """
    wide = accumulated(x)
    centered = wide - masked_mean(wide, mask)
    var = masked_mean(centered * centered, mask)
    if unbiased:
        n = masked_count(wide, mask)
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var.to(x.dtype)


def widened(x: Tensor) -> Tensor:
    """``x`` in float64 for computing a statistic of it: the variance of float32 values of magnitude above about
    1.8e19 overflows to inf, and every value divided by its square root would be 0 (a step that trains nothing,
    silently). ``x`` itself where float64 is not available (MPS) or it is float64 already."""
    return x if x.dtype == torch.float64 or x.device.type == "mps" else x.to(torch.float64)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` with the mean and biased variance of its valid entries.

    ``(x - mean) * rsqrt(var + eps)``; with ``shift_mean=False`` the mean is added back (only the scale
    changes). Invalid positions of the result are 0.

    Args:
        x: float tensor, e.g. advantages [B, T].
        mask: bool/float, broadcastable to ``x``.

    Returns:
        Tensor of ``x``'s shape and dtype (computed in float64, :func:`widened`).
    """
    wide = widened(x)
    mean = masked_mean(wide, mask)
    var = masked_var(wide, mask)
    whitened = (wide - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(_valid(x, mask), whitened.to(x.dtype), torch.zeros((), dtype=x.dtype, device=x.device))
