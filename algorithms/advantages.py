"""Per-token rewards and advantage estimators (PPO with a critic: GAE)."""

from __future__ import annotations

import torch
from torch import Tensor


def token_level_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Spread sequence scores over response tokens and subtract the KL penalty.

    ``r[b, t] = -kl_coef * kl[b, t]`` on response tokens, plus ``scores[b]`` on the last response token of
    row b. Rows without response tokens get all zeros; non-response positions are 0.

    Args:
        scores: float [B], one scalar reward per sample.
        kl: float [B, T], per-token KL estimate (see :func:`algorithms.kl.kl_penalty`).
        mask: bool/float [B, T], 1 on response tokens.
        kl_coef: KL coefficient beta (0 to disable the in-reward penalty).

    Returns:
        Float [B, T] in the promoted dtype of ``scores`` and ``kl``.
    """
    valid = mask.bool()
    dtype = torch.promote_types(scores.dtype, kl.dtype)
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    rewards = torch.where(valid, -kl_coef * kl.to(dtype), zero)
    positions = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
    # index of the last valid token; -1 for empty rows, which then match no position
    last = torch.where(valid, positions, -1).amax(dim=-1, keepdim=True)
    score_at_last = torch.where(positions == last, scores.to(dtype).unsqueeze(-1), zero)
    return rewards + score_at_last


def compute_gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the response tokens of each row.

    Backwards over t with ``nextV = A = 0``::

        delta  = r_t + gamma * nextV - V_t
        A_new  = delta + gamma * lam * A
        nextV  = m_t * V_t + (1 - m_t) * nextV      # masked gaps are skipped, not treated as terminal
        A      = m_t * A_new + (1 - m_t) * A

    ``R = A + V``. Positions with ``m == 0`` are 0 in both outputs. Returns are never whitened; whiten the
    advantages separately (:func:`algorithms.masked.masked_whiten`) over the global batch.
    ``V[t]`` is the value of the prefix before token t. Inputs should be detached.

    Args:
        rewards: float [B, T], per-token rewards (see :func:`token_level_rewards`).
        values: float [B, T], critic values.
        mask: bool/float [B, T], 1 on response tokens.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both float [B, T] in the dtype of ``values``.
    """
    dtype = values.dtype
    valid = mask.bool()
    rewards = rewards.to(dtype)
    batch, length = values.shape
    next_value = torch.zeros(batch, dtype=dtype, device=values.device)
    advantage = torch.zeros(batch, dtype=dtype, device=values.device)
    reversed_advantages = []
    for t in reversed(range(length)):
        m_t, v_t = valid[:, t], values[:, t]
        delta = rewards[:, t] + gamma * next_value - v_t
        new_advantage = delta + gamma * lam * advantage
        # where == m*a + (1-m)*b for a 0/1 mask, but NaN padding cannot leak through 0 * NaN
        next_value = torch.where(m_t, v_t, next_value)
        advantage = torch.where(m_t, new_advantage, advantage)
        reversed_advantages.append(advantage)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    returns = torch.where(valid, advantages + values, zero)
    advantages = torch.where(valid, advantages, zero)
    return advantages, returns
