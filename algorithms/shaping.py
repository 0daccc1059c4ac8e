"""Reward scaling and shaping applied to sequence rewards before the advantage estimator.

Keep the unshaped reward as well: dynamic sampling and logging use it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def scale_rewards(
    rewards: Tensor,
    source_min: float = 0.0,
    source_max: float = 1.0,
    target_min: float = 0.0,
    target_max: float = 1.0,
) -> Tensor:
    """Map rewards linearly from ``[source_min, source_max]`` to ``[target_min, target_max]``.

    ``t_min + (clamp(r, s_min, s_max) - s_min) / (s_max - s_min) * (t_max - t_min)``: rewards outside the
    source range are clamped first. Applied before shaping, and to every ``reward/*`` component.

    Args:
        rewards: float tensor of any shape, e.g. [B].
        source_min: lower end of the source range.
        source_max: upper end of the source range (must exceed ``source_min``).
        target_min: image of ``source_min``.
        target_max: image of ``source_max`` (may be below ``target_min`` to flip the sign).

    Returns:
        Tensor of ``rewards``' shape and dtype.

    Raises:
        ValueError: if ``source_max <= source_min``.
    """
    if source_max <= source_min:
        raise ValueError(f"reward scaling needs source_max > source_min, got {source_min}..{source_max}")
    clamped = torch.clamp(rewards, source_min, source_max)
    return target_min + (clamped - source_min) / (source_max - source_min) * (target_max - target_min)


def overlong_penalty(
    response_lengths: Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty: float,
) -> Tensor:
    """DAPO soft overlong punishment: a value <= 0 to add to each sample's reward.

    ``exceed = len - (max_response_length - buffer_length)``; returns ``min(-exceed / buffer * penalty, 0)``:
    0 up to ``max - buffer`` tokens, then falling linearly to ``-penalty`` at ``max_response_length``.

    Args:
        response_lengths: int [B], number of generated tokens per sample.
        max_response_length: generation limit.
        buffer_length: length of the linear ramp (> 0).
        penalty: penalty at ``max_response_length``.

    Returns:
        Float [B] in the default dtype.

    Raises:
        ValueError: if ``buffer_length <= 0``.
    """
    if buffer_length <= 0:
        raise ValueError(f"overlong buffer_length must be positive, got {buffer_length}")
    exceed = response_lengths.to(torch.get_default_dtype()) - (max_response_length - buffer_length)
    return torch.clamp(-exceed / buffer_length * penalty, max=0.0)


def stop_properly_penalty(rewards: Tensor, ended: Tensor, coef: float) -> Tensor:
    """Scale the rewards of truncated samples: ``r * coef`` where not ``ended``, ``r`` elsewhere.

    Args:
        rewards: float [B].
        ended: bool [B], True for samples that ended with EOS or a stop string.
        coef: ``stop_properly_penalty_coef``.

    Returns:
        Float [B] in ``rewards.dtype``.
    """
    return torch.where(ended.bool(), rewards, rewards * coef)
