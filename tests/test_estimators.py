"""Advantage estimators, reward shaping and the adaptive KL coefficient, against numbers worked out by hand.

The arithmetic behind every expected value is written next to it. Tensors are float64 unless a test is about
float32 residue.
"""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import (
    adaptive_kl_coef,
    clip_advantages,
    compute_gae,
    gae_advantages,
    gae_lambda_per_sample,
    gdpo_advantages,
    group_baseline,
    group_reward_std,
    groups_with_signal,
    grpo_advantages,
    kl_penalty,
    masked_whiten,
    normalize_advantages,
    overlong_penalty,
    raw_reward_advantages,
    reinforce_plus_plus_advantages,
    scale_rewards,
    stop_properly_penalty,
)

F64 = torch.float64


def t(data: object, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


def ids(data: list[int]) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.int64)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-6, rtol: float = 0.0) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------- GAE lambdas

# the 1x3 example of test_algorithms.py: gamma = 0.9, r = [0, 0, 1], V = [0.5, 0.4, 0.3]
#   delta = [0 + 0.9*0.4 - 0.5, 0 + 0.9*0.3 - 0.4, 1 - 0.3] = [-0.14, -0.13, 0.7]
#   lam 0.8 (gamma*lam 0.72): A = [0.12928, 0.374, 0.7]      (A1 = -0.13 + 0.72*0.7, A0 = -0.14 + 0.72*A1)
GAMMA = 0.9
REWARDS = [0.0, 0.0, 1.0]
VALUES = [0.5, 0.4, 0.3]
A_LAM_08 = [0.12928, 0.374, 0.7]


def test_gae_with_a_per_sample_lambda_tensor() -> None:
    rewards, values = t([REWARDS, REWARDS]), t([VALUES, VALUES])
    adv, ret = compute_gae(rewards, values, t([[1, 1, 1], [1, 1, 1]]), GAMMA, t([0.8, 0.0]))
    # row 0 uses lam 0.8 (above); row 1 uses lam 0, one-step TD: A = delta = [-0.14, -0.13, 0.7]
    close(adv, [A_LAM_08, [-0.14, -0.13, 0.7]])
    # R = A + V: row 0 [0.62928, 0.774, 1.0]; row 1 [-0.14 + 0.5, -0.13 + 0.4, 0.7 + 0.3]
    close(ret, [[0.62928, 0.774, 1.0], [0.36, 0.27, 1.0]])
    # a [B] tensor of equal lambdas is the float lambda
    same, _ = compute_gae(rewards, values, t([[1, 1, 1], [1, 1, 1]]), GAMMA, t([0.8, 0.8]))
    close(same, [A_LAM_08, A_LAM_08])
    with pytest.raises(ValueError, match="lam"):
        compute_gae(rewards, values, t([[1, 1, 1], [1, 1, 1]]), GAMMA, t([0.8, 0.8, 0.8]))


def test_gae_lambda_per_sample_length_adaptive() -> None:
    # valid lengths l = [8, 1, 0, 4, 3], alpha 0.5: lambda = clamp(1 - 1 / max(0.5 l, 1), 0, 1)
    #   l 8: 1 - 1/4 = 0.75;  l 1: max(0.5, 1) = 1 -> 0;  l 0 (empty row): 1 - 1/1 = 0;
    #   l 4: 1 - 1/2 = 0.5;   l 3: 1 - 1/1.5 = 1/3
    mask = torch.zeros(5, 8, dtype=torch.bool)
    for row, length in enumerate([8, 1, 0, 4, 3]):
        mask[row, 8 - length:] = True  # valid tokens anywhere in the row count the same
    lam = gae_lambda_per_sample(mask, gae_lambda=0.95, gae_lambda_policy=0.9, length_adaptive_alpha=0.5)
    assert isinstance(lam, torch.Tensor)
    close(lam, torch.tensor([0.75, 0.0, 0.0, 0.5, 1 / 3], dtype=lam.dtype))


def test_gae_lambda_per_sample_priority() -> None:
    mask = t([[1, 1, 1, 1]])
    # alpha <= 0: the decoupled policy lambda if given, else the shared lambda
    assert gae_lambda_per_sample(mask, 0.95, 0.9, 0.0) == 0.9
    assert gae_lambda_per_sample(mask, 0.95, None, 0.0) == 0.95
    # alpha > 0 wins over gae_lambda_policy: l = 4, alpha 1 -> 1 - 1/4
    lam = gae_lambda_per_sample(mask, 0.95, 0.9, 1.0)
    assert isinstance(lam, torch.Tensor) and lam.dtype == F64  # a float mask keeps its dtype
    close(lam, [0.75])


