"""Unit tests for the pure PPO math in ``algorithms/``, against numbers worked out by hand.

The arithmetic behind every expected value is written next to it. Tensors are float64 so the comparisons can
use tight tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import (
    aggregate_loss,
    compute_gae,
    entropy_from_logits,
    explained_variance,
    kl_penalty,
    logprobs_from_logits,
    masked_count,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    token_level_rewards,
    value_loss,
)

F64 = torch.float64


def t(data: object, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-6, rtol: float = 0.0) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------- masked


def test_masked_reductions_ignore_padding_even_when_it_is_nan() -> None:
    x = t([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    close(masked_sum(x, mask), 7.0)  # 1 + 2 + 4
    close(masked_mean(x, mask), 7.0 / 3)
    close(masked_sum(x, mask, dim=1), [3.0, 4.0])
    close(masked_mean(x, mask, dim=1), [1.5, 4.0])


def test_masked_mean_of_empty_mask_is_zero_not_nan() -> None:
    x = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[0, 0], [1, 1]])
    close(masked_mean(x, mask), 3.5)  # (3 + 4) / 2
    close(masked_mean(x, mask, dim=1), [0.0, 3.5])  # row 0 has no valid entry
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_var_biased_and_unbiased() -> None:
    # valid values {1, 2, 3, 4, 5}: mean 3, squared deviations 4 + 1 + 0 + 1 + 4 = 10
    x = t([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -100.0, 100.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    close(masked_var(x, mask), 2.0)  # 10 / 5
    close(masked_var(x, mask, unbiased=True), 2.5)  # 10 / 4
    close(masked_var(x, torch.zeros_like(mask)), 0.0)
    close(masked_var(x, torch.zeros_like(mask), unbiased=True), 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_reductions_of_half_precision_count_and_sum_in_float32(dtype: torch.dtype) -> None:
    """80k fp16 tokens: the fp16 count was inf and the mean 0 (a policy loss of NaN and a gradient of -0);
    bf16 counted 1001 tokens as 1000. Sums and counts now accumulate in float32, results in the input dtype."""
    x, mask = torch.full((20, 4000), 0.5, dtype=dtype), torch.ones(20, 4000)
    assert masked_count(x, mask).item() == 80_000
    assert masked_mean(x, mask).dtype == dtype and masked_mean(x, mask).item() == 0.5
    assert masked_mean(x, mask, dim=1).tolist() == [0.5] * 20
    assert masked_var(x, mask).item() == 0.0
    assert aggregate_loss(x, mask, "token").item() == 0.5 and aggregate_loss(x, mask, "sequence").item() == 0.5
    assert aggregate_loss(x, mask, "token", num_tokens=80_000).item() == 0.5  # the fp16 sum 40000 * 2 overflows
    some = torch.zeros(1, 2000)
    some[0, :1001] = 1
    assert masked_count(torch.zeros(1, 2000, dtype=dtype), some).item() == 1001
    # A = 1, ratio 1 on every token: loss -1, gradient -1/80000 per token
    logprobs = torch.zeros(20, 4000, dtype=dtype, requires_grad=True)
    loss, _ = policy_loss(logprobs, torch.zeros(20, 4000, dtype=dtype), torch.ones(20, 4000, dtype=dtype), mask)
    loss.backward()
    assert loss.dtype == dtype and loss.item() == -1.0
    assert logprobs.grad is not None
    close(logprobs.grad.float(), torch.full((20, 4000), -1 / 80_000), atol=0.0, rtol=1e-2)


def test_masked_whiten_hand_computed() -> None:
    # valid values {1, 2, 3, 4, 5}: mean 3, biased var 2 -> (x - 3) / sqrt(2)
    x = t([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -100.0, 100.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    s = math.sqrt(2.0)
    whitened = masked_whiten(x, mask)
    close(whitened, [[-2 / s, -1 / s, 0.0, 0.0], [1 / s, 2 / s, 0.0, 0.0]])
    close(masked_mean(whitened, mask), 0.0)
    close(masked_var(whitened, mask), 1.0)
    # shift_mean=False keeps the mean 3: (x - 3) / sqrt(2) + 3; padding still 0
    unshifted = masked_whiten(x, mask, shift_mean=False)
    close(unshifted, [[3 - 2 / s, 3 - 1 / s, 3.0, 0.0], [3 + 1 / s, 3 + 2 / s, 0.0, 0.0]])


def test_masked_whiten_of_constant_values_is_zero_not_nan() -> None:
    # var 0 -> (x - mean) * rsqrt(0 + eps) = 0 * 1e4 = 0
    x = t([[7.0, 7.0, 7.0]])
    close(masked_whiten(x, t([[1, 1, 0]])), [[0.0, 0.0, 0.0]])


# ------------------------------------------------------------------------------------------------- KL


# lp = [-1, -2], ref = [-1.5, -1] -> logr = ref - lp = [-0.5, 1.0]
LP = [-1.0, -2.0]
REF = [-1.5, -1.0]


@pytest.mark.parametrize(
    ("estimator", "absolute", "expected"),
    [
        ("k1", False, [0.5, -1.0]),  # -logr
        ("k1", True, [0.5, 1.0]),  # |-logr|
        ("k2", False, [0.125, 0.5]),  # logr^2 / 2 = 0.25 / 2, 1 / 2
        # exp(logr) - 1 - logr: e^-0.5 - 1 + 0.5 = 0.6065307 - 0.5; e - 1 - 1 = 0.7182818
        ("k3", False, [0.10653066, 0.71828183]),
        ("k3", True, [0.10653066, 0.71828183]),  # already non-negative
    ],
)
def test_kl_estimators_hand_computed(estimator: str, absolute: bool, expected: list[float]) -> None:
    close(kl_penalty(t(LP), t(REF), estimator, absolute=absolute), expected)  # type: ignore[arg-type]


def test_kl_default_is_k1_signed() -> None:
    close(kl_penalty(t(LP), t(REF)), [0.5, -1.0])


def test_kl_result_is_clamped_to_plus_minus_10() -> None:
    # row entries: logr = -30 -> clamp -20; logr = +30 -> clamp +20
    lp = t([0.0, -30.0])
    ref = t([-30.0, 0.0])
    close(kl_penalty(lp, ref, "k1"), [10.0, -10.0])  # -logr = +-20 -> +-10
    close(kl_penalty(lp, ref, "k1", absolute=True), [10.0, 10.0])
    close(kl_penalty(lp, ref, "k2"), [10.0, 10.0])  # 200 -> 10
    close(kl_penalty(lp, ref, "k3"), [10.0, 10.0])  # e^-20 + 19 -> 10; e^20 - 21 -> 10
    # inside the bounds nothing is clamped: logr = -9.5 -> k1 = 9.5, k3 = e^-9.5 + 8.5
    close(kl_penalty(t([0.0]), t([-9.5]), "k1"), [9.5])
    close(kl_penalty(t([0.0]), t([-9.5]), "k3"), [math.exp(-9.5) + 8.5])


def test_kl_log_ratio_is_clamped_before_the_estimator() -> None:
    # lp = -inf (underflow): unclamped k3 = exp(inf) - 1 - inf = NaN; clamped logr = 20 -> k3 = 10
    lp = t([float("-inf")])
    ref = t([0.0])
    for estimator in ("k1", "k2", "k3"):
        assert torch.isfinite(kl_penalty(lp, ref, estimator)).all(), estimator  # type: ignore[arg-type]
    close(kl_penalty(lp, ref, "k3"), [10.0])


def test_kl_unknown_estimator_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(t(LP), t(REF), "k4")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- token rewards


def test_token_level_rewards_score_on_last_response_token_minus_kl() -> None:
    scores = t([2.0, -1.0, 3.0])
    kl = t([[0.5, -1.0, 2.0, 100.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    rewards = token_level_rewards(scores, kl, mask, kl_coef=0.1)
    expected = [
        # -0.1 * [0.5, -1, 2], score 2 on index 2 (last mask==1): -0.2 + 2 = 1.8; padding (kl 100) is 0
        [-0.05, 0.1, 1.8, 0.0],
        # gap at index 1 gets nothing; last response token is index 2: -0.1 - 1 = -1.1
        [-0.1, 0.0, -1.1, 0.0],
        # no response tokens: the score 3 goes nowhere
        [0.0, 0.0, 0.0, 0.0],
    ]
    close(rewards, expected)


def test_token_level_rewards_with_zero_kl_coef_is_score_only() -> None:
    scores = t([5.0])
    kl = t([[3.0, 3.0, 3.0]])
    close(token_level_rewards(scores, kl, t([[0, 1, 1]]), kl_coef=0.0), [[0.0, 0.0, 5.0]])


# ----------------------------------------------------------------------------------------------- GAE

# 1x3 worked example, gamma = 0.9, lam = 0.8 (gamma * lam = 0.72), r = [0, 0, 1], V = [0.5, 0.4, 0.3]
#   t=2: delta = 1 + 0.9*0   - 0.3 =  0.7;   A2 = 0.7                      nextV = 0.3
#   t=1: delta = 0 + 0.9*0.3 - 0.4 = -0.13;  A1 = -0.13 + 0.72*0.7   = 0.374
#   t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14;  A0 = -0.14 + 0.72*0.374 = 0.12928
#   R = A + V = [0.62928, 0.774, 1.0]
GAMMA, LAM = 0.9, 0.8
A_1X3 = [0.12928, 0.374, 0.7]
R_1X3 = [0.62928, 0.774, 1.0]


def test_gae_hand_computed_1x3() -> None:
    adv, ret = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.4, 0.3]]), t([[1, 1, 1]]), GAMMA, LAM)
    close(adv, [A_1X3])
    close(ret, [R_1X3])


def test_gae_carries_forward_across_a_masked_gap() -> None:
    # the 1x3 example with a masked position inserted at index 1 holding junk (r = 5, V = 9):
    # at t=1, m=0 keeps nextV = 0.4 and A = 0.374, so t=0 sees the same values as without the gap
    rewards = t([[0.0, 5.0, 0.0, 1.0]])
    values = t([[0.5, 9.0, 0.4, 0.3]])
    adv, ret = compute_gae(rewards, values, t([[1, 0, 1, 1]]), GAMMA, LAM)
    close(adv, [[A_1X3[0], 0.0, A_1X3[1], A_1X3[2]]])
    close(ret, [[R_1X3[0], 0.0, R_1X3[1], R_1X3[2]]])


def test_gae_rows_of_different_lengths_and_an_empty_row() -> None:
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0], [1.0, 1.0, 1.0]])
    values = t([[0.5, 0.4, 0.3], [1.0, 0.5, 3.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    adv, ret = compute_gae(rewards, values, mask, GAMMA, LAM)
    # row 1, padding at t=2 (junk r = 7, V = 3) is skipped: nextV = A = 0 there
    #   t=1: delta = 2 + 0.9*0   - 0.5 =  1.5;  A1 = 1.5                 nextV = 0.5
    #   t=0: delta = 0 + 0.9*0.5 - 1.0 = -0.55; A0 = -0.55 + 0.72*1.5 = 0.53
    #   R = [1.53, 2.0, 0]
    # row 2 has no response tokens: all zeros
    close(adv, [A_1X3, [0.53, 1.5, 0.0], [0.0, 0.0, 0.0]])
    close(ret, [R_1X3, [1.53, 2.0, 0.0], [0.0, 0.0, 0.0]])


def test_gae_with_gamma_and_lambda_one_gives_monte_carlo_returns() -> None:
    # gamma = lam = 1: R_t = sum of rewards from t on = [0.5 + 0 + 1, 0 + 1, 1]; A = R - V
    rewards = t([[0.5, 0.0, 1.0]])
    values = t([[0.2, -0.3, 0.7]])
    adv, ret = compute_gae(rewards, values, t([[1, 1, 1]]), 1.0, 1.0)
    close(ret, [[1.5, 1.0, 1.0]])
    close(adv, [[1.3, 1.3, 0.3]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gae_in_half_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    """gamma = lam = 1, 2048 tokens each paying a KL of 0.001, score 1 on the last: the return is 1 - 2.048.
    In bf16 each -0.001 rounded away against the running 1.0 (the return came out 1.0); now the recursion runs
    in float32 and only the result is rounded to the values' dtype."""
    mask = torch.ones(1, 2048)
    rewards = token_level_rewards(torch.ones(1), torch.full((1, 2048), 0.001), mask, 1.0).to(dtype)
    values = torch.zeros(1, 2048, dtype=dtype)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    assert adv.dtype == ret.dtype == dtype
    adv32, ret32 = compute_gae(rewards.float(), values.float(), mask, 1.0, 1.0)
    assert torch.equal(ret, ret32.to(dtype)) and torch.equal(adv, adv32.to(dtype))
    close(ret[0, 0].double(), 1 - 2.048, atol=1e-2)


