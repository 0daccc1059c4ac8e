"""Rollout generation speed: the actor's PyTorch backend (`actor.generation.TorchGenerationBackend`) against
transformers' `generate()` on the same model, batch and sampling, in alternating rounds.

    python -m bench.generation [--rounds 3] [--settings fixed,eos] [--compile] [--no-prepack] [--quick] [--profile]
        [--device cpu|cuda] [--precision float32|bfloat16] [--family llama|gpt2]

The model is a Llama built locally from a fixed seed (no downloads): hidden 256, 6 layers, 8 heads, intermediate
768, vocabulary 100, float32 (`--family gpt2`: a GPT-2 of the same widths, whose projections are transformers'
`Conv1D` rather than `torch.nn.Linear`); batch 64 of random 16-token prompts, 2 torch threads, pure sampling
(temperature 1, no top-k/top-p) on both sides. Two settings:

  fixed  no stop token on either side: every row generates 256 new tokens;
  eos    both stop at EOS (up to 256 new tokens), whose logit gets a bias through the lm_head (--eos-bias 0.3:
         responses average ~75 tokens), so rows finish at scattered steps.

Tokens/s = valid response tokens (up to and including the stop token) / wall-clock seconds of the call, the same
definition for both. Each setting first runs both sides once untimed at full size (the first long run of a process
pays for the allocator's growth, page faults included), then alternates: ours, transformers, ... and prints every
round's tokens/s, mean response length, ratio and the 1-minute load average, then the medians, and what our side
ran per generation (decode forwards, how many compiled, compactions; with `--compile` also the graphs compiled in
the setting, its untimed warm-up included: 1 when one graph served every batch size and cache length). `--quick` is
a tiny
model and batch that only checks the bench runs. `--device cuda --precision bfloat16` measures the same on a GPU
(both sides on the same device and dtype; each timed call ends with a device synchronisation); its figures on one
H100 are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, LlamaConfig, PreTrainedModel

from actor.generation import GENERATION_COUNTS, GenerationStats, SamplingParams, TorchGenerationBackend
from serving.modeling import resolve_device

PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    batch: int
    prompt_len: int
    max_new_tokens: int


FULL = Size(hidden=256, layers=6, heads=8, intermediate=768, vocab=100, batch=64, prompt_len=16, max_new_tokens=256)
QUICK = Size(hidden=32, layers=2, heads=2, intermediate=64, vocab=100, batch=8, prompt_len=4, max_new_tokens=12)


def build_model(size: Size, eos_bias: float, seed: int = 0, family: str = "llama") -> PreTrainedModel:
    """A deterministic random Llama (or GPT-2 of the same widths); `eos_bias` is added to the EOS logit (0 leaves the
    logits as they are)."""
    positions = 2 * (size.prompt_len + size.max_new_tokens)
    ids = {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS}
    if family == "gpt2":
        config = GPT2Config(vocab_size=size.vocab, n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
                            n_inner=size.intermediate, n_positions=positions, **ids)
    else:
        config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                             num_attention_heads=size.heads, num_key_value_heads=size.heads,
                             intermediate_size=size.intermediate, max_position_embeddings=positions, **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if eos_bias:
        bias = torch.zeros(size.vocab)
        bias[EOS] = eos_bias
        model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return model


def valid_tokens(generated: torch.Tensor, eos: int | None) -> int:
    """Response tokens of transformers' output (prompt cut off): up to and including each row's first EOS."""
    if eos is None:
        return generated.numel()
    hit = generated == eos
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, generated.shape[1])
    return int(first.sum())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(backend: TorchGenerationBackend, prompts: torch.Tensor, n: int, eos: int | None,
             seed: int) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=n, temperature=1.0, stop_token_ids=() if eos is None else (eos,))
    synchronize(backend.device)
    start = time.perf_counter()
    r = backend.generate(prompts.tolist(), params, seed)
    synchronize(backend.device)
    return time.perf_counter() - start, int(r.response_lengths.sum())


def run_hf(model: PreTrainedModel, prompts: torch.Tensor, n: int, eos: int | None, seed: int) -> tuple[float, int]:
    config = GenerationConfig(do_sample=True, max_new_tokens=n, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=eos, pad_token_id=PAD, bos_token_id=BOS)
    torch.manual_seed(seed)
    synchronize(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
    synchronize(model.device)
    return time.perf_counter() - start, valid_tokens(out[:, prompts.shape[1]:], eos)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def cudagraph_skips() -> int:
    """Compiled graphs inductor ran without recording a CUDA graph (mode='reduce-overhead'), in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def decode_report(totals: GenerationStats, before: GenerationStats, rounds: int, new_graphs: int | None) -> str:
    """Our decode work over the timed rounds, per generation: decode forwards, how many ran compiled, compactions
    (finished rows leaving the batch), and with the compiled step the graphs compiled in the setting, its untimed
    warm-up (where the step first compiles) included. One graph serves every batch size and cache length, so more
    than 1 means dynamo recompiled; counting from before the warm-up also catches recompiles that used up dynamo's
    recompile limit there and left the timed rounds on eager fallbacks."""
    n = {name: (getattr(totals, name) - getattr(before, name)) / rounds for name in GENERATION_COUNTS}
    line = (f"  ours per generation: {n['decode_steps']:.0f} decode forwards, {n['compiled_steps']:.0f} of them "
            f"compiled, {n['compactions']:.1f} compactions")
    return line + ("" if new_graphs is None else f"; graphs compiled in this setting, warm-up included: {new_graphs}")


