"""The PyTorch generation backend on the embedded policy: KV-cache decoding with left padding, sampling
controls, stop tokens, EOS counted in the response."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
)
from transformers.pytorch_utils import Conv1D

from actor.generation import (
    GenerationCounts,
    GenerationStats,
    PreallocatedCache,
    Rollout,
    SamplingParams,
    TorchGenerationBackend,
    concat_rollouts,
)
from serving.prepack import KeptPacking, can_prepack, prepacked_linears


@pytest.fixture(scope="module")
def setup(embedded_assets):
    tok = AutoTokenizer.from_pretrained(embedded_assets.policy)
    model = AutoModelForCausalLM.from_pretrained(embedded_assets.policy).eval()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in
               ["river winter train =>", "castle desert ocean garden city =>", "forest =>", "kitchen city ocean mountain =>"]]
    return tok, model, prompts, TorchGenerationBackend(model, tok.pad_token_id, torch.device("cpu"))


def responses(r: Rollout) -> list[list[int]]:
    return [r.tokens[i, r.prompt_lengths[i]:r.lengths[i]].tolist() for i in range(r.tokens.shape[0])]


def assert_same_samples(a: Rollout, b: Rollout, case: object = None) -> None:
    """The same tokens and endings, and log-probs within float rounding (1e-5): two ways of generating that must
    sample alike."""
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.ended, b.ended), case
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


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


def tiny_model(kind: str = "llama", **overrides) -> torch.nn.Module:
    """A random tiny causal LM built locally (no download): vocab 32, pad 0, bos 1, eos 2."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=32, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0, **overrides)
    else:
        config_class = MistralConfig if kind == "mistral" else LlamaConfig
        config = config_class(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, **overrides)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 32, (n,), generator=g).tolist() for n in (3, 5, 9, 4, 7, 6, 3, 8, 5, 4, 6, 7)]


def generate_alone(model, prompt: list[int], max_new_tokens: int, eos: int | None = 2) -> list[int]:
    """transformers' greedy generate() on one prompt, cut after its first EOS (EOS counted in the response)."""
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    out = ref[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.mark.parametrize("compact_below", [1.0, 0.75, 0.0])
def test_finished_rows_leave_the_batch_and_greedy_still_matches_transformers(compact_below):
    model, prompts = tiny_model(), tiny_prompts()
    backend = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=compact_below)
    r = backend.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(2,)), seed=0)
    ends = sorted({int(n) for n, e in zip(r.response_lengths, r.ended) if e})
    assert len(ends) >= 3 and not r.ended.all()  # rows stop at different steps, some run to max_new_tokens
    stats = backend.last_stats
    assert stats.cache == "preallocated"
    if compact_below == 0.0:
        assert stats.compactions == 0 and stats.row_steps == len(prompts) * stats.decode_steps
    else:
        assert stats.compactions >= (len(ends) if compact_below == 1.0 else 1)
        assert stats.row_steps < len(prompts) * stats.decode_steps
    for i, p in enumerate(prompts):
        assert responses(r)[i] == generate_alone(model, p, 20), i
    assert r.ended.tolist() == [resp[-1] == 2 for resp in responses(r)]


def test_generation_counts_report_each_interval_of_decode_work():
    model, prompts = tiny_model(), tiny_prompts()
    backend = TorchGenerationBackend(model, 0, torch.device("cpu"))
    counts = GenerationCounts(backend)
    assert set(counts.metrics().values()) == {0.0}  # nothing generated yet
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(2,))
    runs = []
    for n in (2, 3):  # calls between two reports sum; each report covers only what ran since the last
        for seed in range(n):
            backend.generate(prompts[: 2 + seed], params, seed=seed)
            runs.append(backend.last_stats)
        report = counts.metrics()
        assert report == {f"generation/{k}": float(sum(getattr(s, k) for s in runs[-n:]))
                          for k in ("decode_steps", "compiled_steps", "compactions", "row_steps")}
        assert report["generation/decode_steps"] > 0