def test_gae_with_lambda_zero_is_one_step_td() -> None:
    # lam = 0: A_t = r_t + gamma * V_{t+1} - V_t = [0 + 0.9*0.4 - 0.5, 0 + 0.9*0.3 - 0.4, 1 - 0.3]
    adv, _ = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.4, 0.3]]), t([[1, 1, 1]]), GAMMA, 0.0)
    close(adv, [[-0.14, -0.13, 0.7]])


# ------------------------------------------------------------------------------------------ policy loss

# old log-probs 0, so ratio r = exp(lp); eps = 0.2 -> clamp to [0.8, 1.2]
#   a: r=1.5, A=+1: max(-1.5, -1.2) = -1.2   clipped
#   b: r=0.5, A=+1: max(-0.5, -0.8) = -0.5   not clipped
#   c: r=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped
#   d: r=1.5, A=-1: max( 1.5,  1.2) =  1.5   not clipped
#   e: r=1.1, A=+2: max(-2.2, -2.2) = -2.2   inside the range, not clipped
#   loss = (-1.2 - 0.5 + 0.8 + 1.5 - 2.2) / 5 = -1.6 / 5 = -0.32; clipfrac = 2 / 5
# the padding token (log-ratio 1000, so exp() overflows to inf; A = -100) must not count, nor send NaN
# into the gradients
LOG_RATIOS = [[math.log(1.5), math.log(0.5), math.log(0.5)], [math.log(1.5), math.log(1.1), 1000.0]]
ADVANTAGES = [[1.0, 1.0, -1.0], [-1.0, 2.0, -100.0]]
POLICY_MASK = [[1, 1, 1], [1, 1, 0]]


