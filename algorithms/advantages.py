"""Per-token rewards and token-level advantage estimators: GAE (with a critic) and raw reward (without)."""

from __future__ import annotations

import torch
from torch import Tensor

from algorithms.masked import accumulated, masked_mean, masked_var, widened

_NORMALIZE_VAR_FLOOR = 1e-8  # raw_reward / reinforce++ normalization: rsqrt(clamp(var, 1e-8))


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
    lam: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the response tokens of each row.

    Backwards over t with ``nextV = A = 0``::

        delta  = r_t + gamma * nextV - V_t
        A_new  = delta + gamma * lam * A
        nextV  = m_t * V_t + (1 - m_t) * nextV      # masked gaps are skipped, not treated as terminal
        A      = m_t * A_new + (1 - m_t) * A

    ``R = A + V``. Positions with ``m == 0`` are 0 in both outputs. Returns are never whitened; whiten the
    advantages separately (:func:`algorithms.masked.masked_whiten`) over the global batch.
    ``V[t]`` is the value of the prefix before token t. Inputs should be detached. The recursion runs in at
    least float32 (:func:`algorithms.masked.accumulated`): in bf16 each -0.001 KL reward of a long row rounded
    away against a return of 1.

    Args:
        rewards: float [B, T], per-token rewards (see :func:`token_level_rewards`).
        values: float [B, T], critic values.
        mask: bool/float [B, T], 1 on response tokens.
        gamma: discount factor.
        lam: GAE lambda: a float, or a float Tensor [B] with one lambda per row (length-adaptive lambda,
            see :func:`gae_lambda_per_sample`).

    Returns:
        ``(advantages, returns)``, both float [B, T] in the dtype of ``values``.

    Raises:
        ValueError: if ``lam`` is a tensor that is neither 0-dim nor [B].
    """
    out_dtype = values.dtype
    values = accumulated(values)
    dtype = values.dtype
    valid = mask.bool()
    rewards = rewards.to(dtype)
    batch, length = values.shape
    if isinstance(lam, Tensor):
        if lam.dim() > 1 or (lam.dim() == 1 and lam.shape[0] != batch):
            raise ValueError(f"lam must be a float or a [B] = [{batch}] tensor, got shape {tuple(lam.shape)}")
        # a [B] tensor broadcasts against the [B] running advantage: one lambda per row
        gamma_lam: float | Tensor = gamma * lam.to(dtype=dtype, device=values.device)
    else:
        gamma_lam = gamma * lam
    next_value = torch.zeros(batch, dtype=dtype, device=values.device)
    advantage = torch.zeros(batch, dtype=dtype, device=values.device)
    reversed_advantages = []
    for t in reversed(range(length)):
        m_t, v_t = valid[:, t], values[:, t]
        delta = rewards[:, t] + gamma * next_value - v_t
        new_advantage = delta + gamma_lam * advantage
        # where == m*a + (1-m)*b for a 0/1 mask, but NaN padding cannot leak through 0 * NaN
        next_value = torch.where(m_t, v_t, next_value)
        advantage = torch.where(m_t, new_advantage, advantage)
        reversed_advantages.append(advantage)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    returns = torch.where(valid, advantages + values, zero)
    advantages = torch.where(valid, advantages, zero)
    return advantages.to(out_dtype), returns.to(out_dtype)


def gae_lambda_per_sample(
    mask: Tensor,
    gae_lambda: float,
    gae_lambda_policy: float | None,
    length_adaptive_alpha: float,
) -> float | Tensor:
    """The lambda for the policy's advantages (the critic's returns keep ``gae_lambda``).

    Priority: ``length_adaptive_alpha > 0`` gives a per-sample lambda
    ``clamp(1 - 1 / max(alpha * l, 1), 0, 1)`` with ``l`` the row's number of valid tokens (VAPO; alpha 0.5,
    l 8 -> 0.75; rows with ``alpha * l <= 1``, empty rows included, get 0); else ``gae_lambda_policy`` if it
    is not None; else ``gae_lambda``.

    Args:
        mask: bool/float [B, T], 1 on response tokens.
        gae_lambda: the shared GAE lambda.
        gae_lambda_policy: decoupled policy lambda, or None.
        length_adaptive_alpha: alpha of the length-adaptive lambda; ``<= 0`` disables it.

    Returns:
        A float, or a float Tensor [B] (``mask.dtype`` if it is floating, else the default dtype).
    """
    if length_adaptive_alpha > 0:
        dtype = mask.dtype if mask.dtype.is_floating_point else torch.get_default_dtype()
        lengths = mask.bool().sum(dim=-1).to(dtype)
        # max(alpha * l, 1) keeps short and empty rows from dividing by ~0
        lam = 1.0 - 1.0 / torch.clamp(length_adaptive_alpha * lengths, min=1.0)
        return torch.clamp(lam, 0.0, 1.0)
    if gae_lambda_policy is not None:
        return gae_lambda_policy
    return gae_lambda


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lambda_value: float | Tensor,
    lambda_policy: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """GAE with decoupled lambdas (VAPO): advantages for the policy, returns for the critic.

    ``advantages = GAE(lambda_policy)``, ``returns = GAE(lambda_value) + values``. Neither is whitened.
    Equal float lambdas need one pass and match :func:`compute_gae`.

    Args:
        rewards: float [B, T], per-token rewards.
        values: float [B, T], critic values (detached).
        mask: bool/float [B, T], 1 on response tokens.
        gamma: discount factor.
        lambda_value: lambda of the critic's returns (float or [B]).
        lambda_policy: lambda of the policy's advantages (float or [B], see :func:`gae_lambda_per_sample`).

    Returns:
        ``(advantages, returns)``, both float [B, T] in the dtype of ``values``, 0 at masked positions.
    """
    advantages_value, returns = compute_gae(rewards, values, mask, gamma, lambda_value)
    same = isinstance(lambda_value, float | int) and isinstance(lambda_policy, float | int)
    if same and lambda_value == lambda_policy:
        return advantages_value, returns
    advantages, _ = compute_gae(rewards, values, mask, gamma, lambda_policy)
    return advantages, returns


def raw_reward_advantages(scores: Tensor, mask: Tensor) -> Tensor:
    """The sequence score as the advantage of every response token (raw_reward estimator, no critic).

    Args:
        scores: float [B], one scalar reward per sample.
        mask: bool/float [B, T], 1 on response tokens.

    Returns:
        Float [B, T] in ``scores.dtype``: ``scores[b]`` on valid tokens of row b, 0 elsewhere.
    """
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    return torch.where(mask.bool(), scores.unsqueeze(-1), zero)


def normalize_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Global normalization of token advantages (raw_reward, reinforce++).

    ``(A - mean) * rsqrt(clamp(var, 1e-8))`` with the masked mean and the biased masked variance over the
    valid tokens. Differs from GAE whitening (:func:`algorithms.masked.masked_whiten`, ``rsqrt(var + 1e-8)``)
    only in how the floor is applied. Pass the whole global batch: the statistics are this call's.

    Args:
        advantages: float [B, T].
        mask: bool/float [B, T], 1 on valid tokens.

    Returns:
        Float [B, T] in ``advantages.dtype``, 0 at invalid positions.
    """
    wide = widened(advantages)  # float64 statistics: a float32 variance overflows above about 1.8e19
    mean = masked_mean(wide, mask)
    var = masked_var(wide, mask)
    normalized = ((wide - mean) * torch.rsqrt(torch.clamp(var, min=_NORMALIZE_VAR_FLOOR))).to(advantages.dtype)
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(mask.bool().expand_as(advantages), normalized, zero)


def clip_advantages(advantages: Tensor, low: float | None, high: float | None) -> Tensor:
    """Clamp advantages to ``[low, high]`` (``advantage_clip_low/high``).

    ``low`` and ``high`` are the bounds themselves (e.g. ``-5.0`` and ``5.0``), not magnitudes; None leaves
    that side open, both None returns ``advantages`` unchanged.

    Args:
        advantages: float tensor of any shape, e.g. [B, T].
        low: lower bound, or None.
        high: upper bound, or None.

    Returns:
        Tensor of ``advantages``' shape and dtype.

    Raises:
        ValueError: if ``low > high``.
    """
    if low is not None and high is not None and low > high:
        raise ValueError(f"advantage clip low {low} is above high {high}")
    if low is None and high is None:
        return advantages
    return torch.clamp(advantages, min=low, max=high)
