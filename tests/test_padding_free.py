"""Passes over length buckets (rows of similar length, each bucket trimmed to its longest row) compute what the
padded batch computes, and generation's log-probs equal the policy's within their stated error.

Tolerances: log-probs and values 1e-5 absolute; losses 1e-6 relative; gradients 1e-5 absolute plus 1e-4
relative (float32 sums in another order). Reused generation log-probs: at most REUSE_MAX_ABS_ERROR per token.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actor.generation import SamplingParams, TorchGenerationBackend
from actor.rollouts import RolloutCollector
from actor.tracking import Timers
from algorithms import logprobs_from_logits, policy_loss
from serving.modeling import PassLimits, attention_mask_from_lengths, by_length, length_buckets

# Documented in docs/PERFORMANCE.md ("Reusing generation's log-probs"); measured max is about 1e-6 in float32.
REUSE_MAX_ABS_ERROR = 1e-4


@pytest.fixture(scope="module")
def policy(embedded_assets):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(embedded_assets.policy).eval()
    return model, AutoTokenizer.from_pretrained(embedded_assets.policy)


def ragged_batch(vocab: int, b: int = 12, s: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (b, s), generator=g)
    lengths = torch.randint(3, s + 1, (b,), generator=g)
    lengths[3] = s
    tokens[torch.arange(s)[None, :] >= lengths[:, None]] = 0  # padding after each row's end
    return tokens, lengths


def padded_logprobs(model, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=attention_mask_from_lengths(lengths, tokens.shape[1])).logits
        return logprobs_from_logits(logits[:, :-1].float(), tokens[:, 1:])


def valid_actions(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1] - 1)[None, :] < lengths[:, None] - 1


def test_length_buckets_cover_every_row_once_longest_first():
    lengths = torch.tensor([3, 9, 1, 9, 4, 7, 2])
    buckets = length_buckets(lengths, 3)
    assert [len(b) for b in buckets] == [3, 3, 1]
    assert sorted(torch.cat(buckets).tolist()) == list(range(7))
    assert [sorted(lengths[b].tolist()) for b in buckets] == [[7, 9, 9], [2, 3, 4], [1]]


def test_a_token_budget_cuts_long_rows_few_to_a_pass_and_short_ones_many():
    lengths = torch.tensor([3, 9, 1, 9, 4, 7, 2, 30])
    buckets = length_buckets(lengths, 8, max_tokens=20)
    assert [sorted(lengths[b].tolist()) for b in buckets] == [[30], [9, 9], [4, 7], [1, 2, 3]]
    assert sorted(torch.cat(buckets).tolist()) == list(range(8))
    for b in buckets:  # rows x the longest row within the budget, unless one row alone is longer
        assert len(b) == 1 or len(b) * int(lengths[b].max()) <= 20
    assert [len(b) for b in length_buckets(lengths, 2, max_tokens=1000)] == [2, 2, 2, 2]  # the row cap still holds
    assert [len(b) for b in length_buckets(lengths, 8, max_tokens=0)] == [8]  # 0: rows only


def test_pass_limits_by_tokens_alone_and_widths_rounded_up():
    """policy.dynamic_batching's cut: no row limit, a token budget counted at widths rounded up to a multiple."""
    lengths = torch.tensor([3, 9, 1, 9, 4, 7, 2, 20])
    by_tokens = PassLimits(tokens=24)
    assert [sorted(lengths[b].tolist()) for b in length_buckets(lengths, by_tokens)] == [[20], [9, 9], [3, 4, 7], [1, 2]]
    rounded = PassLimits(tokens=24, width_multiple=8)  # widths 24, 16, 16, 8, ...: at most 1, 1, 1, then 3 rows
    buckets = length_buckets(lengths, rounded)
    assert [sorted(lengths[b].tolist()) for b in buckets] == [[20], [9], [9], [3, 4, 7], [1, 2]]
    assert [rounded.width(int(lengths[b].max()), 20) for b in buckets] == [20, 16, 16, 8, 8]  # capped at the batch's
    assert [len(b) for b in length_buckets(lengths, PassLimits())] == [8]  # no limits: one pass
    tokens = torch.arange(8 * 20).reshape(8, 20)
    widths: list[int] = []
    by_length(lambda t, n: t[:, 0].float(), tokens, lengths, rounded, observe=widths.append)
    assert widths == [20, 16, 16, 3 * 8, 2 * 8]  # each pass's padded tokens at its rounded width


LOGPROB_PASSES = {"rows": PassLimits(rows=3), "tokens": PassLimits(tokens=40),
                  "tokens-rounded": PassLimits(tokens=40, width_multiple=8)}


@pytest.mark.parametrize("passes", LOGPROB_PASSES.values(), ids=LOGPROB_PASSES.keys())
@pytest.mark.parametrize("prepack", [False, True], ids=["plain", "prepacked"])
def test_bucketed_log_probs_equal_the_padded_ones(policy, prepack, passes):
    """Also through weights prepacked for oneDNN (policy.generation.prepack_weights with eager passes), which the
    layers give back after the passes, and with passes cut by tokens (policy.dynamic_batching), widths rounded up
    or not."""
    model, tok = policy
    tokens, lengths = ragged_batch(len(tok))
    collector = RolloutCollector(policy=model, reference=None, backend=None, critic=None, score=None, pad_id=0,
                                 device=torch.device("cpu"), generation_batch_size=4, logprob_passes=passes,
                                 timers=Timers(), prepack=prepack)
    bucketed = collector.logprobs(model, tokens, lengths)
    assert not any("forward" in m.__dict__ for m in model.modules())
    padded = padded_logprobs(model, tokens, lengths)
    valid = valid_actions(tokens, lengths)
    assert bucketed.shape == padded.shape
    torch.testing.assert_close(bucketed[valid], padded[valid], atol=1e-5, rtol=0)
    assert (bucketed[~valid] == 0).all()