def test_gae_advantages_decoupled_lambda() -> None:
    rewards, values, mask = t([REWARDS]), t([VALUES]), t([[1, 1, 1]])
    adv, ret = gae_advantages(rewards, values, mask, GAMMA, lambda_value=1.0, lambda_policy=0.8)
    close(adv, [A_LAM_08])  # the policy lambda 0.8
    # returns with lambda 1 (gamma*lam 0.9): A2 = 0.7, A1 = -0.13 + 0.9*0.7 = 0.5, A0 = -0.14 + 0.9*0.5 = 0.31
    # R = A + V = [0.81, 0.9, 1.0] (= discounted reward-to-go 0.9^2, 0.9, 1)
    close(ret, [[0.81, 0.9, 1.0]])
    # equal lambdas: exactly compute_gae
    adv_same, ret_same = gae_advantages(rewards, values, mask, GAMMA, 0.8, 0.8)
    close(adv_same, [A_LAM_08])
    close(ret_same, [[0.62928, 0.774, 1.0]])


def test_gae_advantages_with_the_length_adaptive_policy_lambda() -> None:
    # l = 3, alpha 0.5: lambda_policy = 1 - 1/1.5 = 1/3, gamma*lam = 0.3
    #   A2 = 0.7; A1 = -0.13 + 0.3*0.7 = 0.08; A0 = -0.14 + 0.3*0.08 = -0.116
    # returns keep lambda_value 1.0: [0.81, 0.9, 1.0]; the padding column (junk r 9, V 9) stays 0
    rewards, values = t([REWARDS + [9.0]]), t([VALUES + [9.0]])
    mask = t([[1, 1, 1, 0]])
    lam = gae_lambda_per_sample(mask, 1.0, None, 0.5)
    adv, ret = gae_advantages(rewards, values, mask, GAMMA, lambda_value=1.0, lambda_policy=lam)
    close(adv, [[-0.116, 0.08, 0.7, 0.0]])
    close(ret, [[0.81, 0.9, 1.0, 0.0]])


# ------------------------------------------------------------------------------------- raw reward