def _policy_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = t(LOG_RATIOS).requires_grad_(True)
    return logprobs, torch.zeros(2, 3, dtype=F64), t(ADVANTAGES), t(POLICY_MASK)


def test_policy_loss_clipped_surrogate_hand_computed() -> None:
    logprobs, old, adv, mask = _policy_inputs()
    loss, metrics = policy_loss(logprobs, old, adv, mask)
    close(loss, -0.32)
    close(metrics["clipfrac"], 0.4)
    close(metrics["ratio_mean"], 1.02)  # (1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5
    close(metrics["ratio_min"], 0.5)
    close(metrics["ratio_max"], 1.5)
    # (r - 1) - log r: 1.5 -> 0.0945349, 0.5 -> 0.1931472, 1.1 -> 0.0046898
    # (2 * 0.0945349 + 2 * 0.1931472 + 0.0046898) / 5 = 0.1160108
    close(metrics["approx_kl"], 0.1160108)
    assert all(not value.requires_grad for value in metrics.values())


def test_policy_loss_gradient_is_zero_on_clipped_tokens() -> None:
    logprobs, old, adv, mask = _policy_inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask)
    loss.backward()
    # unclipped token: d(-A r)/d lp = -A r / 5  -> b: -1*0.5/5 = -0.1; d: 1*1.5/5 = 0.3; e: -2*1.1/5 = -0.44
    # clipped tokens a, c and the padding get 0 (and no NaN from the overflowing padding)
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, -0.1, 0.0], [0.3, -0.44, 0.0]])