def test_preallocated_and_dynamic_caches_agree():
    model, prompts = tiny_model(), tiny_prompts()
    pre = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0)
    dyn = TorchGenerationBackend(model, 0, torch.device("cpu"), kv_cache="dynamic", compact_below=1.0)
    for params in (SamplingParams(20, temperature=0.0, stop_token_ids=(2,)), SamplingParams(20, temperature=0.0)):
        a, b = pre.generate(prompts, params, seed=0), dyn.generate(prompts, params, seed=0)
        assert (pre.last_stats.cache, dyn.last_stats.cache) == ("preallocated", "dynamic")
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths) and torch.equal(a.ended, b.ended)
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert (a.logprobs * a.action_mask() == a.logprobs).all() and (a.logprobs[a.action_mask().bool()] < 0).all()
    # Sampling: deterministic per seed on either cache, and both give a valid rollout.
    params = SamplingParams(16, temperature=0.8, top_k=10, top_p=0.9, stop_token_ids=(2, 5))
    for backend in (pre, dyn):
        x, y = backend.generate(prompts, params, seed=3), backend.generate(prompts, params, seed=3)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.logprobs, y.logprobs)
        for resp, ended in zip(responses(x), x.ended.tolist()):
            assert ended == (resp[-1] in (2, 5)) and not set(resp[:-1]) & {2, 5}


def test_linear_layers_on_prepacked_weights_compute_as_the_plain_ones_and_are_restored_after():
    """serving.prepack: within the block every torch.nn.Linear (with a bias or without) and transformers' Conv1D
    (GPT-2's projections, whose weight is stored [in, out]) computes through its prepacked weight as the plain layer
    does, for inputs of any row count; after it, and after an error inside it, the layers are the plain ones again."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.SiLU(), Conv1D(20, 24), torch.nn.Tanh(),
                              torch.nn.Linear(20, 8, bias=False))
    torch.nn.init.normal_(net[2].bias)  # Conv1D starts with a zero bias: make the packed one count
    inputs = [torch.randn(1, 16), torch.randn(64, 16), torch.randn(3, 1, 16), torch.randn(700, 16)]
    with torch.no_grad():
        want = [net(x) for x in inputs]
        with prepacked_linears(net, rows=64) as n:
            assert n == 3 and all("forward" in m.__dict__ for m in (net[0], net[2], net[4]))
            for x, w in zip(inputs, want):
                torch.testing.assert_close(net(x), w, rtol=1e-5, atol=1e-5)
        assert not any("forward" in m.__dict__ for m in net)
        with pytest.raises(RuntimeError, match="inside"), prepacked_linears(net, rows=8):
            raise RuntimeError("inside")
        assert not any("forward" in m.__dict__ for m in net)
        with prepacked_linears(net, rows=64, enabled=False) as n:  # switched off: the layers as they are
            assert n == 0 and not any("forward" in m.__dict__ for m in net)
    assert can_prepack(torch.device("cpu"), torch.float32) == torch.backends.mkldnn.is_available()
    assert not can_prepack(torch.device("cpu"), torch.bfloat16) and not can_prepack(torch.device("cuda"), torch.float32)


def test_kept_packing_holds_the_packed_layers_until_released_and_repacks_the_weights_then():
    """serving.prepack.KeptPacking (the servers' packing between weight changes): the layers stay packed from pack()
    to release(), a second pack() packs nothing again, and a pack() after the weights changed computes with the new
    ones; switched off it leaves the layers alone."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.SiLU(), torch.nn.Linear(24, 8))
    x = torch.randn(5, 16)
    packing = KeptPacking(net, rows=64, enabled=True)
    with torch.no_grad():
        plain = net(x)
        packing.pack()
        assert all("forward" in m.__dict__ for m in (net[0], net[2]))
        first = net[0].forward
        packing.pack()
        assert net[0].forward is first  # still the first packing
        torch.testing.assert_close(net(x), plain, rtol=1e-5, atol=1e-5)
        packing.release()
        assert not any("forward" in m.__dict__ for m in net)
        packing.release()  # twice: nothing more to give back
        net[2].weight.mul_(2.0)  # the weights change, as a Train changes the critic's
        want = net(x)
        packing.pack()
        torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)
        packing.release()
        off = KeptPacking(net, rows=64, enabled=False)
        off.pack()
        assert not any("forward" in m.__dict__ for m in net)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt2-lora"])