def test_raw_reward_advantages_broadcast_over_valid_tokens() -> None:
    mask = t([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    # score on every valid token, 0 on padding and on the empty row
    expected = [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0], [0.0, 0.0, 0.0]]
    close(raw_reward_advantages(t([2.0, -1.0, 3.0]), mask), expected)


def test_normalize_advantages_hand_computed() -> None:
    # valid values {1, 2, 3, 4, 5}: mean 3, biased var 10/5 = 2 -> (x - 3) / sqrt(2); padding 0
    x = t([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -100.0, float("nan")]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    s = math.sqrt(2.0)
    close(normalize_advantages(x, mask), [[-2 / s, -1 / s, 0.0, 0.0], [1 / s, 2 / s, 0.0, 0.0]])


def test_normalize_advantages_clamps_the_variance_unlike_whitening() -> None:
    # values {0, 2e-4}: mean 1e-4, biased var (1e-8 + 1e-8)/2 = 1e-8
    #   normalize: (x - 1e-4) * rsqrt(clamp(1e-8, 1e-8)) = +-1e-4 * 1e4 = +-1
    #   whitening: (x - 1e-4) * rsqrt(1e-8 + 1e-8) = +-1e-4 / sqrt(2e-8) = +-1/sqrt(2)
    x, mask = t([[0.0, 2e-4]]), t([[1, 1]])
    close(normalize_advantages(x, mask), [[-1.0, 1.0]])
    close(masked_whiten(x, mask), [[-1 / math.sqrt(2), 1 / math.sqrt(2)]])
    # constant values: var 0 -> clamp 1e-8 -> 0 * 1e4 = 0, not NaN
    close(normalize_advantages(t([[7.0, 7.0, 7.0]]), t([[1, 1, 0]])), [[0.0, 0.0, 0.0]])


def test_clip_advantages() -> None:
    x = t([-3.0, -1.0, 0.0, 2.0, 5.0])
    close(clip_advantages(x, -2.0, 3.0), [-2.0, -1.0, 0.0, 2.0, 3.0])
    close(clip_advantages(x, None, 3.0), [-3.0, -1.0, 0.0, 2.0, 3.0])
    close(clip_advantages(x, -2.0, None), [-2.0, -1.0, 0.0, 2.0, 5.0])
    assert clip_advantages(x, None, None) is x
    with pytest.raises(ValueError, match="above"):
        clip_advantages(x, 1.0, -1.0)


# ----------------------------------------------------------------------------------- group baseline


def test_group_baseline_leave_one_out_1000() -> None:
    # rewards [1, 0, 0, 0]: b_i = sum of the others / 3 = [0/3, 1/3, 1/3, 1/3]
    # std over the others: sample 0 -> [0, 0, 0], 0; samples 1-3 -> [1, 0, 0], mean 1/3,
    #   squared deviations (2/3)^2 + 2 (1/3)^2 = 6/9, unbiased / 2 -> 1/3, std 1/sqrt(3) = 0.5773503
    baseline, std = group_baseline(t([1.0, 0.0, 0.0, 0.0]), ids([7, 7, 7, 7]), leave_one_out=True)
    close(baseline, [0.0, 1 / 3, 1 / 3, 1 / 3])
    close(std, [0.0, 1 / math.sqrt(3), 1 / math.sqrt(3), 1 / math.sqrt(3)])


def test_group_baseline_mean_1000() -> None:
    # mean 1/4; squared deviations 0.75^2 + 3 * 0.25^2 = 0.5625 + 0.1875 = 0.75, unbiased / 3 = 0.25
    # -> std 0.5
    baseline, std = group_baseline(t([1.0, 0.0, 0.0, 0.0]), ids([7, 7, 7, 7]), leave_one_out=False)
    close(baseline, [0.25] * 4)
    close(std, [0.5] * 4)


def test_group_baseline_with_unsorted_ids_and_a_group_of_one() -> None:
    # groups: id 5 -> samples 0, 2 (r 1, 3); id 2 -> samples 1, 3 (r 4, 8); id 9 -> sample 4 alone (r 7)
    scores, group = t([1.0, 4.0, 3.0, 8.0, 7.0]), ids([5, 2, 5, 2, 9])
    # leave-one-out: b = the other member; std over one other sample = 0; the lone sample: b = own score
    baseline, std = group_baseline(scores, group, leave_one_out=True)
    close(baseline, [3.0, 8.0, 1.0, 4.0, 7.0])
    close(std, [0.0] * 5)
    # mean: id 5 mean 2, std sqrt((1 + 1) / 1) = sqrt(2); id 2 mean 6, std sqrt((4 + 4) / 1) = sqrt(8)
    baseline, std = group_baseline(scores, group, leave_one_out=False)
    close(baseline, [2.0, 6.0, 2.0, 6.0, 7.0])
    close(std, [math.sqrt(2), math.sqrt(8), math.sqrt(2), math.sqrt(8), 0.0])


def test_group_baseline_counts_only_valid_samples() -> None:
    # sample 3 is not valid; its score (NaN) must not reach anything but its own baseline's definition
    scores, group = t([1.0, 0.0, 0.0, float("nan")]), ids([0, 0, 0, 0])
    valid = torch.tensor([True, True, True, False])
    # leave-one-out over valid others: s0 -> [0, 0]: b 0, std 0; s1, s2 -> [1, 0]: b 0.5, std sqrt(0.5/1);
    # s3 (invalid) -> all valid members [1, 0, 0]: b 1/3, std 1/sqrt(3) (as above)
    baseline, std = group_baseline(scores, group, leave_one_out=True, valid=valid)
    close(baseline, [0.0, 0.5, 0.5, 1 / 3])
    close(std, [0.0, math.sqrt(0.5), math.sqrt(0.5), 1 / math.sqrt(3)])
    # mean over valid [1, 0, 0]: 1/3, std 1/sqrt(3), for every member
    baseline, std = group_baseline(scores, group, leave_one_out=False, valid=valid)
    close(baseline, [1 / 3] * 4)
    close(std, [1 / math.sqrt(3)] * 4)


def test_group_baseline_group_with_one_valid_sample() -> None:
    # one valid sample: baseline = own score (so A = 0), std 0, for both baselines and both samples
    valid = torch.tensor([True, False])
    for leave_one_out in (True, False):
        baseline, std = group_baseline(t([2.0, 5.0]), ids([0, 0]), leave_one_out, valid=valid)
        close(baseline, [2.0, 5.0])
        close(std, [0.0, 0.0])


# --------------------------------------------------------------------------------------------- GRPO


def test_grpo_leave_one_out_normalized_1000() -> None:
    # A = r - b = [1, -1/3, -1/3, -1/3]; sample 0's std is 0 -> left unscaled;
    # samples 1-3: -1/3 / (1/sqrt(3) + 1e-6) = -0.5773493
    mask = t([[1, 1], [1, 0], [0, 1], [0, 0]])
    adv = grpo_advantages(t([1.0, 0.0, 0.0, 0.0]), ids([0, 0, 0, 0]), mask)
    a = -(1 / 3) / (1 / math.sqrt(3) + 1e-6)
    close(adv, [[1.0, 1.0], [a, 0.0], [0.0, a], [0.0, 0.0]], atol=1e-9)
    unnormalized = grpo_advantages(t([1.0, 0.0, 0.0, 0.0]), ids([0, 0, 0, 0]), mask, normalize=False)
    close(unnormalized, [[1.0, 1.0], [-1 / 3, 0.0], [0.0, -1 / 3], [0.0, 0.0]])


def test_grpo_mean_baseline_normalized_1000() -> None:
    # A = r - 1/4 = [0.75, -0.25, -0.25, -0.25], std 0.5 -> A / 0.500001 = [1.499997, -0.4999990, ...]
    adv = grpo_advantages(t([1.0, 0.0, 0.0, 0.0]), ids([0, 0, 0, 0]), torch.ones(4, 1), leave_one_out=False)
    close(adv, [[0.75 / 0.500001], [-0.25 / 0.500001], [-0.25 / 0.500001], [-0.25 / 0.500001]], atol=1e-9)


def test_grpo_near_constant_group_in_float32_does_not_blow_up() -> None:
    # rewards [0, 0.95 x 7], leave-one-out. Sample 0's others are seven 0.95s: their float32 std is a residue
    # (~6e-8 here) that must count as 0, so A_0 = 0 - 0.95 stays unscaled instead of 0.95 / 7e-7 ~ 1e6.
    # Samples 1-7: others [0, 0.95 x 6], b = 5.7/7, A = 0.95 - 5.7/7 = 0.95/7;
    #   std of 0 and six 0.95s: squared deviations 7 (6/7)(1/7) 0.95^2 = 0.95^2 * 6/7, / 6 -> std 0.95/sqrt(7)
    #   A / (std + 1e-6) = (0.95/7) / (0.95/sqrt(7) + 1e-6) = 0.3779634 (~ 1/sqrt(7))
    scores = torch.tensor([0.0] + [0.95] * 7, dtype=torch.float32)
    group = ids([0] * 8)
    _, std = group_baseline(scores, group, leave_one_out=True)
    assert std[0] < 1e-6
    adv = grpo_advantages(scores, group, torch.ones(8, 1))
    expected = [[-0.95]] + [[(0.95 / 7) / (0.95 / math.sqrt(7) + 1e-6)]] * 7
    close(adv, expected, atol=1e-6)


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_grpo_constant_group_in_float32_is_exactly_zero(leave_one_out: bool) -> None:
    # [0.95 x 8]: every difference r_i - r_j is exactly 0, so A and std are exactly 0 (no 1e-8 residue)
    scores = torch.full((8,), 0.95, dtype=torch.float32)
    adv = grpo_advantages(scores, ids([3] * 8), torch.ones(8, 2), leave_one_out=leave_one_out)
    assert torch.equal(adv, torch.zeros(8, 2))
    assert torch.equal(group_reward_std(scores, ids([3] * 8)), torch.zeros(8))


def _grpo_reference(rewards: list[float], epsilon: float = 1e-6) -> list[float]:
    """GRPO with the leave-one-out baseline, as docs/algorithms.md writes it, in float64 one sample at a time:
    ``A_i = r_i - mean(others)``, divided by ``std(others) + eps`` where that unbiased std is above eps."""
    r = torch.tensor(rewards, dtype=F64)
    out = []
    for i in range(len(rewards)):
        others = torch.cat([r[:i], r[i + 1:]])
        a, s = r[i] - others.mean(), others.std()
        out.append(float(a / (s + epsilon)) if s > epsilon else float(a))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("rewards", [
    # sample 0's others [1, .667, .333]: mean .6667, std .3335 -> A_0 = (1e30 - .6667) / .3335 = 2.9985e30
    [1e30, 1.0, 0.667, 0.333],
    # others [.3, .2, .1]: mean .2, std .1 -> A_0 = (1e5 - .2) / (.1 + 1e-6) = 999988
    [1e5, 0.3, 0.2, 0.1],
    # others [1, .5, 0]: std .5 -> A_0 = (1e8 - .5) / .500001 = 2e8
    [1e8, 1.0, 0.5, 0.0],
    # others all .333: std 0 -> A_0 = 1e30 - .333, unscaled
    [1e30, 0.333, 0.333, 0.333],
])
def test_grpo_leave_one_out_std_of_an_outlier_is_the_std_of_the_others(
    rewards: list[float], dtype: torch.dtype
) -> None:
    """The std an outlier is divided by is that of the other samples. It was computed from differences taken
    relative to the outlier, which cancel catastrophically: [1e30, 1, .667, .333] gave A_0 = 1.1e7 in float32
    (5.8e15 in float64) for 3.0e30, [1e5, .3, .2, .1] gave 1.02e6 for 999988 (2% off)."""
    adv = grpo_advantages(t(rewards, dtype), ids([0] * 4), torch.ones(4, 1, dtype=dtype))
    assert adv.dtype == dtype
    close(adv[:, 0], _grpo_reference(rewards), atol=0.0, rtol=1e-5)


def test_grpo_invalid_samples_get_zero_and_do_not_count() -> None:
    # valid [T, T, T, F], r = [1, 0, 0, NaN]; leave-one-out over valid others:
    #   s0: b 0, std 0 -> A 1 unscaled; s1, s2: b 0.5, std sqrt(0.5) -> -0.5 / (0.7071068 + 1e-6);  s3: 0
    scores, valid = t([1.0, 0.0, 0.0, float("nan")]), torch.tensor([True, True, True, False])
    adv = grpo_advantages(scores, ids([0] * 4), torch.ones(4, 1), valid=valid)
    a = -0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[1.0], [a], [a], [0.0]], atol=1e-9)