# the matmul ops, the packed layers' oneDNN linear included (serving.prepack: generation computes through it)
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")


def self_cpu_by_kind(prof, labels: tuple[str, str, str, str]) -> tuple[dict[str, float], float]:
    """A torch profile's self CPU milliseconds by kind, keyed by `labels`: the matmuls, the attention kernels, the
    compiled graph's fused kernels and everything else; and their total."""
    matmul, attention, fused, rest = labels
    ms = {matmul: 0.0, attention: 0.0, fused: 0.0}
    total = 0.0
    for event in prof.key_averages():
        t = event.self_cpu_time_total / 1e3
        total += t
        if event.key in MATMULS:
            ms[matmul] += t
        elif "scaled_dot_product" in event.key:
            ms[attention] += t
        elif event.key.startswith("## Call CompiledFxGraph"):
            ms[fused] += t
    ms[rest] = total - sum(ms.values())
    return ms, total


def profile_ours(backend: TorchGenerationBackend, prompts: torch.Tensor, n: int, eos: int | None, size: Size) -> None:
    """Where one of our generations spends its time, per decode step: the profiler's self CPU time of the matmuls,
    the attention kernels, the compiled graph's fused kernels and everything else. Without a stop token, also the rate
    at which attention reads the KV cache (every layer's keys and values up to each step's length) against a plain
    streaming read of 256 MiB (`sum`) on the same threads: the memory bandwidth that bounds it. On a GPU the split is
    of host time (launching the work); it adds the GPU's kernel time and kernel launches per decode step, and the ops
    that took the most GPU time, in place of the read rate."""
    from torch.profiler import ProfilerActivity, profile

    cuda = backend.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        seconds, _ = run_ours(backend, prompts, n, eos, seed=20_000)
    steps = max(backend.last_stats.decode_steps, 1)
    ms, total = self_cpu_by_kind(prof, ("matmul", "attention", "compiled graph's fused kernels",
                                        "everything else (eager pointwise ops, sampling, Python, guards, cache writes)"))
    print(f"  profile of one generation of ours ({steps} decode steps, {seconds:.2f} s under the profiler), "
          f"milliseconds per decode step (the prefill included):")
    for what, t in ms.items():
        print(f"    {what:<66} {t / steps:6.2f}  ({t / total:4.0%})")
    kernel_ms, launches = device_work(prof)  # on every device, so that the suite runs it: (0, 0) on the CPU
    if cuda:  # not run by the suite: CI has no GPU
        print(f"    on {torch.cuda.get_device_name(backend.device)}: {seconds / steps * 1e3:.2f} ms of wall time a "
              f"decode step, of which the GPU ran kernels for {kernel_ms / steps:.2f} ms, from {launches / steps:.0f} "
              f"kernel launches; the ops by GPU time:")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
        return
    if eos is None and ms["attention"] > 0:
        itemsize = next(backend.model.parameters()).element_size()
        per_position = size.layers * 2 * size.batch * size.hidden * itemsize  # K and V of every head
        read = sum(per_position * (size.prompt_len + t + 1) for t in range(steps))
        x = torch.ones(64 * 2**20)  # 256 MiB of float32
        x.sum()
        best = min(_timed(x.sum) for _ in range(10))
        print(f"    attention reads the KV cache at {read / (ms['attention'] / 1e3) / 1e9:.1f} GB/s; a streaming read "
              f"of 256 MiB runs at {x.numel() * 4 / best / 1e9:.1f} GB/s on {torch.get_num_threads()} threads")


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def device_work(prof) -> tuple[float, int]:
    """(milliseconds the GPU spent in kernels, kernel launches) in a profile with CUDA activity; (0, 0) without."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernel_us = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA)
    return kernel_us / 1e3, sum(1 for e in events if e.name in LAUNCHES)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_setting(name: str, size: Size, rounds: int, eos_bias: float, compact_below: float,
                  compile_decode: bool = False, device: str = "cpu", precision: str = "float32",
                  profile: bool = False, prepack: bool = True, cuda_graphs: bool = False,
                  family: str = "llama") -> list[float]:
    eos = None if name == "fixed" else EOS
    dev = resolve_device(device, "--device")  # as the actor's: on CUDA, SDPA's cuDNN backend off (both sides)
    model = build_model(size, eos_bias if eos is not None else 0.0, family=family).to(dev, getattr(torch, precision))
    backend = TorchGenerationBackend(model, PAD, dev, compact_below=compact_below, compile_decode=compile_decode,
                                     prepack=prepack, cuda_graphs=cuda_graphs)
    compile_decode = compile_decode or cuda_graphs
    prompts = torch.randint(3, size.vocab, (size.batch, size.prompt_len), generator=torch.Generator().manual_seed(1))
    prompts = prompts.to(dev)
    n = size.max_new_tokens
    graphs_before, skips_before = compiled_graphs(), cudagraph_skips()
    run_ours(backend, prompts, n, eos, seed=10_000)  # warm-up, untimed
    run_hf(model, prompts, n, eos, seed=10_000)
    stop = f"stop at EOS (EOS logit bias {eos_bias:g})" if eos is not None else "no stop token"
    print(f"\n{name}: {family}, batch {size.batch}, prompts {size.prompt_len}, max_new_tokens {n}, {stop}; "
          f"ours on the {backend.last_stats.cache} KV cache, compact_below {compact_below:g}"
          f"{', decode step compiled' if compile_decode else ''}{' as CUDA graphs' if cuda_graphs else ''}"
          f"{', weights prepacked (oneDNN)' if backend.prepack else ''}; {precision} on {device}")
    print(f"{'round':>5}  {'ours tok/s':>10}  {'mean len':>8}  {'hf tok/s':>10}  {'mean len':>8}  {'ratio':>6}  load")
    ours_tps, hf_tps, ratios = [], [], []
    before = replace(backend.totals)
    for i in range(rounds):
        t_ours, n_ours = run_ours(backend, prompts, n, eos, seed=i)
        t_hf, n_hf = run_hf(model, prompts, n, eos, seed=i)
        ours_tps.append(n_ours / t_ours)
        hf_tps.append(n_hf / t_hf)
        ratios.append(ours_tps[-1] / hf_tps[-1])
        print(f"{i + 1:>5}  {ours_tps[-1]:>10.0f}  {n_ours / size.batch:>8.1f}  {hf_tps[-1]:>10.0f}  "
              f"{n_hf / size.batch:>8.1f}  {ratios[-1]:>5.2f}x  {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'med':>5}  {statistics.median(ours_tps):>10.0f}  {'':>8}  {statistics.median(hf_tps):>10.0f}  {'':>8}  "
          f"{statistics.median(ratios):>5.2f}x")
    print(decode_report(backend.totals, before, rounds, compiled_graphs() - graphs_before if compile_decode else None))
    if cuda_graphs:  # a step inductor recorded no graph for runs without one (TORCH_LOGS=perf_hints says why), and
        # the figure above is then not the graphs'
        print(f"  CUDA graphs skipped by inductor in this setting: {cudagraph_skips() - skips_before}")
    if profile:
        profile_ours(backend, prompts, n, eos, size)
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default="fixed,eos", help="comma-separated: fixed, eos")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eos-bias", type=float, default=0.3, help="added to the EOS logit in the eos setting")
    parser.add_argument("--compact-below", type=float, default=0.75, help="TorchGenerationBackend(compact_below=...)")
    parser.add_argument("--compile", action="store_true", help="ours with the decode step compiled "
                        "(TorchGenerationBackend(compile_decode=True), policy.generation.compile); the untimed warm-up "
                        "run compiles it")
    parser.add_argument("--cuda-graphs", action="store_true", help="ours with the compiled decode step replayed as CUDA "
                        "graphs on the static-shape cache (TorchGenerationBackend(cuda_graphs=True), "
                        "policy.generation.cuda_graphs; --device cuda only)")
    parser.add_argument("--no-prepack", action="store_true", help="ours without prepacked weights "
                        "(TorchGenerationBackend(prepack=False), policy.generation.prepack_weights=false)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch, one round: checks the bench runs")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="both sides' device")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32", help="the model's dtype")
    parser.add_argument("--family", choices=["llama", "gpt2"], default="llama", help="the model's architecture "
                        "(gpt2: transformers' Conv1D projections)")
    parser.add_argument("--profile", action="store_true", help="after each setting's rounds, profile one more generation "
                        "of ours and print where a decode step's time goes (on a GPU also its kernel time and launches)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    torch.set_num_threads(args.threads)
    size, rounds = (QUICK, 1) if args.quick else (FULL, args.rounds)
    print(f"torch {torch.__version__}, {args.threads} threads, {len(os.sched_getaffinity(0))} cores")
    medians = {}
    for name in args.settings.split(","):
        if name not in ("fixed", "eos"):
            parser.error(f"unknown setting {name!r}")
        medians[name] = statistics.median(bench_setting(name, size, rounds, args.eos_bias, args.compact_below,
                                                        args.compile, args.device, args.precision, args.profile,
                                                        not args.no_prepack, args.cuda_graphs, args.family))
    print("\nmedian speed-up (ours / transformers tokens/s): " + ", ".join(f"{k} {v:.2f}x" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
