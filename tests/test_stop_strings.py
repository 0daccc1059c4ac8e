"""Stop strings in the torch generation backend: a row stops right after the token that completes a stop string
in its decoded response, also when the string spans several tokens, and counts as properly ended; everything it
sampled before is what it samples without stop strings under the same seed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actor.generation import Rollout, SamplingParams, TorchGenerationBackend
from actor.stop_strings import StopStringMatcher

PROMPTS = ["river castle winter =>", "garden ocean =>", "city forest market island =>", "train bridge =>"] * 2


@pytest.fixture(scope="module")
def setup(embedded_assets):
    tok = AutoTokenizer.from_pretrained(embedded_assets.policy)
    model = AutoModelForCausalLM.from_pretrained(embedded_assets.policy)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return tok, model, ids


def response(r: Rollout, i: int) -> list[int]:
    return r.tokens[i, r.prompt_lengths[i]:r.lengths[i]].tolist()


def first_stop(tok, ids: list[int], strings: tuple[str, ...]) -> int | None:
    """Reference: the shortest prefix of `ids` whose decoded text contains a stop string, by decoding every prefix."""
    for n in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:n]) for s in strings):
            return n
    return None


def test_a_stop_string_across_tokens_cuts_the_row_after_it(setup):
    tok, model, ids = setup
    eos = (tok.eos_token_id,)
    backend = TorchGenerationBackend(model, tok.pad_token_id, torch.device("cpu"), tokenizer=tok, compact_below=0)
    plain = backend.generate(ids, SamplingParams(12, 1.0, 0, 1.0, eos), seed=7)
    # a string made of the end of one sampled word, the space and the start of the next: it spans two tokens
    words = tok.convert_ids_to_tokens(response(plain, 0))
    k = next(i for i in range(len(words) - 2) if len(words[i]) > 1 and words[i + 1] != tok.eos_token)
    stop = f"{words[k][-2:]} {words[k + 1][:2]}"
    strings = (stop,)

    cut = backend.generate(ids, SamplingParams(12, 1.0, 0, 1.0, eos, strings), seed=7)
    n0 = first_stop(tok, response(plain, 0), strings)
    assert n0 is not None and n0 <= k + 2 and not any(stop in w for w in words)  # no single token holds it
    stopped = 0
    for i in range(len(ids)):
        full, n = response(plain, i), first_stop(tok, response(plain, i), strings)
        if n is None:  # no stop string: unchanged, ended as before
            assert response(cut, i) == full and bool(cut.ended[i]) == bool(plain.ended[i])
        else:  # the same samples, up to and including the token that completes the string
            stopped += 1
            assert response(cut, i) == full[:n], (i, stop)
            assert bool(cut.ended[i])
            assert stop in tok.decode(response(cut, i)) and stop not in tok.decode(response(cut, i)[:-1])
            assert torch.equal(cut.logprobs[i, :cut.lengths[i] - 1], plain.logprobs[i, :cut.lengths[i] - 1])
    assert stopped >= 1

    # the string completed by the last token max_new_tokens allows still ends the row properly
    last = backend.generate(ids, SamplingParams(n0, 1.0, 0, 1.0, (), strings), seed=7)
    assert bool(last.ended[0]) and response(last, 0) == response(plain, 0)[:n0]


def test_stop_strings_with_compaction_and_without_a_tokenizer(setup):
    tok, model, ids = setup
    strings = ("sad", "bad")
    backend = TorchGenerationBackend(model, tok.pad_token_id, torch.device("cpu"), tokenizer=tok, compact_below=1.0)
    r = backend.generate(ids, SamplingParams(12, 1.0, 0, 1.0, (tok.eos_token_id,), strings), seed=3)
    for i in range(len(ids)):  # every row stops at its first stop string or EOS, whatever the batch did
        text = tok.decode(response(r, i))
        n = first_stop(tok, response(r, i), strings)
        assert n in (None, len(response(r, i))), text
        assert bool(r.ended[i]) == (n is not None or response(r, i)[-1] == tok.eos_token_id)
    assert any(first_stop(tok, response(r, i), strings) for i in range(len(ids)))
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        TorchGenerationBackend(model, tok.pad_token_id, torch.device("cpu")).generate(
            ids, SamplingParams(4, stop_strings=strings), seed=0)


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    """A GPT-2-style byte-level BPE trained on task words: "é" is 2 tokens and an emoji 4, one byte each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from embedded import task

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([" ".join(task.VOCAB[4:])] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


@pytest.mark.parametrize("text, stop", [("good happy 🚀 great", "🚀"), ("bad café good", "é"),
                                        ("great happy sad", "py s"), ("happy river castle", "river")])
def test_stop_strings_with_a_byte_level_tokenizer(byte_level_tokenizer, text, stop):
    """Characters split over several byte tokens are matched where the decoded response first contains them (the
    window counts UTF-8 bytes, not characters), and only there."""
    tok = byte_level_tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # the words are split into several tokens
    matcher = StopStringMatcher(tok, (stop,))
    finished = torch.zeros(2, dtype=torch.bool)
    sampled = torch.tensor([ids, tok(" good kind", add_special_tokens=False)["input_ids"][:1] * len(ids)])
    hits = [matcher.completed(sampled, t, finished).tolist() for t in range(len(ids))]
    assert [t for t, (hit, _) in enumerate(hits) if hit][:1] == [first_stop(tok, ids, (stop,)) - 1]
    assert not any(other for _, other in hits)


def test_a_stop_string_in_the_prompt_does_not_stop_the_response(byte_level_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = byte_level_tokenizer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok), n_positions=64)).eval()
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in ("river castle =>", "castle river =>")]
    backend = TorchGenerationBackend(model, tok.eos_token_id, torch.device("cpu"), tokenizer=tok)
    plain = backend.generate(ids, SamplingParams(10, 1.0, 0, 1.0, (), ()), seed=1)
    cut = backend.generate(ids, SamplingParams(10, 1.0, 0, 1.0, (), ("river", "=>")), seed=1)
    assert all(first_stop(tok, response(plain, i), ("river", "=>")) is None for i in range(2))
    assert torch.equal(cut.tokens, plain.tokens) and not cut.ended.any()