@pytest.mark.parametrize(("advantage", "clip_c", "expected_loss"), [
    (1.0, None, (-1.0 - 1.2 - 1.0) / 3),  # A > 0, r huge: max(-r, -1.2) = -1.2, the clipped branch
    (-1.0, 3.0, (1.0 + 3.0 + 1.0) / 3),  # A < 0, r huge: min(max(r, 1.2), 3) = 3, the dual clip
])
def test_policy_loss_gradient_of_an_overflowing_ratio_is_zero_not_nan(
    advantage: float, clip_c: float | None, expected_loss: float
) -> None:
    """Log-ratio 100 on token 1: exp(100) = inf in float32 gave a finite loss and a NaN gradient (0 * inf in
    exp's backward), which lost the whole optimizer step. The log-ratio is clamped to [-20, 20] before exp, so
    that token's gradient is 0, as the surrogate's is, and the others keep theirs: -A r / 3 = -A / 3."""
    logprobs = torch.tensor([[0.0, 100.0, 0.0]], requires_grad=True)
    zeros, ones = torch.zeros(1, 3), torch.ones(1, 3)
    loss, metrics = policy_loss(logprobs, zeros, advantage * ones, ones, clip_c=clip_c)
    loss.backward()
    close(loss, expected_loss)
    assert logprobs.grad is not None
    close(logprobs.grad, [[-advantage / 3, 0.0, -advantage / 3]])
    close(metrics["ratio_max"], math.exp(20.0), rtol=1e-6)
    # inside the bound nothing changes: log-ratio 19 gives the same loss and gradients
    inside = torch.tensor([[0.0, 19.0, 0.0]], requires_grad=True)
    loss_inside, _ = policy_loss(inside, zeros, advantage * ones, ones, clip_c=clip_c)
    loss_inside.backward()
    close(loss_inside, expected_loss)
    assert inside.grad is not None
    close(inside.grad, logprobs.grad)


