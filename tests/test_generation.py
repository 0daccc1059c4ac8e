"""The PyTorch generation backend on the embedded policy: KV-cache decoding with left padding, sampling
controls, stop tokens, EOS counted in the response."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actor.generation import Rollout, SamplingParams, TorchGenerationBackend, concat_rollouts


@pytest.fixture(scope="module")
def setup(embedded_assets):
    tok = AutoTokenizer.from_pretrained(embedded_assets.policy)
    model = AutoModelForCausalLM.from_pretrained(embedded_assets.policy).eval()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in
               ["river winter train =>", "castle desert ocean garden city =>", "forest =>", "kitchen city ocean mountain =>"]]
    return tok, model, prompts, TorchGenerationBackend(model, tok.pad_token_id, torch.device("cpu"))


def responses(r: Rollout) -> list[list[int]]:
    return [r.tokens[i, r.prompt_lengths[i]:r.lengths[i]].tolist() for i in range(r.tokens.shape[0])]


def test_greedy_matches_transformers_generate_for_each_prompt_alone(setup):
    tok, model, prompts, backend = setup
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    batched = backend.generate(prompts, params, seed=0)
    for i, p in enumerate(prompts):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                             max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        expected = ref[0, len(p):].tolist()
        if tok.eos_token_id in expected:
            expected = expected[: expected.index(tok.eos_token_id) + 1]  # EOS is part of the response
        assert responses(batched)[i] == expected, i
    assert batched.tokens[:, 0].tolist() == [p[0] for p in prompts]  # right-padded: prompts start at column 0


def test_eos_is_counted_and_truncation_is_reported(setup):
    tok, _, prompts, backend = setup
    r = backend.generate(prompts * 8, SamplingParams(max_new_tokens=16, stop_token_ids=(tok.eos_token_id,)), seed=1)
    for resp, ended in zip(responses(r), r.ended.tolist()):
        assert (resp[-1] == tok.eos_token_id) == ended
        assert tok.eos_token_id not in resp[:-1]
    assert r.ended.any()
    short = backend.generate(prompts, SamplingParams(max_new_tokens=1, stop_token_ids=(tok.eos_token_id,)), seed=1)
    assert (short.response_lengths == 1).all()
    assert not short.ended.any() or all(resp == [tok.eos_token_id] for resp, e in zip(responses(short), short.ended) if e)


def test_extra_stop_tokens_end_the_response(setup):
    tok, _, prompts, backend = setup
    free = backend.generate(prompts * 8, SamplingParams(max_new_tokens=12, stop_token_ids=(tok.eos_token_id,)), seed=2)
    counts = torch.bincount(torch.cat([torch.tensor(x) for x in responses(free)]), minlength=len(tok))
    counts[tok.eos_token_id] = 0
    stop = int(counts.argmax())  # the most frequent word
    r = backend.generate(prompts * 8, SamplingParams(max_new_tokens=12, stop_token_ids=(tok.eos_token_id, stop)), seed=2)
    hits = 0
    for resp, ended in zip(responses(r), r.ended.tolist()):
        if stop in resp:
            hits += 1
            assert resp.index(stop) == len(resp) - 1 and ended
    assert hits > 0


def test_sampling_is_seeded_and_top_k_1_is_greedy(setup):
    tok, _, prompts, backend = setup
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(tok.eos_token_id,))
    a, b, c = (backend.generate(prompts * 4, params, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    greedy = backend.generate(prompts, SamplingParams(8, temperature=0.0, stop_token_ids=(tok.eos_token_id,)), seed=0)
    top1 = backend.generate(prompts, SamplingParams(8, temperature=0.7, top_k=1, stop_token_ids=(tok.eos_token_id,)), seed=3)
    assert torch.equal(greedy.tokens, top1.tokens)
    tiny_p = backend.generate(prompts, SamplingParams(8, top_p=1e-6, stop_token_ids=(tok.eos_token_id,)), seed=4)
    assert torch.equal(greedy.tokens, tiny_p.tokens)


def test_action_mask_and_concat():
    # prompt [5, 6], response [7, 8]: actions 1 and 2 produced tokens 7 and 8.
    r1 = Rollout(torch.tensor([[5, 6, 7, 8]]), torch.tensor([4]), torch.tensor([2]), torch.tensor([True]))
    r2 = Rollout(torch.tensor([[5, 9, 0]]), torch.tensor([2]), torch.tensor([1]), torch.tensor([False]))
    both = concat_rollouts([r1, r2], pad_id=0)
    assert both.tokens.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert both.action_mask().tolist() == [[0, 1, 1], [1, 0, 0]]
    assert both.response_lengths.tolist() == [2, 1]
