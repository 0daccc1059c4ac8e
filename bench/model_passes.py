"""The actor's passes over whole sequences, timed in one process: how a batch is cut into passes, and whether the
no-grad passes run eager or compiled, on the plain layers or on weights prepacked for oneDNN, and how close training
is to the machine's limit. The figures behind docs/PERFORMANCE.md's "Prepacked weights" and "Forward passes cut by
tokens" paragraphs, and its W1 phases against the limit.

    python -m bench.model_passes [--rounds 3] [--width 272] [--rows 4,16] [--train-rows 2,8,16] [--threads 1]
        [--no-compile] [--quick]

--no-compile leaves out every compiled variant (log-prob passes and training).

The model is the TRL bench's policy (bench/trl_models.py, built locally: a Llama of hidden 256, 6 layers); the batch
64 rows of `--width` tokens, none padded. Two measurements, each in alternating rounds (every variant once a round),
median seconds:

  log-probs  the rollout's no-grad log-prob pass over the batch as the actor computes it
             (`actor.rollouts.RolloutCollector.logprobs`), in passes of R rows for each R in --rows, four ways:
             eager, eager on prepacked weights, compiled (`policy.compile`), compiled on prepacked weights. Every
             variant's log-probs are checked against eager's (1e-4) before anything is timed.
  training   a forward and backward of the batch in micro-batches of R rows for each R in --train-rows, eager and
             compiled (as the policy update runs with `policy.compile` off and on; a sum of log-probs as the loss),
             with the model FLOPs (6 x matmul parameters x tokens) per second against the torch.mm peak at the same
             thread count, measured in the same run. Then one more training of the last variant under the torch
             profiler, split by self CPU time into matmuls, attention, the compiled graph's fused kernels and the
             rest, with the matmuls' own rate (the model FLOPs over their time) against the peak: how close
             training is to the machine's limit, and what the rest of its time is.

--threads 1 is how the bench's actor computes these passes beside the servers (num_threads_shared). --quick runs
the tiny model at tiny sizes to check that the command runs (tests/test_padding_free.py); its figures say nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actor.rollouts import RolloutCollector
from actor.tracking import Timers
from algorithms import logprobs_from_logits
from bench.generation import self_cpu_by_kind
from bench.trl_models import ensure_built, matmul_params
from bench.trl_ppo import matmul_peak
from serving.modeling import ModelPass, PassLimits, causal_lm_logits, compiled, length_buckets


def parse_sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def alternating(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each variant over `rounds` rounds, every variant once a round in turn, after one untimed
    call each (compiles, allocator growth)."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def logprob_variants(model, tokens: torch.Tensor, lengths: torch.Tensor, rows: list[int],
                     compile_: bool) -> dict[str, Callable[[], torch.Tensor]]:
    logits = compiled(causal_lm_logits, True, "--compile", torch.device("cpu")) if compile_ else None
    ways = {"eager": (causal_lm_logits, False), "eager, prepacked": (causal_lm_logits, True)}
    if logits is not None:
        ways.update({"compiled": (logits, False), "compiled, prepacked": (logits, True)})
    variants = {}
    for r in rows:
        for way, (fn, prepack) in ways.items():
            collector = RolloutCollector(policy=model, reference=None, backend=None, critic=None, score=None, pad_id=0,
                                         device=torch.device("cpu"), generation_batch_size=len(lengths),
                                         logprob_passes=PassLimits(rows=r), timers=Timers(), logits=fn,
                                         prepack=prepack)
            variants[f"{way}, passes of {r} rows"] = (
                lambda c=collector: c.logprobs(model, tokens, lengths))
    return variants


def training_variant(model, tokens: torch.Tensor, lengths: torch.Tensor, rows: int,
                     logits: ModelPass = causal_lm_logits) -> Callable[[], None]:
    def run() -> None:
        for idx in length_buckets(lengths, rows):
            tok = tokens[idx]
            lp = logprobs_from_logits(logits(model, tok, lengths[idx])[:, :-1].float(), tok[:, 1:])
            lp.sum().backward()
        model.zero_grad(set_to_none=True)

    return run


def training_split(run: Callable[[], None], flops: float, peak: float) -> None:
    """Profile one call of `run` (a training variant) and print its self CPU time by kind, and the matmuls' rate."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ms, total = self_cpu_by_kind(prof, ("matmuls", "attention (forward and backward)",
                                        "the compiled graph's fused kernels",
                                        "the rest (eager pointwise ops, loss, autograd, Python)"))
    for what, t in ms.items():
        print(f"    {what:<56} {t:9.1f} ms  ({t / total:4.0%})")
    if ms["matmuls"] > 0:
        rate = flops / (ms["matmuls"] / 1e3)
        print(f"    the matmuls alone: {rate / 1e9:.1f} GFLOP/s ({rate / peak:.0%} of the peak)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=272, help="tokens a row (16 prompt + 256 response in W2)")
    parser.add_argument("--rows", default="4,16", help="rows a log-prob pass, comma-separated")
    parser.add_argument("--train-rows", default="2,8,16", help="rows a training micro-batch, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true", help="leave out every compiled variant (log-prob passes and training)")
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes: only checks the command runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.width, args.rows, args.train_rows = 1, 12, "2,4", "2,4"
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    shape = "tiny" if args.quick else "full"
    model = AutoModelForCausalLM.from_pretrained(ensure_built(shape).policy, dtype=torch.float32).eval()
    batch = 8 if args.quick else 64
    tokens = torch.randint(4, model.config.vocab_size, (batch, args.width), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((batch,), args.width)
    print(f"bench.model_passes: {shape} policy ({matmul_params(model.config, model.config.vocab_size) / 1e6:.2f}M "
          f"matmul parameters), {batch} x {args.width} tokens, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} round(s)", flush=True)

    variants = logprob_variants(model, tokens, lengths, parse_sizes(args.rows), not args.no_compile)
    reference = next(iter(variants.values()))()
    for name, fn in variants.items():
        torch.testing.assert_close(fn(), reference, atol=1e-4, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    print("\nno-grad log-prob passes (RolloutCollector.logprobs), median seconds:")
    for name, seconds in alternating(variants, args.rounds).items():
        print(f"  {name:<40} {seconds:7.3f} s")

    peak = matmul_peak(args.threads, 512 if args.quick else 2048)
    flops = 6 * matmul_params(model.config, model.config.vocab_size) * tokens.numel()
    ways: dict[str, ModelPass] = {"eager": causal_lm_logits}
    if not args.no_compile:
        ways["compiled"] = compiled(causal_lm_logits, True, "--compile", torch.device("cpu"))
    runs = {f"{way}, micro-batches of {r} rows": training_variant(model, tokens, lengths, r, fn)
            for r in parse_sizes(args.train_rows) for way, fn in ways.items()}
    timed = alternating(runs, args.rounds)
    print(f"\ntraining forward and backward, median seconds (torch.mm peak at {args.threads} thread(s): "
          f"{peak / 1e9:.0f} GFLOP/s):")
    for name, seconds in timed.items():
        print(f"  {name:<40} {seconds:7.3f} s  {flops / seconds / 1e9:6.1f} GFLOP/s ({flops / seconds / peak:.0%} of "
              f"the peak)")
    last = list(runs)[-1]
    print(f"\nwhere its time goes, {last} (one more call, under the torch profiler; self CPU time):")
    training_split(runs[last], flops, peak)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