def test_policy_loss_clip_higher() -> None:
    # clip_high = 0.28 -> upper clamp 1.28; token a: max(-1.5, -1.28) = -1.28, all others unchanged
    # loss = (-1.28 - 0.5 + 0.8 + 1.5 - 2.2) / 5 = -1.68 / 5 = -0.336
    logprobs, old, adv, mask = _policy_inputs()
    loss, metrics = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, -0.336)
    close(metrics["clipfrac"], 0.4)
    # clip_low = 0.4 -> lower clamp 0.6; token c: max(0.5, 0.6) = 0.6, still clipped
    # loss = (-1.2 - 0.5 + 0.6 + 1.5 - 2.2) / 5 = -1.8 / 5 = -0.36
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_low=0.4, clip_high=0.2)
    close(loss, -0.36)


def test_policy_loss_divides_by_num_tokens_when_given() -> None:
    # same masked sum -1.6, divided by 8 instead of 5
    logprobs, old, adv, mask = _policy_inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, num_tokens=8.0)
    close(loss, -0.2)
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(logprobs, old, adv, mask, num_tokens=0.0)


def test_policy_loss_with_an_empty_mask_is_zero() -> None:
    logprobs, old, adv, _ = _policy_inputs()
    loss, metrics = policy_loss(logprobs, old, adv, torch.zeros(2, 3, dtype=F64))
    close(loss, 0.0)
    assert all(torch.isfinite(value) for value in metrics.values())


# ------------------------------------------------------------------------------------------- value loss

# clip = 0.2
#   1: V_old=0, V=0.5, R=1: (0.5-1)^2 = 0.25; V_clip = 0.2, (0.2-1)^2 = 0.64 -> 0.64  clipped
#   2: V_old=0, V=0.5, R=0: (0.5-0)^2 = 0.25; V_clip = 0.2, (0.2-0)^2 = 0.04 -> 0.25  not clipped
#   3: V_old=1, V=1.1, R=2: |V - V_old| < 0.2 so V_clip = V, both 0.81     -> 0.81  not clipped
#   loss = 0.5 * (0.64 + 0.25 + 0.81) / 3 = 0.5 * 1.7 / 3 = 0.2833333; vf_clipfrac = 1/3
# the padding token (V = 50, R = -50) must not count
VALUES = [[0.5, 0.5], [1.1, 50.0]]
OLD_VALUES = [[0.0, 0.0], [1.0, 0.0]]
RETURNS = [[1.0, 0.0], [2.0, -50.0]]
VALUE_MASK = [[1, 1], [1, 0]]


def test_value_loss_clipping_hand_computed() -> None:
    values = t(VALUES).requires_grad_(True)
    loss, metrics = value_loss(values, t(OLD_VALUES), t(RETURNS), t(VALUE_MASK), clip=0.2)
    close(loss, 0.5 * 1.7 / 3)
    close(metrics["vf_clipfrac"], 1 / 3)
    # V = [0.5, 0.5, 1.1], R = [1, 0, 2]: Var(R) = (0 + 1 + 1)/3 = 2/3;
    # R - V = [0.5, -0.5, 0.9], mean 0.3, Var = (0.04 + 0.64 + 0.36)/3 = 1.04/3; EV = 1 - 1.04/2 = 0.48
    close(metrics["explained_variance"], 0.48)
    close(metrics["values_mean"], 0.7)  # 2.1 / 3
    close(metrics["returns_mean"], 1.0)  # 3 / 3
    assert all(not value.requires_grad for value in metrics.values())
    loss.backward()
    # token 1 takes the clipped branch (V_clip is constant in V there) -> 0 gradient;
    # token 2: 0.5 * 2 (V - R) / 3 = 0.5/3; token 3: 0.5 * 2 * (1.1 - 2) / 3 = -0.3
    assert values.grad is not None
    close(values.grad, [[0.0, 0.5 / 3], [-0.3, 0.0]])