def test_generation_on_prepacked_weights_samples_as_on_the_plain_ones(kind):
    """policy.generation.prepack_weights (on by default): the same tokens, greedy and sampled, and log-probs to float
    rounding as without it, on a Llama (every projection an nn.Linear), on GPT-2 (Conv1D projections, packed as
    well) and on GPT-2 with LoRA adapters on every Conv1D (peft's wrappers stay as they are, the Conv1D inside each
    is packed); every projection and the LM head are packed, and the policy's layers are the plain ones after each
    generation."""
    model, prompts = tiny_model(kind.removesuffix("-lora")), tiny_prompts()
    if kind.endswith("-lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
        with torch.no_grad():  # lora_B starts at zero: give the adapters a part in every output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5)
    projections = model.config.num_hidden_layers * (7 if kind == "llama" else 4)  # GPT-2: c_attn, c_proj, c_fc, c_proj
    with torch.no_grad(), prepacked_linears(model, rows=8) as n:  # and the LM head; LoRA's A and B are Linears too
        assert n == projections + 1 + (2 * projections if kind.endswith("-lora") else 0)
    packed = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0)
    plain = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0, prepack=False)
    assert packed.prepack and not plain.prepack
    for i, params in enumerate((SamplingParams(20, temperature=0.0, stop_token_ids=(2,)),
                                SamplingParams(16, temperature=1.0, top_k=10, stop_token_ids=(2,)))):
        a, b = packed.generate(prompts, params, seed=i), plain.generate(prompts, params, seed=i)
        assert_same_samples(a, b, i)
        assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("warm_up", [False, True], ids=["compiled-at-first-call", "compiled-at-warm-up"])
