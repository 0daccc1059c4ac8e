"""Policy-loss variants (dual clip, importance weights, KL in the loss, sequence aggregation), truncated
importance sampling, and NaN-safety of the value loss and the entropy, against numbers worked out by hand.

The arithmetic behind every expected value is written next to it. Tensors are float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import (
    aggregate_loss,
    entropy_from_logits,
    policy_loss,
    truncated_importance_weights,
    value_loss,
)

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def t(data: object, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-6, rtol: float = 0.0) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------- dual clip

# old log-probs 0, so r = exp(lp); eps 0.2 -> clamp to [0.8, 1.2]; dual clip c = 3 acts only where A < 0
#   a: r=4,   A=-1:  max(4, 1.2)    = 4    -> min(4, -3*-1 = 3)   = 3     dual clip active
#   b: r=2,   A=-1:  max(2, 1.2)    = 2    -> min(2, 3)           = 2
#   c: r=1,   A=+1:  max(-1, -1)    = -1      (A > 0: min(-1, -3) = -3 would be wrong)
#   d: r=0.5, A=-2:  max(1, 1.6)    = 1.6  -> min(1.6, 6)         = 1.6   clipped branch
#   e: r=4,   A=+.5: max(-2, -0.6)  = -0.6    clipped branch
#   loss = (3 + 2 - 1 + 1.6 - 0.6) / 5 = 1.0; without the dual clip a gives 4: 6 / 5 = 1.2
# padding: log-ratio 1000 (exp overflows) and a NaN advantage must not reach the loss or the gradient
DUAL_LOGPROBS = [[math.log(4.0), math.log(2.0), 0.0], [math.log(0.5), math.log(4.0), 1000.0]]
DUAL_ADVANTAGES = [[-1.0, -1.0, 1.0], [-2.0, 0.5, NAN]]
MASK_2X3 = [[1, 1, 1], [1, 1, 0]]


def test_dual_clip_only_where_advantage_is_negative() -> None:
    logprobs = t(DUAL_LOGPROBS).requires_grad_(True)
    old = torch.zeros(2, 3, dtype=F64)
    loss, metrics = policy_loss(logprobs, old, t(DUAL_ADVANTAGES), t(MASK_2X3), clip_c=3.0)
    close(loss, 1.0)
    close(metrics["dual_clipfrac"], 0.2)  # token a only: 1 / 5
    close(metrics["clipfrac"], 0.4)  # d and e: 2 / 5
    close(metrics["ratio_mean"], 2.3)  # (4 + 2 + 1 + 0.5 + 4) / 5
    close(metrics["ratio_max"], 4.0)
    loss.backward()
    # d(-A r)/d lp / 5 = -A r / 5 on the unclipped tokens: b 2/5 = 0.4; c -1/5 = -0.2;
    # a is capped by the constant -c A, d and e sit on the clamp: 0; padding 0 (no NaN)
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, 0.4, -0.2], [0.0, 0.0, 0.0]])


def test_dual_clip_off_and_a_tighter_constant() -> None:
    old, adv, mask = torch.zeros(2, 3, dtype=F64), t(DUAL_ADVANTAGES), t(MASK_2X3)
    loss, metrics = policy_loss(t(DUAL_LOGPROBS), old, adv, mask)
    close(loss, 1.2)
    close(metrics["dual_clipfrac"], 0.0)
    # c = 1.5: a min(4, 1.5) = 1.5, b min(2, 1.5) = 1.5, d min(1.6, 3) = 1.6
    #   -> (1.5 + 1.5 - 1 + 1.6 - 0.6) / 5 = 0.6
    loss, metrics = policy_loss(t(DUAL_LOGPROBS), old, adv, mask, clip_c=1.5)
    close(loss, 0.6)
    close(metrics["dual_clipfrac"], 0.4)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(t(DUAL_LOGPROBS), old, adv, mask, clip_c=1.0)


# -------------------------------------------------------------------------- weights, KL, aggregation

# the example of test_algorithms.py: per-token losses a..e = [-1.2, -0.5, 0.8 | 1.5, -2.2], a and c clipped
LOG_RATIOS = [[math.log(1.5), math.log(0.5), math.log(0.5)], [math.log(1.5), math.log(1.1), 1000.0]]
ADVANTAGES = [[1.0, 1.0, -1.0], [-1.0, 2.0, -100.0]]


def test_importance_weights_multiply_the_surrogate_and_are_detached() -> None:
    logprobs = t(LOG_RATIOS).requires_grad_(True)
    weights = t([[2.0, 1.0, 0.5], [0.0, 1.0, 99.0]]).requires_grad_(True)  # 99 on padding must not count
    loss, _ = policy_loss(logprobs, torch.zeros(2, 3, dtype=F64), t(ADVANTAGES), t(MASK_2X3),
                          importance_weights=weights)
    # (2 * -1.2 + 1 * -0.5 + 0.5 * 0.8 + 0 * 1.5 + 1 * -2.2) / 5 = (-2.4 - 0.5 + 0.4 + 0 - 2.2) / 5 = -0.94
    close(loss, -0.94)
    loss.backward()
    # unclipped tokens: w * (-A r) / 5 -> b 1 * -0.5/5 = -0.1; d 0 * 1.5/5 = 0; e 1 * -2.2/5 = -0.44
    assert logprobs.grad is not None and weights.grad is None
    close(logprobs.grad, [[0.0, -0.1, 0.0], [0.0, -0.44, 0.0]])


def test_kl_in_the_loss_k3() -> None:
    # ratio 1 and A = 0, so only the KL term is left; lp = [-1, -2], ref = [-1.5, -1] -> logr = [-0.5, 1]
    # k3 = e^logr - 1 - logr = [0.1065307, 0.7182818]; loss = 0.1 * (0.1065307 + 0.7182818) / 2 = 0.0412406
    logprobs = t([[-1.0, -2.0, 0.0]]).requires_grad_(True)
    ref = t([[-1.5, -1.0, NAN]])  # NaN padding must not reach the gradient
    mask = t([[1, 1, 0]])
    loss, metrics = policy_loss(logprobs, logprobs.detach(), torch.zeros(1, 3, dtype=F64), mask,
                                ref_logprobs=ref, kl_coef=0.1, kl_type="k3")
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
    close(loss, 0.1 * sum(k3) / 2)
    close(metrics["kl_penalty"], sum(k3) / 2)  # 0.4124062, unscaled
    loss.backward()
    # d k3 / d lp = 1 - e^logr: [1 - 0.6065307, 1 - 2.7182818]; times 0.1 / 2
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.05 * (1 - math.exp(-0.5)), 0.05 * (1 - math.e), 0.0]])


def test_kl_in_the_loss_k1_and_off() -> None:
    logprobs, mask = t([[-1.0, -2.0]]).requires_grad_(True), t([[1, 1]])
    zeros = torch.zeros(1, 2, dtype=F64)
    # k1 = -logr = [0.5, -1]: loss 0.1 * (0.5 - 1) / 2 = -0.025; d k1 / d lp = 1 -> grad 0.1 / 2 each
    loss, _ = policy_loss(logprobs, logprobs.detach(), zeros, mask, ref_logprobs=t([[-1.5, -1.0]]),
                          kl_coef=0.1, kl_type="k1")
    close(loss, -0.025)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.05, 0.05]])
    # kl_coef 0: no KL in the loss, but the metric is still reported (default estimator k3, as above:
    # (0.1065307 + 0.7182818) / 2 = 0.4124062); no ref: metric 0
    loss, metrics = policy_loss(logprobs, logprobs.detach(), zeros, mask, ref_logprobs=t([[-1.5, -1.0]]))
    close(loss, 0.0)
    close(metrics["kl_penalty"], (math.exp(-0.5) - 0.5 + math.e - 2.0) / 2)
    _, metrics = policy_loss(logprobs, logprobs.detach(), zeros, mask, kl_coef=0.1)
    close(metrics["kl_penalty"], 0.0)


def test_sequence_aggregation_hand_computed() -> None:
    # row 0: (-1.2 - 0.5 + 0.8) / 3 = -0.3; row 1: (1.5 - 2.2) / 2 = -0.35; row 2 is empty and does not count
    # loss = (-0.3 - 0.35) / 2 = -0.325
    logprobs = t(LOG_RATIOS + [[0.0, 0.0, 0.0]]).requires_grad_(True)
    old, adv = torch.zeros(3, 3, dtype=F64), t(ADVANTAGES + [[5.0, 5.0, 5.0]])
    mask = t(MASK_2X3 + [[0, 0, 0]])
    loss, _ = policy_loss(logprobs, old, adv, mask, aggregation="sequence")
    close(loss, -0.325)
    loss.backward()
    # unclipped tokens: -A r / (tokens in row * 2 rows) -> b -0.5/6; d 1.5/4 = 0.375; e -2.2/4 = -0.55
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, -0.5 / 6, 0.0], [0.375, -0.55, 0.0], [0.0, 0.0, 0.0]])
    # a global sequence count of 4: -0.65 / 4
    loss, _ = policy_loss(logprobs, old, adv, mask, aggregation="sequence", num_sequences=4.0)
    close(loss, -0.1625)
    with pytest.raises(ValueError, match="num_sequences"):
        policy_loss(logprobs, old, adv, mask, aggregation="sequence", num_sequences=0.0)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(logprobs, old, adv, mask, aggregation="batch")  # type: ignore[arg-type]


def test_aggregate_loss_token_and_sequence() -> None:
    # rows [1, 2, 3] and [4, 5] (+ NaN padding), and an empty row
    per_token = t([[1.0, 2.0, 3.0], [4.0, 5.0, NAN], [7.0, 7.0, 7.0]])
    mask = t(MASK_2X3 + [[0, 0, 0]])
    close(aggregate_loss(per_token, mask), 3.0)  # token: (1 + 2 + 3 + 4 + 5) / 5
    close(aggregate_loss(per_token, mask, "token", num_tokens=10.0), 1.5)  # 15 / 10
    # sequence: (6/3 + 9/2) / 2 rows with tokens = (2 + 4.5) / 2
    close(aggregate_loss(per_token, mask, "sequence"), 3.25)
    close(aggregate_loss(per_token, mask, "sequence", num_sequences=4.0), 1.625)  # 6.5 / 4
    close(aggregate_loss(per_token, torch.zeros_like(mask), "sequence"), 0.0)  # nothing valid: 0, not NaN
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(per_token, mask, "token", num_tokens=0.0)


def test_policy_loss_reports_every_metric_key() -> None:
    _, metrics = policy_loss(t(LOG_RATIOS), torch.zeros(2, 3, dtype=F64), t(ADVANTAGES), t(MASK_2X3))
    expected = {
        "ratio_mean", "ratio_min", "ratio_max", "clipfrac", "dual_clipfrac", "approx_kl", "kl_penalty"
    }
    assert set(metrics) == expected
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


# ------------------------------------------------------------------------- micro-batch equivalence


def _random_batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, length = 5, 5
    # uneven rows (4, 3, 1, 2 tokens) and an empty row: local token and sequence counts differ from global
    mask = t([[1, 1, 1, 1, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])

    def randn() -> torch.Tensor:
        return torch.randn(batch, length, generator=gen, dtype=F64)

    return {
        "logprobs": -randn().abs() * 0.3,
        "old_logprobs": -randn().abs() * 0.3,
        "ref_logprobs": -randn().abs() * 0.3,
        "advantages": randn(),
        "weights": randn().abs() + 0.5,
        "mask": mask,
    }


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_with_global_counts_match_the_full_batch(aggregation: str) -> None:
    data = _random_batch(0)
    num_tokens = float(data["mask"].sum())  # 10
    num_sequences = float((data["mask"].sum(dim=-1) > 0).sum())  # 4

    def run(rows: slice, global_counts: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        lp = data["logprobs"][rows].clone().requires_grad_(True)
        loss, metrics = policy_loss(
            lp, data["old_logprobs"][rows], data["advantages"][rows], data["mask"][rows],
            clip_low=0.1, clip_high=0.28, num_tokens=num_tokens if global_counts else None,
            clip_c=1.1, aggregation=aggregation,  # type: ignore[arg-type]
            num_sequences=num_sequences if global_counts else None,
            ref_logprobs=data["ref_logprobs"][rows], kl_coef=0.05, kl_type="k3",
            importance_weights=data["weights"][rows],
        )
        loss.backward()
        assert lp.grad is not None
        return loss.detach(), lp.grad, metrics

    full_loss, full_grad, full_metrics = run(slice(0, 5), False)
    assert full_metrics["dual_clipfrac"] > 0 and full_metrics["clipfrac"] > 0  # every branch is exercised
    loss_a, grad_a, _ = run(slice(0, 2), True)
    loss_b, grad_b, _ = run(slice(2, 5), True)
    close(loss_a + loss_b, full_loss, atol=1e-12)
    close(torch.cat([grad_a, grad_b]), full_grad, atol=1e-12)
    # the micro-batches' own counts (7 and 3 tokens, 2 and 2 sequences) would not add up
    local_a, _, _ = run(slice(0, 2), False)
    local_b, _, _ = run(slice(2, 5), False)
    assert not torch.allclose(local_a + local_b, full_loss)


# ------------------------------------------------------------------------ truncated importance sampling

# old log-probs 0 and generation log-probs -log w give w = exp(old - gen):
#   row 0 w = [0.5, 1, 3]  (geometric mean (0.5 * 1 * 3)^(1/3) = 1.1447142, inside [0.8, 2])
#   row 1 w = [1.5, 4]     (geometric mean sqrt(6) = 2.4494897, above 2); its padding (gen -1000) overflows
#   row 2 has no valid token
# raw statistics over the 5 valid tokens: mean (0.5 + 1 + 3 + 1.5 + 4) / 5 = 2, min 0.5, max 4
IS_MASK = [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
GEN_LOGPROBS = [
    [math.log(2.0), 0.0, -math.log(3.0)],
    [-math.log(1.5), -math.log(4.0), -1000.0],
    [5.0, 5.0, 5.0],
]


def _is(kind: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    old = torch.zeros(3, 3, dtype=F64, requires_grad=True)
    gen = t(GEN_LOGPROBS)
    return truncated_importance_weights(old, gen, t(IS_MASK), kind, 0.8, 2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "weights", "clipfrac", "dropped"),
    [
        # clamp to [0.8, 2]: 0.5 -> 0.8, 3 -> 2, 4 -> 2; 3 of 5 tokens changed
        ("tis", [[0.8, 1.0, 2.0], [1.5, 2.0, 0.0], [0.0, 0.0, 0.0]], 0.6, 0.0),
        # zero outside [0.8, 2]: 0.5, 3 and 4 -> 0
        ("icepop", [[0.0, 1.0, 0.0], [1.5, 0.0, 0.0], [0.0, 0.0, 0.0]], 0.6, 0.0),
        # row 1's geometric mean sqrt(1.5 * 4) = 2.45 is past 2: dropped (weights 0); row 0's (0.5 * 3)^(1/3) = 1.14
        # is inside: kept with its untruncated weights, as NeMo-RL and OpenRLHF keep them; changed: row 1's 2 of 5
        ("seq-mask-tis", [[0.5, 1.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], 0.4, 1.0),
    ],
)
def test_truncated_importance_weights_kinds(
    kind: str, weights: list[list[float]], clipfrac: float, dropped: float
) -> None:
    got_weights, metrics = _is(kind)
    close(got_weights, weights)
    assert not got_weights.requires_grad
    close(metrics["is_weight_mean"], 2.0)
    close(metrics["is_weight_min"], 0.5)
    close(metrics["is_weight_max"], 4.0)
    close(metrics["is_clipfrac"], clipfrac)
    close(metrics["is_dropped_sequences"], dropped)


def test_truncated_importance_weights_rejects_bad_arguments() -> None:
    old, gen, mask = torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="tis, icepop, seq-mask-tis"):
        truncated_importance_weights(old, gen, mask, "clip", 0.5, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low <= high"):
        truncated_importance_weights(old, gen, mask, "tis", 2.0, 0.5)


@pytest.mark.parametrize(("kind", "weights"), [
    ("tis", [[1.0, 2.0, 0.0, 1.0]]),  # inf clamped to 2; NaN zeroed
    ("icepop", [[1.0, 0.0, 0.0, 1.0]]),  # inf outside [0.5, 2]: zeroed; NaN zeroed
    ("seq-mask-tis", [[1.0, 0.0, 0.0, 1.0]]),  # row kept (non-finite log ratios count 0: mean 0); inf, NaN zeroed
])
def test_importance_metrics_count_weights_zeroed_for_not_being_finite(
    kind: str, weights: list[list[float]]
) -> None:
    """Token 1: the generation engine gives -inf (w = inf); token 2: both give -inf (w = NaN). Both are zeroed or
    clamped, so is_clipfrac is 2 / 4 in every mode (it was 0.25, 0.25 and 0.0: the tokens zeroed for not being
    finite did not count), and the weight statistics are those of the finite weights, 1 and 1 (they were NaN)."""
    old, gen = t([[0.0, 0.0, -INF, 0.0]]), t([[0.0, -INF, -INF, 0.0]])
    got, metrics = truncated_importance_weights(old, gen, torch.ones(1, 4), kind, 0.5, 2.0)  # type: ignore[arg-type]
    close(got, weights)
    close(metrics["is_clipfrac"], 0.5)
    for name in ("is_weight_mean", "is_weight_min", "is_weight_max"):
        close(metrics[name], 1.0)
    close(metrics["is_dropped_sequences"], 0.0)
    # no finite weight at all: statistics 0, not NaN; every token counts as zeroed
    old, gen = t([[-INF, 0.0]]), t([[-INF, -INF]])
    _, metrics = truncated_importance_weights(old, gen, torch.ones(1, 2), kind, 0.5, 2.0)  # type: ignore[arg-type]
    assert all(torch.isfinite(value) for value in metrics.values())
    close(metrics["is_clipfrac"], 1.0)
    close(metrics["is_weight_max"], 0.0)


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_an_importance_weight_that_is_no_finite_number_is_zero(kind) -> None:
    """As NeMo-RL's loss sets them: a token both log-probs put at -inf, and (seq-mask-tis, which keeps a row's
    untruncated weights) one whose ratio overflows float32 in a row whose mean is in range."""
    inf = float("inf")
    old = torch.tensor([[-inf, 0.0, -0.1], [100.0] + [-0.1] * 2])
    gen = torch.tensor([[-inf, 0.0, 0.0], [0.0] * 3])
    weights, _ = truncated_importance_weights(old, gen, torch.ones(2, 3), kind, 0.0, 1e30)
    assert torch.isfinite(weights).all() and weights[0, 0] == 0 and weights[0, 1] == 1
    if kind == "seq-mask-tis":
        assert weights[1, 0] == 0 and torch.allclose(weights[1, 1:], torch.exp(torch.tensor(-0.1)))
    zeros, ones = torch.zeros(2, 3), torch.ones(2, 3)
    assert torch.isfinite(policy_loss(zeros, zeros, ones, ones, importance_weights=weights)[0])


# ---------------------------------------------------------------------------------- NaN-safe value loss

# the example of test_algorithms.py: clipped loss 0.5 * (0.64 + 0.25 + 0.81) / 3 = 0.5 * 1.7 / 3,
# gradient [[0, 0.5/3], [-0.3, 0]]; here the padding holds NaN / inf instead of finite junk
VALUES = [[0.5, 0.5], [1.1, NAN]]
OLD_VALUES = [[0.0, 0.0], [1.0, INF]]
RETURNS = [[1.0, 0.0], [2.0, NAN]]
VALUE_MASK = [[1, 1], [1, 0]]


@pytest.mark.parametrize(("clip", "expected_loss", "expected_grad"), [
    (0.2, 0.5 * 1.7 / 3, [[0.0, 0.5 / 3], [-0.3, 0.0]]),
    # unclipped: 0.5 * (0.25 + 0.25 + 0.81) / 3; gradient (V - R) / 3 = [-0.5/3, 0.5/3, -0.9/3]
    (0.0, 0.5 * 1.31 / 3, [[-0.5 / 3, 0.5 / 3], [-0.3, 0.0]]),
])
def test_value_loss_with_nan_padding_is_finite_and_equals_the_clean_case(
    clip: float, expected_loss: float, expected_grad: list[list[float]]
) -> None:
    values = t(VALUES).requires_grad_(True)
    loss, metrics = value_loss(values, t(OLD_VALUES), t(RETURNS), t(VALUE_MASK), clip=clip)
    close(loss, expected_loss)
    assert all(torch.isfinite(value) for value in metrics.values())
    loss.backward()
    assert values.grad is not None
    assert torch.isfinite(values.grad).all()
    close(values.grad, expected_grad)


# -------------------------------------------------------------------------------- entropy with -inf


def test_entropy_with_minus_inf_logits_is_finite_with_finite_gradients() -> None:
    # [0, log 3, -inf] -> p = [1/4, 3/4, 0]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.3465736 + 0.2157616 = 0.5623351
    # dH/dz_k = -p_k (ln p_k + H): -0.25 (-1.3862944 + 0.5623351) = 0.2059898;
    #   -0.75 (-0.2876821 + 0.5623351) = -0.2059898; the p = 0 entry: 0
    # [-inf, 0, -inf, 0] -> uniform over two: H = ln 2, gradient -0.5 (-ln 2 + ln 2) = 0 everywhere
    logits = t([[[0.0, math.log(3.0), -INF, -INF], [-INF, 0.0, -INF, 0.0]]]).requires_grad_(True)
    entropy = entropy_from_logits(logits)
    close(entropy, [[0.5623351, math.log(2.0)]])
    entropy.sum().backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()
    close(logits.grad, [[[0.2059898, -0.2059898, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