def test_value_loss_clip_zero_disables_clipping_and_scale_multiplies() -> None:
    # no clipping: 0.5 * (0.25 + 0.25 + 0.81) / 3 = 0.5 * 1.31 / 3
    loss, metrics = value_loss(t(VALUES), t(OLD_VALUES), t(RETURNS), t(VALUE_MASK), clip=0.0)
    close(loss, 0.5 * 1.31 / 3)
    close(metrics["vf_clipfrac"], 0.0)
    loss, _ = value_loss(t(VALUES), t(OLD_VALUES), t(RETURNS), t(VALUE_MASK), clip=-1.0)
    close(loss, 0.5 * 1.31 / 3)
    # scale 2 doubles the clipped loss: 2 * 0.5 * 1.7 / 3
    loss, _ = value_loss(t(VALUES), t(OLD_VALUES), t(RETURNS), t(VALUE_MASK), clip=0.2, scale=2.0)
    close(loss, 1.7 / 3)


def test_value_loss_inactive_clip_equals_unclipped_loss() -> None:
    # every |V - V_old| <= 0.2: V_clip = V, so the clipped and unclipped losses agree
    # (V - R) = [0.1, -0.2] -> 0.5 * (0.01 + 0.04) / 2 = 0.0125
    values, old, returns, mask = t([[0.1, 0.8]]), t([[0.0, 1.0]]), t([[0.0, 1.0]]), t([[1, 1]])
    clipped, metrics = value_loss(values, old, returns, mask, clip=0.2)
    unclipped, _ = value_loss(values, old, returns, mask, clip=0.0)
    close(clipped, 0.0125)
    close(unclipped, 0.0125)
    close(metrics["vf_clipfrac"], 0.0)


def test_explained_variance() -> None:
    returns = t([[1.0, 0.0, 2.0, 99.0]])
    mask = t([[1, 1, 1, 0]])
    # perfect prediction on the valid tokens (the padding prediction is wrong on purpose) -> 1
    close(explained_variance(t([[1.0, 0.0, 2.0, -99.0]]), returns, mask), 1.0)
    # predicting the mean return 1 everywhere: Var(R - V) = Var(R) -> 0
    close(explained_variance(t([[1.0, 1.0, 1.0, 0.0]]), returns, mask), 0.0)
    # V = [0, 1, 0]: R - V = [1, -1, 2], mean 2/3, Var = (1/9 + 25/9 + 16/9)/3 = 14/9; Var(R) = 2/3
    # EV = 1 - (14/9) / (2/3) = 1 - 7/3 = -4/3
    close(explained_variance(t([[0.0, 1.0, 0.0, 0.0]]), returns, mask), -4 / 3)


# ------------------------------------------------------------------------- micro-batch equivalence