def test_a_compiled_decode_step_samples_as_the_eager_one_on_one_graph(warm_up):
    """policy.generation.compile: the same tokens and log-probs (to float rounding) as eager decoding, sampling and
    greedy, with rows leaving the batch down to one (which runs eager); one graph serves every batch size, cache
    length and prompt width, so later calls compile nothing. The trainer's warm-up compiles it before the first
    rollout, counts nothing and leaves the samples as they would be; the async worker compiles at its first call."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # each case compiles afresh, not from the other's cached graph
    model, prompts = tiny_model(), tiny_prompts()
    eager = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0)
    compiled = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0, compile_decode=True)
    assert eager.warm_up() == 0.0  # nothing to compile
    graphs = None
    if warm_up:
        before = counters["stats"]["unique_graphs"]
        assert compiled.warm_up() > 0
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == before + 1 and compiled.totals == GenerationStats()
    cases = [(prompts, SamplingParams(20, temperature=0.0, stop_token_ids=(2,))),
             (prompts[:5], SamplingParams(12, temperature=0.9, top_k=10, stop_token_ids=(2,))),
             ([p + [7, 9, 11] for p in prompts[3:]], SamplingParams(25, temperature=1.0)),
             (prompts[:2], SamplingParams(30, temperature=0.0, stop_token_ids=(2,)))]
    lone = []
    for i, (rows, params) in enumerate(cases):
        a, b = eager.generate(rows, params, seed=i), compiled.generate(rows, params, seed=i)
        assert_same_samples(a, b, i)
        stats = compiled.last_stats
        assert stats.compiled_steps > 0 and stats.row_steps == eager.last_stats.row_steps, (i, stats)
        lone.append(stats.compiled_steps < stats.decode_steps)  # down to one row, which ran eager
        if i == 0:
            assert stats.compactions >= 3
            graphs = graphs if warm_up else counters["stats"]["unique_graphs"]
    assert any(lone), lone
    assert counters["stats"]["unique_graphs"] == graphs  # compiled once: at the warm-up, or at the first call
    assert compiled.totals.decode_steps == eager.totals.decode_steps  # the warm-up's steps are not counted


def test_a_compiled_decode_step_without_a_cxx_compiler_is_refused_naming_its_key(tmp_path):
    from torch._inductor import config as inductor_config

    from serving.modeling import CompileUnavailable

    # torch's own patch, not monkeypatch: monkeypatch's undo deletes the key from inductor's config, which then hides
    # it ("cpp.cxx does not exist") from every later compile in this process
    missing = (str(tmp_path / "no-such-compiler"),)  # what $CXX sets
    with inductor_config.patch({"cpp.cxx": missing}), \
            pytest.raises(CompileUnavailable, match=r"policy\.generation\.compile=true: .*C\+\+ compiler"):
        TorchGenerationBackend(tiny_model(), 0, torch.device("cpu"), compile_decode=True)
    assert inductor_config.cpp.cxx != missing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where Triton cannot run on a GPU")
def test_a_compiled_pass_on_cuda_without_triton_is_refused_naming_its_key():
    """Asked for on a CUDA device where Triton cannot build kernels (here: no GPU at all), compile is refused at
    start naming the key, as the CPU's missing compiler is, not at the first pass."""
    from serving.modeling import CompileUnavailable, require_compiler

    with pytest.raises(CompileUnavailable, match=r"^compile=true: torch.compile on cuda builds Triton kernels"):
        require_compiler("compile", torch.device("cuda"))


def test_a_cuda_device_turns_sdpa_cudnn_attention_off_and_the_cpu_leaves_it(monkeypatch):
    """The services, the actor and the generation bench resolve their device through `resolve_device`: on CUDA it turns
    off SDPA's cuDNN backend, whose plan per new shape made stop-at-EOS generation 7x slower on an H100
    (docs/PERFORMANCE.md), and it refuses a GPU torch does not see, naming the key. Setting the flag needs no GPU; here
    torch is told it sees two (the one thing faked); the effect on speed is measured by the bench only."""
    from serving.modeling import DeviceUnavailable, resolve_device

    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable, match=r"^policy.device=cuda: (this torch is a CPU-only build|torch sees "
                                                     r"no GPU here)"):
            resolve_device("cuda", "policy.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert resolve_device("cpu") == torch.device("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        with pytest.raises(DeviceUnavailable, match=r"^device=cuda:2: torch sees 2 GPU\(s\) here, cuda:0 to cuda:1$"):
            resolve_device("cuda:2")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert resolve_device("cuda:1") == torch.device("cuda", 1)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def test_gpt2_runs_on_the_preallocated_cache():
    model, prompts = tiny_model("gpt2"), tiny_prompts()
    backend = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0)
    r = backend.generate(prompts, SamplingParams(12, temperature=0.0, stop_token_ids=(2,)), seed=0)
    assert backend.last_stats.cache == "preallocated"
    for i, p in enumerate(prompts):
        assert responses(r)[i] == generate_alone(model, p, 12), i
    d = TorchGenerationBackend(model, 0, torch.device("cpu"), kv_cache="dynamic").generate(
        prompts, SamplingParams(12, temperature=0.0, stop_token_ids=(2,)), seed=0)
    assert torch.equal(r.tokens, d.tokens)
    torch.testing.assert_close(r.logprobs, d.logprobs, rtol=0, atol=1e-5)


