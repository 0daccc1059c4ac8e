"""What a decode step's KV cache costs, op by op: the micro-timings behind docs/PERFORMANCE.md's Generation section.

    python -m bench.kv_cache [--repeats 200] [--threads 2] [--quick]

The shapes are the generation bench's (bench/generation.py): batch 64, 8 heads of 32, a cache of 16 prompt + 256 new
tokens, 6 layers. Each timing is the median over `--repeats` calls, variants alternating call by call, and the calls
cycle through 6 layers' keys and values (12 tensors, about 204 MiB at full length) so that, as in a real step, a
layer's cache is not still in the CPU's caches from its last call. Four measurements:

  write      one decode step's new keys (or values), [64, 8, 1, 32], written at the middle position of the
             pre-allocated [64, 8, 272, 32] buffer: a copy into the slice (what an eager step does) against
             `index_copy_` into the whole buffer (what the compiled step does), microseconds a write;
  layout     one decode query [64, 8, 1, 32] attending (scaled_dot_product_attention) to the first t positions of
             the pre-allocated buffer (a strided view: each (row, head) block is followed by a gap of 272 - t
             positions) against a packed [64, 8, t, 32] tensor, and against the prefix with query, keys and values
             in bfloat16 (a half-precision cache), at t = 48, 144 and 272, microseconds a layer;
  gap        the same query over t = `gap_length` positions of buffers t + g long, g = 0 (packed) up to 272 - t (the
             pre-allocated buffer), so the gap after each (row, head) block is g positions; and what re-packing a
             layer's keys (or values) costs: their first t positions copied into a new buffer;
  chunked    the same query over a packed cache split into chunks of 64 positions, one SDPA call per chunk with its
             log-sum-exp, merged: the split a cache made of packed chunks would need, against one call over the
             prefix of the pre-allocated buffer, at t = 80.

Every variant's result is checked against the first's before anything is timed. `--quick` shrinks the shapes and
repeats to check that the command runs (tests/test_generation.py); its figures say nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    head_dim: int
    capacity: int  # prompt + new tokens: the pre-allocated length
    layers: int
    lengths: tuple[int, ...]  # filled positions the layout comparison attends to
    gap_length: int
    gaps: tuple[int, ...]
    chunk: int
    chunked_length: int


FULL = Shape(batch=64, heads=8, head_dim=32, capacity=272, layers=6, lengths=(48, 144, 272), gap_length=144,
             gaps=(0, 4, 8, 16, 32, 128), chunk=64, chunked_length=80)
QUICK = Shape(batch=4, heads=2, head_dim=8, capacity=24, layers=2, lengths=(8, 24), gap_length=8, gaps=(0, 4, 16),
              chunk=8, chunked_length=12)


def alternating(variants: dict[str, Callable[[int], object]], repeats: int, layers: int) -> dict[str, float]:
    """Median microseconds of each variant's call, the variants taking turns call by call; call i works on layer
    i % layers."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(-2 * layers, repeats * layers):  # the first rounds warm up, untimed
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(i % layers)
            if i >= 0:
                times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def cache_write(shape: Shape, repeats: int) -> dict[str, float]:
    b, h, d = shape.batch, shape.heads, shape.head_dim
    # each variant writes buffers of its own, so neither finds the other's freshly written lines in the CPU's caches
    sliced, indexed = ([torch.randn(b, h, shape.capacity, d) for _ in range(2 * shape.layers)] for _ in range(2))
    new = torch.randn(b, h, 1, d)
    at = shape.capacity // 2
    where = torch.tensor([at])

    def into_slice(layer: int) -> None:
        sliced[layer][:, :, at:at + 1].copy_(new)

    def by_index_copy(layer: int) -> None:
        indexed[layer].index_copy_(2, where, new)

    for write, buffers in ((into_slice, sliced), (by_index_copy, indexed)):
        write(0)
        assert torch.equal(buffers[0][:, :, at:at + 1], new)
    return alternating({"copy into the slice (eager step)": into_slice,
                        "index_copy_ into the buffer (compiled step)": by_index_copy}, repeats, 2 * shape.layers)