def test_grpo_groups_of_one_sample_give_zero() -> None:
    # two groups of one: baseline = own score, A = 0 whatever the score
    adv = grpo_advantages(t([3.0, 9.0]), ids([0, 1]), torch.ones(2, 3))
    close(adv, torch.zeros(2, 3, dtype=F64))


# --------------------------------------------------------------------------------------------- GDPO

# groups [0, 0, 1, 1], leave-one-out (groups of two: b = the other member, its std 0 -> no scaling)
#   component 0 r = [1, 0, 1, 1] -> A_0 = [1, -1, 0, 0]
#   component 1 r = [0, 1, 0, 2] -> A_1 = [-1, 1, -2, 2]
#   weights [1, 0.5]: A = [1 - 0.5, -1 + 0.5, 0 - 1, 0 + 1] = [0.5, -0.5, -1, 1]
COMPONENTS = [[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 2.0]]
GDPO_GROUPS = [0, 0, 1, 1]


def test_gdpo_two_components_with_weights() -> None:
    # batch normalization: mean 0, unbiased var (0.25 + 0.25 + 1 + 1) / 3 = 2.5/3, std 0.9128709
    mask = t([[1, 1], [1, 1], [1, 0], [0, 0]])
    adv = gdpo_advantages(t(COMPONENTS), [1.0, 0.5], ids(GDPO_GROUPS), mask)
    s = math.sqrt(2.5 / 3)
    close(adv, [[0.5 / s, 0.5 / s], [-0.5 / s, -0.5 / s], [-1 / s, 0.0], [0.0, 0.0]])