def test_models_that_cannot_use_the_preallocated_cache_fall_back_to_dynamic_cache(caplog):
    prompts = tiny_prompts()
    params = SamplingParams(12, temperature=0.0, stop_token_ids=(2,))
    # A sliding window that slides within prompt + max_new_tokens keeps transformers' own DynamicCache; a longer one
    # never slides, and its layers run on the pre-allocated cache.
    for window, cache in ((4, "dynamic"), (32, "preallocated")):
        mistral = tiny_model("mistral", sliding_window=window)
        backend = TorchGenerationBackend(mistral, 0, torch.device("cpu"))
        r = backend.generate(prompts, params, seed=0)
        assert backend.last_stats.cache == cache
        for i, p in enumerate(prompts):
            assert responses(r)[i] == generate_alone(mistral, p, 12), (window, i)

    # A model whose forward rejects the cache it is given: retried on DynamicCache.
    class Picky(LlamaForCausalLM):
        def forward(self, *args, past_key_values=None, **kwargs):
            if isinstance(past_key_values, PreallocatedCache):
                raise TypeError("unsupported cache")
            return super().forward(*args, past_key_values=past_key_values, **kwargs)

    llama = tiny_model()
    picky = Picky(llama.config).eval()
    picky.load_state_dict(llama.state_dict())
    backend = TorchGenerationBackend(picky, 0, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="actor.generation"):
        r = backend.generate(prompts, params, seed=0)
        assert backend.last_stats.cache == "dynamic"
        assert torch.equal(r.tokens, backend.generate(prompts, params, seed=0).tokens)  # not tried again: one warning
    assert [rec.getMessage() for rec in caplog.records] == [
        "Picky cannot use the pre-allocated KV cache (unsupported cache); generating with DynamicCache"]
    assert torch.equal(r.tokens, TorchGenerationBackend(llama, 0, torch.device("cpu")).generate(prompts, params, 0).tokens)


@pytest.mark.parametrize(("precision", "family"), [("float32", "llama"), ("bfloat16", "llama"), ("float32", "gpt2")])
def test_generation_bench_runs(capsys, precision, family):
    from bench.generation import main

    assert main(["--quick", "--threads", str(torch.get_num_threads()), "--precision", precision, "--profile",
                 "--family", family]) == 0
    out = capsys.readouterr().out
    assert f"fixed: {family}," in out and f"eos: {family}," in out and "median speed-up" in out
    assert out.count(f"{precision} on cpu") == 2
    # what ours ran per generation: eager, so every decode forward uncompiled and no graph count
    assert len(re.findall(r"ours per generation: [1-9]\d* decode forwards, 0 of them compiled, [\d.]+ compactions\n",
                          out)) == 2
    # the profile splits each setting's step; only the fixed setting (no rows leaving) has a KV read rate
    assert out.count("milliseconds per decode step") == 2 and out.count("attention reads the KV cache at") == 1


def test_kv_cache_bench_runs(capsys):
    from bench.kv_cache import main

    assert main(["--quick", "--threads", str(torch.get_num_threads())]) == 0
    out = capsys.readouterr().out
    # every measurement printed, each variant's figure beside the first one's
    for heading in ("write one decode step's keys", "attention of one decode query over 8 positions:",
                    "by the gap after each (row, head)", "attention over 12 positions:"):
        assert heading in out
    assert len(re.findall(r" [\d.]+ us +[\d.]+x\n", out)) == 14


def padded_output(model, extra: int, boost: float):
    """`model` with `extra` output rows past its vocabulary (as Qwen's and Pythia's are padded), whose logits are
    `boost` standard deviations high, so that a plain sampler picks them often."""
    padded = copy.deepcopy(model)
    n = padded.get_output_embeddings().weight.shape[0]
    padded.resize_token_embeddings(n + extra)
    with torch.no_grad():
        head = padded.get_output_embeddings().weight
        head[n:] = head[:n].std(0) * boost
    return padded.eval()