def test_by_length_gathers_per_row_outputs_back_in_order():
    tokens = torch.arange(30).reshape(6, 5)
    lengths = torch.tensor([2, 5, 3, 1, 4, 5])
    passes: list[int] = []
    firsts = by_length(lambda t, n: t[:, 0].float() + n.float() / 10, tokens, lengths, size=2, observe=passes.append)
    torch.testing.assert_close(firsts, tokens[:, 0].float() + lengths.float() / 10)
    assert passes == [2 * 5, 2 * 4, 2 * 2]  # each pass's padded tokens: buckets (5, 5), (4, 3), (2, 1)
    widths = by_length(lambda t, n: torch.full((t.shape[0], t.shape[1] - 1), float(t.shape[1])), tokens, lengths, 2)
    assert widths.shape == (6, 4)
    # each row lies in a bucket trimmed to that bucket's longest row, and nothing is written past it
    assert widths[3].tolist() == [2.0, 0.0, 0.0, 0.0] and widths[1].tolist() == [5.0] * 4


TRAIN_PASSES = {"rows": PassLimits(rows=4), "tokens-rounded": PassLimits(tokens=48, width_multiple=8)}


@pytest.mark.parametrize("passes", TRAIN_PASSES.values(), ids=TRAIN_PASSES.keys())
def test_bucketed_policy_loss_and_gradients_equal_the_padded_ones(policy, passes):
    """What train_policy does: micro-batches by length (by rows, or by tokens with policy.dynamic_batching), each
    normalised by the global batch's token count."""
    model, tok = policy
    tokens, lengths = ragged_batch(len(tok), seed=1)
    g = torch.Generator().manual_seed(2)
    mask = valid_actions(tokens, lengths).float() * (torch.rand(tokens.shape[0], tokens.shape[1] - 1, generator=g) > 0.2)
    old = padded_logprobs(model, tokens, lengths) + 0.05 * torch.randn(mask.shape, generator=g)
    adv = torch.randn(mask.shape, generator=g)
    n_tokens = float(mask.sum())

    def loss_of(rows: torch.Tensor, width: int) -> torch.Tensor:
        t, n = tokens[rows, :width], lengths[rows]
        logits = model(input_ids=t, attention_mask=attention_mask_from_lengths(n, width)).logits[:, :-1].float()
        lp = logprobs_from_logits(logits, t[:, 1:])
        w = width - 1
        loss, _ = policy_loss(lp, old[rows, :w], adv[rows, :w], mask[rows, :w], clip_low=0.2, clip_high=0.2,
                              num_tokens=n_tokens)
        return loss

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    padded = loss_of(torch.arange(tokens.shape[0]), tokens.shape[1])
    padded.backward()
    padded_grads = grads()
    total = torch.zeros(())
    buckets = length_buckets(lengths, passes)
    assert len(buckets) > 2
    for bucket in buckets:
        part = loss_of(bucket, passes.width(int(lengths[bucket].max()), tokens.shape[1]))
        part.backward()
        total = total + part.detach()
    assert float(total) == pytest.approx(float(padded.detach()), rel=1e-6, abs=1e-7)
    for a, b in zip(grads(), padded_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reused_generation_log_probs_are_within_their_stated_error(policy, temperature):
    """The torch backend samples from the trained policy itself: its log-probs (of the raw logits, as the
    policy's are) differ from a separate forward pass only by rounding."""
    model, tok = policy
    prompts = [tok(text)["input_ids"] for text in ("the movie was", "i think the food", "a", "this is not a")] * 6
    backend = TorchGenerationBackend(model, tok.pad_token_id, torch.device("cpu"))
    r = backend.generate(prompts, SamplingParams(24, temperature=temperature, stop_token_ids=(tok.eos_token_id,)),
                         seed=3)
    mask = r.action_mask().bool()
    assert int(mask.sum()) >= len(prompts)  # every row has a response token
    forward = padded_logprobs(model, r.tokens, r.lengths)
    error = (r.logprobs - forward)[mask].abs().max()
    assert float(error) <= REUSE_MAX_ABS_ERROR
    assert (r.logprobs[~mask] == 0).all()


def test_model_passes_bench_runs(capsys):
    """`python -m bench.model_passes --quick`: every variant's log-probs checked against eager's and timed, training
    eager and compiled, and the profiled split of the last (figures not checked: a tiny model)."""
    from bench.model_passes import main

    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    for way in ("eager", "eager, prepacked", "compiled", "compiled, prepacked"):
        for rows in (2, 4):
            assert re.search(rf"\n  {way}, passes of {rows} rows +[\d.]+ s\n", out), (way, rows, out)
    for way in ("eager", "compiled"):
        for rows in (2, 4):
            line = rf"\n  {way}, micro-batches of {rows} rows +[\d.]+ s +[\d.]+ GFLOP/s \(\d+% of the peak\)\n"
            assert re.search(line, out), (way, rows, out)
    split = out.split("where its time goes, compiled, micro-batches of 4 rows")[1]
    shares = [int(s) for s in re.findall(r" ms  \( *(\d+)%\)", split)]
    assert len(shares) == 4 and 97 <= sum(shares) <= 103, split  # matmuls, attention, fused kernels, the rest
    assert re.search(r"the matmuls alone: [\d.]+ GFLOP/s \(\d+% of the peak\)", split), split