def layout(shape: Shape, length: int, repeats: int) -> dict[str, float]:
    b, h, d = shape.batch, shape.heads, shape.head_dim
    keys = [torch.randn(b, h, shape.capacity, d) for _ in range(shape.layers)]
    values = [torch.randn(b, h, shape.capacity, d) for _ in range(shape.layers)]
    packed_k = [k[:, :, :length].contiguous() for k in keys]
    packed_v = [v[:, :, :length].contiguous() for v in values]
    query = torch.randn(b, h, 1, d)
    half_k, half_v, half_q = [k.bfloat16() for k in keys], [v.bfloat16() for v in values], query.bfloat16()
    full = F.scaled_dot_product_attention(query, keys[0][:, :, :length], values[0][:, :, :length])
    assert torch.allclose(full, F.scaled_dot_product_attention(query, packed_k[0], packed_v[0]), atol=1e-5)
    half = F.scaled_dot_product_attention(half_q, half_k[0][:, :, :length], half_v[0][:, :, :length]).float()
    assert torch.allclose(full, half, atol=0.05)
    return alternating({
        "prefix of the pre-allocated buffer":
            lambda i: F.scaled_dot_product_attention(query, keys[i][:, :, :length], values[i][:, :, :length]),
        "packed": lambda i: F.scaled_dot_product_attention(query, packed_k[i], packed_v[i]),
        "prefix, query, keys and values in bfloat16": lambda i: F.scaled_dot_product_attention(
            half_q, half_k[i][:, :, :length], half_v[i][:, :, :length]),
    }, repeats, shape.layers)


def gap(shape: Shape, repeats: int) -> dict[str, float]:
    b, h, d, t = shape.batch, shape.heads, shape.head_dim, shape.gap_length
    buffers = {g: ([torch.randn(b, h, t + g, d) for _ in range(shape.layers)],
                   [torch.randn(b, h, t + g, d) for _ in range(shape.layers)]) for g in shape.gaps}
    query = torch.randn(b, h, 1, d)

    def attend(g: int) -> Callable[[int], object]:
        keys, values = buffers[g]
        return lambda i: F.scaled_dot_product_attention(query, keys[i][:, :, :t], values[i][:, :, :t])

    def repack(i: int) -> torch.Tensor:
        source = buffers[shape.gaps[-1]][0][i]
        packed = source.new_empty((b, h, t + shape.gaps[1], d))
        packed[:, :, :t].copy_(source[:, :, :t])
        return packed

    timings = alternating({f"a gap of {g} positions": attend(g) for g in shape.gaps}, repeats, shape.layers)
    timings[f"re-packing one tensor's {t} positions into a new buffer"] = alternating(
        {"repack": repack}, repeats, shape.layers)["repack"]
    return timings


def merged_chunks(query: torch.Tensor, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the concatenation of `chunks` (keys, values), one flash-attention call per chunk, merged by
    each chunk's log-sum-exp."""
    outs, lses = [], []
    for k, v in chunks:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v)
        outs.append(out)
        lses.append(lse)
    lse = torch.stack(lses)  # [chunks, B, H, 1]
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)  # each chunk's share of the whole softmax
    return (torch.stack(outs) * weights).sum(0)


def chunked(shape: Shape, repeats: int) -> dict[str, float]:
    b, h, d, t = shape.batch, shape.heads, shape.head_dim, shape.chunked_length
    keys = [torch.randn(b, h, shape.capacity, d) for _ in range(shape.layers)]
    values = [torch.randn(b, h, shape.capacity, d) for _ in range(shape.layers)]
    chunks = [[(k[:, :, s:min(s + shape.chunk, t)].contiguous(), v[:, :, s:min(s + shape.chunk, t)].contiguous())
               for s in range(0, t, shape.chunk)] for k, v in zip(keys, values)]
    query = torch.randn(b, h, 1, d)
    assert torch.allclose(merged_chunks(query, chunks[0]),
                          F.scaled_dot_product_attention(query, keys[0][:, :, :t], values[0][:, :, :t]), atol=1e-5)
    return alternating({
        "prefix of the pre-allocated buffer":
            lambda i: F.scaled_dot_product_attention(query, keys[i][:, :, :t], values[i][:, :, :t]),
        f"packed chunks of {shape.chunk}, merged by log-sum-exp": lambda i: merged_chunks(query, chunks[i]),
    }, repeats, shape.layers)


def report(title: str, timings: dict[str, float]) -> None:
    first = next(iter(timings.values()))
    print(title)
    for name, us in timings.items():
        print(f"  {name:55s} {us:9.1f} us  {us / first:5.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls of each variant per layer")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats: checks the command runs")
    args = parser.parse_args(argv)
    shape, repeats = (QUICK, 3) if args.quick else (FULL, args.repeats)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"batch {shape.batch}, {shape.heads} heads of {shape.head_dim}, cache of {shape.capacity} positions, "
          f"{shape.layers} layers' keys and values in turn, float32, {args.threads} threads, torch {torch.__version__}; "
          f"median of {repeats} calls per layer")
    report(f"write one decode step's keys, [{shape.batch}, {shape.heads}, 1, {shape.head_dim}]:",
           cache_write(shape, repeats))
    for length in shape.lengths:
        report(f"attention of one decode query over {length} positions:", layout(shape, length, repeats))
    report(f"attention of one decode query over {shape.gap_length} positions, by the gap after each (row, head):",
           gap(shape, repeats))
    report(f"attention over {shape.chunked_length} positions:", chunked(shape, repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