def test_ids_past_the_tokenizer_are_never_sampled_and_log_probs_stay_the_full_models(setup):
    tok, model, prompts, _ = setup
    padded = padded_output(model, 16, 3.0)
    params = SamplingParams(max_new_tokens=12)
    plain = TorchGenerationBackend(padded, tok.pad_token_id, torch.device("cpu")).generate(prompts * 4, params, seed=3)
    assert int(plain.tokens.max()) >= len(tok)  # without the tokenizer, the padding rows are sampled
    r = TorchGenerationBackend(padded, tok.pad_token_id, torch.device("cpu"), tokenizer=tok).generate(
        prompts * 4, params, seed=3)
    assert int(r.tokens.max()) < len(tok)
    # the recorded log-probs are the full model's, as the policy's own pass computes them
    with torch.no_grad():
        valid = (torch.arange(r.tokens.shape[1])[None, :] < r.lengths[:, None]).long()
        full = torch.log_softmax(padded(input_ids=r.tokens, attention_mask=valid).logits.float(), -1)
    taken = full[:, :-1].gather(2, r.tokens[:, 1:, None]).squeeze(2)
    mask = r.action_mask().bool()
    torch.testing.assert_close(r.logprobs[mask], taken[mask], atol=1e-5, rtol=0)


def test_the_static_shape_cache_samples_as_the_preallocated_one_and_keeps_its_buffers():
    """kv_cache='static' (what policy.generation.cuda_graphs decodes on): every step attends over the whole cache
    with the unwritten positions masked, finished rows stay in the batch, and the cache is kept between generations of
    the same batch and rounded length (a CUDA graph replays on the same buffers). Same tokens and log-probs (1e-5) as
    the pre-allocated cache without compaction, sampling and greedy, prompts of different widths."""
    model, prompts = tiny_model(), tiny_prompts()
    # never compacting, as the static cache does not: rows share one random stream, so the batch must match
    pre = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=0.0)
    static = TorchGenerationBackend(model, 0, torch.device("cpu"), kv_cache="static")
    cases = [(prompts, SamplingParams(20, temperature=0.0, stop_token_ids=(2,))),
             (prompts, SamplingParams(12, temperature=0.9, top_k=10, stop_token_ids=(2,))),
             ([p + [7, 9, 11] for p in prompts], SamplingParams(25, temperature=1.0)),  # wider, the same rounded length
             (prompts[:5], SamplingParams(30, temperature=0.0, stop_token_ids=(2,)))]  # another batch: a new cache
    buffers = []
    for i, (rows, params) in enumerate(cases):
        a, b = pre.generate(rows, params, seed=i), static.generate(rows, params, seed=i)
        assert_same_samples(a, b, i)
        stats = static.last_stats
        assert stats.cache == "static" and stats.compactions == 0 and stats.row_steps == len(rows) * stats.decode_steps
        cache = static._static_cache[1]
        assert cache.max_cache_len == 64  # prompt + new tokens, rounded up to a multiple of 64
        buffers.append(cache.layers[0].keys.data_ptr())
    assert buffers[0] == buffers[1] == buffers[2] != buffers[3]


def test_the_static_shape_cache_keeps_values_in_their_own_dtype_under_autocast():
    """Under bf16 autocast Llama hands the cache float32 keys (rotary embeddings in float32) and bf16 values;
    transformers' StaticLayer would make both buffers the keys' dtype and fail on the values (found on a GPU:
    generation fell back to the DynamicCache). The same tokens as the pre-allocated cache in bf16."""
    model, prompts = tiny_model(), tiny_prompts()
    params = SamplingParams(16, temperature=0.0, stop_token_ids=(2,))
    pre = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0, compute_dtype=torch.bfloat16)
    static = TorchGenerationBackend(model, 0, torch.device("cpu"), kv_cache="static", compute_dtype=torch.bfloat16)
    a, b = pre.generate(prompts, params, seed=0), static.generate(prompts, params, seed=0)
    assert static.last_stats.cache == "static"
    layer = static._static_cache[1].layers[0]
    assert (layer.keys.dtype, layer.values.dtype) == (torch.float32, torch.bfloat16)
    assert torch.equal(a.tokens, b.tokens)