def test_gdpo_with_invalid_samples() -> None:
    # sample 3 invalid: group 1 keeps one valid sample -> A_k = 0 for samples 2 and 3 in both components
    # A = [0.5, -0.5, 0, (0)]; over the valid samples: mean 0, unbiased var (0.25 + 0.25 + 0) / 2 = 0.25,
    # std 0.5
    valid = torch.tensor([True, True, True, False])
    adv = gdpo_advantages(t(COMPONENTS), [1.0, 0.5], ids(GDPO_GROUPS), torch.ones(4, 1), valid=valid)
    close(adv, [[1.0], [-1.0], [0.0], [0.0]])


def test_gdpo_zero_spread_is_mean_only_and_finite() -> None:
    # constant components: every A_k = 0, so A = 0 with std 0 -> (A - mean) only, 0, not NaN
    adv = gdpo_advantages(t([[1.0] * 4, [2.0] * 4]), [1.0, 1.0], ids(GDPO_GROUPS), torch.ones(4, 1))
    close(adv, torch.zeros(4, 1, dtype=F64))


def test_gdpo_rejects_fewer_than_two_components_or_mismatched_weights() -> None:
    with pytest.raises(ValueError, match="K >= 2"):
        gdpo_advantages(t([COMPONENTS[0]]), [1.0], ids(GDPO_GROUPS), torch.ones(4, 1))
    with pytest.raises(ValueError, match="weights"):
        gdpo_advantages(t(COMPONENTS), [1.0], ids(GDPO_GROUPS), torch.ones(4, 1))