def _random_batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, length = 4, 5
    # rows 0-1 hold 4 + 3 = 7 tokens, rows 2-3 hold 1 + 2 = 3: a per-micro-batch mean would weight them
    # wrongly
    mask = t([[1, 1, 1, 1, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])

    def randn() -> torch.Tensor:
        return torch.randn(batch, length, generator=gen, dtype=F64)

    return {
        "logprobs": -randn().abs() * 0.3,
        "old_logprobs": -randn().abs() * 0.3,
        "advantages": randn(),
        "values": randn(),
        "old_values": randn(),
        "returns": randn(),
        "mask": mask,
    }


def test_micro_batches_with_global_num_tokens_match_the_full_batch() -> None:
    data = _random_batch(0)
    num_tokens = float(data["mask"].sum())  # 10

    def run(rows: slice, divisor: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lp = data["logprobs"][rows].clone().requires_grad_(True)
        v = data["values"][rows].clone().requires_grad_(True)
        mask = data["mask"][rows]
        pl, _ = policy_loss(lp, data["old_logprobs"][rows], data["advantages"][rows], mask,
                            clip_low=0.1, clip_high=0.1, num_tokens=divisor)
        vl, _ = value_loss(v, data["old_values"][rows], data["returns"][rows], mask, clip=0.2,
                           num_tokens=divisor)
        (pl + vl).backward()
        assert lp.grad is not None and v.grad is not None
        return pl.detach() + vl.detach(), lp.grad, v.grad

    full_loss, full_lp_grad, full_v_grad = run(slice(0, 4), None)
    loss_a, lp_grad_a, v_grad_a = run(slice(0, 2), num_tokens)
    loss_b, lp_grad_b, v_grad_b = run(slice(2, 4), num_tokens)
    close(loss_a + loss_b, full_loss, atol=1e-12)
    close(torch.cat([lp_grad_a, lp_grad_b]), full_lp_grad, atol=1e-12)
    close(torch.cat([v_grad_a, v_grad_b]), full_v_grad, atol=1e-12)
    # the micro-batches' own token counts (7 and 3) would not add up to the full-batch loss
    local_a, _, _ = run(slice(0, 2), None)
    local_b, _, _ = run(slice(2, 4), None)
    assert not torch.allclose(local_a + local_b, full_loss)


# ------------------------------------------------------------------------------------------ logits


def test_entropy_of_uniform_distribution_is_log_vocab() -> None:
    logits = torch.zeros(2, 3, 7, dtype=F64)
    close(entropy_from_logits(logits), torch.full((2, 3), math.log(7), dtype=F64))
    # uniform stays uniform when every logit is huge: a naive exp() would overflow to NaN
    close(entropy_from_logits(torch.full((1, 1, 2), 1000.0)), [[math.log(2)]], atol=1e-5)


def test_entropy_of_a_skewed_distribution() -> None:
    # logits [0, log 3] -> p = [1/4, 3/4]; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616
    logits = t([[[0.0, math.log(3.0)]]])
    close(entropy_from_logits(logits), [[0.5623351]])


def test_logprobs_from_logits_hand_computed() -> None:
    # p = [1/4, 3/4] at both positions (softmax is shift-invariant; e^1000 would overflow a naive
    # log(sum(exp))); labels pick index 1 then 0: [ln 0.75, ln 0.25]
    logits = t([[[0.0, math.log(3.0)], [1000.0, 1000.0 + math.log(3.0)]]])
    labels = torch.tensor([[1, 0]])
    close(logprobs_from_logits(logits, labels), [[-0.2876821, -1.3862944]])


def test_logprobs_from_logits_in_float32_a_row_at_a_time_equals_upcasting_the_whole_tensor() -> None:
    """dtype=float32 on bf16 logits (the actor's no-grad log-prob passes in bf16): the same values, bit for bit, as
    converting the whole [B, T, V] tensor first, which holds a float32 copy of it."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 17, generator=gen) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 17, (3, 5), generator=gen)
    got = logprobs_from_logits(logits[:, :-1], labels[:, 1:], dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, logprobs_from_logits(logits[:, :-1].float(), labels[:, 1:]))
    empty = logprobs_from_logits(logits[:0], labels[:0], dtype=torch.float32)
    assert empty.shape == (0, 5) and empty.dtype == torch.float32


# bf16 keeps 8 mantissa bits: the output itself is only good to about 0.4% (rtol), e.g. -16.38 vs -16.32
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_logprobs_from_logits_matches_log_softmax_gather(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, 11, generator=gen) * 5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 11, (3, 4), generator=gen)
    got = logprobs_from_logits(logits, labels)
    assert got.dtype == dtype
    reference = torch.log_softmax(logits.detach().double(), dim=-1)
    reference = reference.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    close(got.double(), reference, atol=tol, rtol=tol)
    got.sum().backward()  # the gradient of sum_t log p(label_t) is onehot - softmax
    expected_grad = torch.nn.functional.one_hot(labels, 11).double()
    expected_grad = expected_grad - torch.softmax(logits.detach().double(), -1)
    assert logits.grad is not None
    close(logits.grad.double(), expected_grad, atol=tol, rtol=tol)