def test_a_compiled_step_on_the_static_shape_cache_samples_as_the_eager_one_on_one_graph():
    """The compiled decode step on the static-shape cache (what CUDA graphs record; on a CPU inductor records none):
    the eager step's tokens and log-probs, and generations reusing the cache compile nothing more."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, prompts = tiny_model(), tiny_prompts()
    eager = TorchGenerationBackend(model, 0, torch.device("cpu"), kv_cache="static")
    compiled = TorchGenerationBackend(model, 0, torch.device("cpu"), kv_cache="static", compile_decode=True)
    graphs = None
    for i in range(3):
        params = SamplingParams(20, temperature=1.0 if i else 0.0, stop_token_ids=(2,))
        a, b = eager.generate(prompts, params, seed=i), compiled.generate(prompts, params, seed=i)
        assert torch.equal(a.tokens, b.tokens), i
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert compiled.last_stats.compiled_steps == compiled.last_stats.decode_steps > 0
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_cuda_graphs_off_a_cuda_device_are_refused_naming_the_key():
    from serving.modeling import CompileUnavailable

    with pytest.raises(CompileUnavailable, match=r"policy\.generation\.cuda_graphs=true: CUDA graphs need a CUDA device"):
        TorchGenerationBackend(tiny_model(), 0, torch.device("cpu"), cuda_graphs=True)
    with pytest.raises(ValueError, match="kv_cache must be 'auto', 'dynamic' or 'static'"):
        TorchGenerationBackend(tiny_model(), 0, torch.device("cpu"), kv_cache="paged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (CI has none)")
def test_cuda_graphs_sample_as_eager_decoding_on_a_gpu():
    """policy.generation.cuda_graphs on a GPU: greedy tokens as the eager pre-allocated cache gives them in float32;
    in float32 and under bf16 autocast, on the static-shape cache (not a fallback), every decode step run compiled,
    and the same tokens again when the recorded graphs replay on the kept cache."""
    from serving.modeling import resolve_device

    dev = resolve_device("cuda")
    model = tiny_model().to(dev)
    prompts, params = tiny_prompts(), SamplingParams(24, temperature=0.0, stop_token_ids=(2,))
    for dtype in (torch.float32, torch.bfloat16):
        eager = TorchGenerationBackend(model, 0, dev, compact_below=0.0, compute_dtype=dtype)
        graphs = TorchGenerationBackend(model, 0, dev, cuda_graphs=True, compute_dtype=dtype)
        a = eager.generate(prompts, params, seed=0)
        b, c = graphs.generate(prompts, params, seed=0), graphs.generate(prompts, params, seed=0)
        assert graphs.last_stats.cache == "static", dtype
        assert graphs.last_stats.compiled_steps == graphs.last_stats.decode_steps > 0, dtype
        assert torch.equal(b.tokens, c.tokens), dtype  # a replay samples as the recording did
        if dtype == torch.float32:  # (in bf16 fused kernels round differently: a greedy tie may go the other way)
            assert torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


def test_a_step_inductor_records_no_cuda_graph_for_is_logged(caplog):
    """cudagraphs_checked: where inductor compiles a mode="reduce-overhead" function but records no CUDA graph (here:
    CPU tensors, which it never records), the first call logs a warning naming the key; later calls log nothing."""
    from actor.generation import cudagraphs_checked

    torch._dynamo.reset()
    fn = cudagraphs_checked(torch.compile(lambda x: torch.sin(x) + 1, mode="reduce-overhead"), "some.key=true")
    with caplog.at_level(logging.WARNING, logger="actor.generation"):
        torch.testing.assert_close(fn(torch.ones(3)), torch.sin(torch.ones(3)) + 1)
        fn(torch.zeros(3))
    warnings = [r.getMessage() for r in caplog.records if "recorded no CUDA graph" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("some.key=true:"), warnings
    torch._dynamo.reset()