# --------------------------------------------------------------------------------------- Reinforce++

# r = [1, 0, 2, 2] in groups [0, 0, 1, 1]; row 1 has one token, row 3 none
RPP_SCORES = [1.0, 0.0, 2.0, 2.0]
RPP_MASK = [[1, 1], [1, 0], [1, 1], [0, 0]]


def test_reinforce_plus_plus_with_baseline() -> None:
    # group means 0.5 and 2: A = [0.5, -0.5, 0, 0]; tokens {0.5, 0.5, -0.5, 0, 0}: mean 0.1,
    # deviations [0.4, 0.4, -0.6, -0.1, -0.1], biased var (0.16 + 0.16 + 0.36 + 0.01 + 0.01) / 5 = 0.14
    adv = reinforce_plus_plus_advantages(t(RPP_SCORES), ids(GDPO_GROUPS), t(RPP_MASK), minus_baseline=True)
    s = math.sqrt(0.14)
    close(adv, [[0.4 / s, 0.4 / s], [-0.6 / s, 0.0], [-0.1 / s, -0.1 / s], [0.0, 0.0]])


def test_reinforce_plus_plus_without_baseline() -> None:
    # tokens {1, 1, 0, 2, 2}: mean 1.2, deviations [-0.2, -0.2, -1.2, 0.8, 0.8],
    # biased var (0.04 + 0.04 + 1.44 + 0.64 + 0.64) / 5 = 0.56
    adv = reinforce_plus_plus_advantages(t(RPP_SCORES), ids(GDPO_GROUPS), t(RPP_MASK), minus_baseline=False)
    s = math.sqrt(0.56)
    close(adv, [[-0.2 / s, -0.2 / s], [-1.2 / s, 0.0], [0.8 / s, 0.8 / s], [0.0, 0.0]])


def test_reinforce_plus_plus_with_kl_in_reward() -> None:
    # beta * kl (junk 99 and 7 on padding): tokens A - kl =
    #   [0.5 - 0.1, 0.5 - 0.3], [-0.5 - 0.5], [0 - 0, 0 - 0.2]
    #   = {0.4, 0.2, -1.0, 0, -0.2}: mean -0.6/5 = -0.12, deviations [0.52, 0.32, -0.88, 0.12, -0.08],
    #   biased var (0.2704 + 0.1024 + 0.7744 + 0.0144 + 0.0064) / 5 = 1.168 / 5 = 0.2336
    kl = t([[0.1, 0.3], [0.5, 99.0], [0.0, 0.2], [7.0, 7.0]])
    adv = reinforce_plus_plus_advantages(t(RPP_SCORES), ids(GDPO_GROUPS), t(RPP_MASK), True, kl_penalty=kl)
    s = math.sqrt(0.2336)
    close(adv, [[0.52 / s, 0.32 / s], [-0.88 / s, 0.0], [0.12 / s, -0.08 / s], [0.0, 0.0]])


# ------------------------------------------------------------------------------- dynamic sampling


def test_group_reward_std_and_groups_with_signal() -> None:
    # id 3 -> [1, 3, 5]: mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    # id 1 -> [2, 5]: mean 3.5, unbiased var (2.25 + 2.25) / 1 = 4.5, std 2.1213203
    # id 4 -> [9] alone: std 0, no signal;  id 8 -> [0.95, 0.95] in float32: std exactly 0, no signal
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 9.0, 0.95, 0.95], dtype=torch.float32)
    group = ids([3, 1, 3, 1, 3, 4, 8, 8])
    close(group_reward_std(scores, group), [2.0, math.sqrt(4.5), 2.0, math.sqrt(4.5), 2.0, 0.0, 0.0, 0.0])
    expected = torch.tensor([True, True, True, True, True, False, False, False])
    assert torch.equal(groups_with_signal(scores, group), expected)


# ------------------------------------------------------------------------------------------ shaping


def test_scale_rewards_clamps_then_maps() -> None:
    r = t([-2.0, -1.0, 0.0, 1.0, 3.0, 5.0])
    # source [-1, 3]: clamp -> [-1, -1, 0, 1, 3, 3]; (x + 1) / 4 -> [0, 0, 0.25, 0.5, 1, 1]
    close(scale_rewards(r, -1.0, 3.0, 0.0, 1.0), [0.0, 0.0, 0.25, 0.5, 1.0, 1.0])
    # target [-1, 1]: -1 + frac * 2 -> [-1, -1, -0.5, 0, 1, 1]
    close(scale_rewards(r, -1.0, 3.0, -1.0, 1.0), [-1.0, -1.0, -0.5, 0.0, 1.0, 1.0])
    # defaults 0..1 -> 0..1: only the clamp acts
    close(scale_rewards(t([-0.5, 0.3, 1.7])), [0.0, 0.3, 1.0])
    with pytest.raises(ValueError, match="source_max"):
        scale_rewards(r, 1.0, 1.0)


def test_overlong_penalty_at_its_boundaries() -> None:
    # max 20, buffer 4 -> the ramp starts after 20 - 4 = 16 tokens; exceed = len - 16 = [-6, 0, 1, 2, 4]
    # -exceed / 4 * 1.0 = [1.5, 0, -0.25, -0.5, -1] -> min(., 0) = [0, 0, -0.25, -0.5, -1]
    lengths = torch.tensor([10, 16, 17, 18, 20])
    penalty = overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty=1.0)
    assert penalty.dtype == torch.get_default_dtype()
    close(penalty, [0.0, 0.0, -0.25, -0.5, -1.0])
    # penalty 0.5 halves it: len = max -> -0.5
    close(overlong_penalty(lengths, 20, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, 20, 0, 1.0)


def test_stop_properly_penalty_scales_truncated_samples() -> None:
    rewards, ended = t([1.0, -2.0, 0.5]), torch.tensor([True, False, False])
    close(stop_properly_penalty(rewards, ended, 0.5), [1.0, -1.0, 0.25])  # -2 * 0.5, 0.5 * 0.5
    close(stop_properly_penalty(rewards, ended, 0.0), [1.0, 0.0, 0.0])


# ----------------------------------------------------------------------------------------------- KL


def test_kl_penalty_clamp_arguments() -> None:
    lp, ref = t([0.0]), t([-30.0])  # logr = -30
    close(kl_penalty(lp, ref, "k1"), [10.0])  # defaults: logr -> -20, k1 = 20 -> 10
    close(kl_penalty(lp, ref, "k1", log_ratio_clamp=5.0, output_clamp=100.0), [5.0])  # logr -> -5, k1 = 5
    # k3 at logr -5: e^-5 - 1 + 5 = 4.0067379; output clamp 3 caps it
    close(kl_penalty(lp, ref, "k3", log_ratio_clamp=5.0, output_clamp=100.0), [math.exp(-5) + 4])
    close(kl_penalty(lp, ref, "k3", log_ratio_clamp=5.0, output_clamp=3.0), [3.0])


@pytest.mark.parametrize(
    ("observed", "expected"),
    [
        (6.6, 0.100256),  # err = 6.6/6 - 1 = 0.1: 0.1 * (1 + 0.1 * 256/10000) = 0.1 * 1.00256
        (5.4, 0.099744),  # err = -0.1: 0.1 * (1 - 0.00256)
        (12.0, 0.100512),  # err = 1 -> clipped to 0.2: 0.1 * (1 + 0.2 * 0.0256) = 0.1 * 1.00512
        (3.0, 0.099488),  # err = -0.5 -> clipped to -0.2: 0.1 * (1 - 0.00512)
        (6.0, 0.1),  # on target: unchanged
    ],
)
def test_adaptive_kl_coef_both_directions_and_the_clip(observed: float, expected: float) -> None:
    coef = adaptive_kl_coef(0.1, observed, target=6.0, horizon=10000, n_steps=256)
    assert coef == pytest.approx(expected, abs=1e-12)


def test_adaptive_kl_coef_rejects_nonpositive_target_or_horizon() -> None:
    with pytest.raises(ValueError, match="target"):
        adaptive_kl_coef(0.1, 1.0, target=0.0, horizon=10, n_steps=1)
    with pytest.raises(ValueError, match="horizon"):
        adaptive_kl_coef(0.1, 1.0, target=1.0, horizon=0, n_steps=1)


def test_adaptive_kl_coef_refuses_a_multiplier_that_is_not_positive() -> None:
    """64 samples with horizon 10 (someone thinking in steps): 1 - 0.2 * 64 / 10 = -0.28 turned beta negative, a
    reward for leaving the reference that the trainer never adapted again. Refused; horizon > 64 / 5 is fine."""
    with pytest.raises(ValueError, match=r"horizon must be > n_steps / 5 = 12\.8"):
        adaptive_kl_coef(0.05, 0.0, target=6.0, horizon=10, n_steps=64)
    with pytest.raises(ValueError, match="not positive"):  # 1 - 0.2 * 50 / 10 = 0: beta would be 0 for good
        adaptive_kl_coef(0.05, 0.0, target=6.0, horizon=10, n_steps=50)
    assert adaptive_kl_coef(0.05, 0.0, target=6.0, horizon=13, n_steps=64) == pytest.approx(0.05 * (1 - 12.8 / 13))
    # above target the multiplier only grows: 1 + 0.2 * 6.4
    assert adaptive_kl_coef(0.05, 12.0, target=6.0, horizon=10, n_steps=64) == pytest.approx(0.05 * 2.28)


@pytest.mark.parametrize("loo", [True, False])
def test_huge_finite_rewards_normalize_as_their_scaled_down_copies_in_float32(loo: bool) -> None:
    """Rewards of 1e30 (a reward source gone wrong, but finite) are scaled away by every normalization, as 1e0 are:
    the statistics are computed in float64. In float32 the variance overflowed to inf and every advantage was 0,
    so the step trained nothing and said nothing."""
    f32 = torch.float32
    rewards = t([1.0, 3.0, 2.0, 7.0, 0.5, 4.0], f32)
    groups, mask = torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, 3, dtype=f32)
    tokens = rewards[:, None] * mask
    components = torch.stack([rewards, rewards.flip(0)])
    for scale in (1e20, 1e30):
        huge = rewards * scale
        close(masked_whiten(huge[:, None] * mask, mask), masked_whiten(tokens, mask), rtol=1e-5)
        close(normalize_advantages(huge[:, None] * mask, mask), normalize_advantages(tokens, mask), rtol=1e-5)
        close(grpo_advantages(huge, groups, mask, leave_one_out=loo), grpo_advantages(rewards, groups, mask, leave_one_out=loo),
              rtol=1e-5)
        assert grpo_advantages(huge, groups, mask, leave_one_out=loo).dtype == f32
        # GDPO: its batch std is float64 too (without normalize_rewards the combined advantage stays huge)
        for normalize in (True, False):
            options = {"leave_one_out": loo, "normalize": normalize}
            gdpo = gdpo_advantages(components * scale, [1.0, 0.5], groups, mask, **options)
            close(gdpo, gdpo_advantages(components, [1.0, 0.5], groups, mask, **options), rtol=1e-5)
            assert gdpo.dtype == f32
    assert masked_whiten(tokens, mask).abs().sum() > 0
    assert gdpo_advantages(components, [1.0, 0.5], groups, mask, leave_one_out=loo, normalize=False).abs().sum() > 0


def test_gdpo_one_huge_component_value_gives_finite_nonzero_advantages() -> None:
    """One sample's component at 1e20 (a reward model gone wrong on one sample) made the float32 batch std inf,
    so every advantage of the step was 0. Now the batch statistics are float64: the advantages are finite, and
    the huge sample stands out while the others share what is left."""
    f32 = torch.float32
    components = t([[1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]], f32)
    components[0, 0] = 1e20
    adv = gdpo_advantages(components, [1.0, 0.5], ids([0] * 4 + [1] * 4), torch.ones(8, 1, dtype=f32))
    assert adv.dtype == f32 and torch.isfinite(adv).all() and (adv != 0).all()
    # sample 0's combined advantage ~1e20 dwarfs the rest: (A - mean) / std = 7 / sqrt(8) for it, -1 / sqrt(8)
    # for each of the 7 others (one huge value among n = 8: mean 1e20/8, unbiased std 1e20 / sqrt(8))
    close(adv[:, 0], [7 / math.sqrt(8)] + [-1 / math.sqrt(8)] * 7, atol=1e-5)
