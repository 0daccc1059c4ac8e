"""Is the service split free? The critic served over loopback gRPC against the same model in process, the tensor
codec's speed, and what dynamic batching gains, measured on this machine in one run against the targets of the issue.

    python -m bench.service_split [--rounds 7] [--seconds 3] [--queue-delay-ms MS] [--in-flight 2] [--quick]

1. Remote Infer vs in-process forward. A Llama-style critic (hidden 256, 6 layers, 8 heads, MLP 768, vocab 100, a
   one-label `score` head: what `critic_server` loads) is built into a temporary directory and served by
   `python -m critic_server --port P ... --model DIR num_threads=2`, started as tests/service_procs.py starts it. This
   process loads the same checkpoint with torch.set_num_threads(2). Rounds alternate: the forward of 64 x 272 tokens
   in process (the servers idle), in the passes the server cuts it into (its default batching: at most 64 rows and
   2048 tokens a pass) and through linear weights packed once, as the server keeps them packed between Trains (its
   default prepack_weights, on a CPU in float32), then an Infer of the same batch with the actor's client
   (actor.clients.CriticClient).
   Target: median of the per-round ratios remote / in-process <= 1.05; the values must agree too. The same forward
   takes from 10% less to 15% more time in one process than in another here (its activations take 200,000-450,000
   page faults, and how many depends on the state of the process's heap), so the table also gives the split's own
   cost: the remote time less the server's forward (its compute-time metric), as a fraction of the in-process
   forward, with the same 5% as target.
2. The tensor codec: encode, SerializeToString, FromString and decode of float32 [64, 272] and [512, 4096], in this
   process after the rest. Target: >= 1 GB/s (tensor bytes / median round-trip time).
3. Dynamic batching. 8 client threads, each with a CriticClient of its own, send Infer requests back to back for
   --seconds to the server above (default batching, or batching.max_queue_delay_ms=MS with --queue-delay-ms) and to
   one started with batching.max_batch_size=1 (one request per forward pass: batching off); rounds alternate. Each
   round also gives the CPU time a request took in the server process and in this one (the clients), and from the
   server's /metrics the wall time per batch against the part of it its model worker computed. Target: median
   throughput ratio >= 3. Two workloads: requests of 1 row x 272 tokens (the issue's example) and of 1 x 16 (small
   enough that per-pass overhead, which is what batching saves, dominates). Each comes with the most batching could gain on it, measured in process: 8 forward
   passes of one request against 8 rows in the server's passes (8 x 272 tokens are two: 7 rows and 1); a gain
   below 3x there cannot reach the target. Then, without a target, the same gain when each client keeps
   --in-flight requests outstanding (default 2; up to 3 rounds): a caller that waits for each reply leaves the model
   idle while the replies go out and the next requests come in, one that pipelines does not.

--quick: a tiny model and short rounds, to check that the command runs (tests/test_bench_service_split.py); its
figures say nothing. The exit status is 1 when a target is missed (never with --quick).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actor.clients import CriticClient
from actor.config import RemoteConfig
from ppo_services.v1 import common_pb2
from serving.codec import decode, encode, retain_freed_memory
from serving.modeling import by_length, load_scalar_head_model, per_token_scores
from serving.prepack import KeptPacking, prepacks_passes
from serving.server_config import BatchingConfig, ServerConfig
from tests.service_procs import ServiceProcess, histogram_stats

THREADS = 2  # torch threads, in this process and on each server (num_threads)
CLIENTS = 8


@dataclass(frozen=True)
class Size:
    """Model and workload shapes of a run."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    batch: tuple[int, int]  # rows x tokens of the remote-vs-in-process Infer
    requests: tuple[tuple[int, int], ...]  # rows x tokens of each batching client's request, one workload each
    codec_shapes: tuple[tuple[int, ...], ...]


FULL = Size(256, 6, 8, 768, (64, 272), ((1, 272), (1, 16)), ((64, 272), (512, 4096)))
QUICK = Size(64, 2, 4, 128, (8, 64), ((1, 64), (1, 16)), ((64, 272), (64, 512)))
VOCAB = 100
MAX_POSITIONS = 512


def build_critic(path: Path, size: Size) -> Path:
    """A randomly initialised LlamaForSequenceClassification (num_labels=1) and a word-level tokenizer of VOCAB
    tokens, saved as a checkpoint directory that `critic_server --model` loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate([*specials, *(f"w{i}" for i in range(VOCAB - len(specials)))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<bos>", eos_token="<eos>", model_max_length=MAX_POSITIONS,
                                        padding_side="right")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=size.hidden, intermediate_size=size.intermediate,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
                         max_position_embeddings=MAX_POSITIONS, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                         tie_word_embeddings=False, num_labels=1)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def batch_of(rows: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-length rows (no padding, so the server's length bucketing cannot shorten them): tokens, lengths."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (rows, tokens), generator=g), torch.full((rows,), tokens)


# --- 2. the codec -------------------------------------------------------------------------------------------
def codec_rate(shape: tuple[int, ...], seconds: float) -> tuple[float, int]:
    """(GB/s of tensor bytes at the median round trip, round trips timed): encode -> SerializeToString ->
    FromString -> decode, each round trip's result kept until the next one replaces it, as a caller would."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    times: list[float] = []
    back = None
    for _ in range(3):  # warm up
        back = decode(common_pb2.Tensor.FromString(encode(t).SerializeToString()), "x")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        wire = encode(t).SerializeToString()
        back = decode(common_pb2.Tensor.FromString(wire), "x")
        times.append(time.perf_counter() - start)
    assert back is not None and torch.equal(back, t)
    return t.numel() * t.element_size() / statistics.median(times) / 1e9, len(times)


# --- 1. remote vs in process ----------------------------------------------------------------------------------
def server_compute_seconds(server: ServiceProcess) -> float:
    """Seconds the server's model thread has spent on Infer batches so far, from its /metrics."""
    return histogram_stats(server, "ppo_critic_compute_duration_seconds", "Infer")[1]


SERVER_PASSES = BatchingConfig()  # how the critic server (default batching) cuts a batch into forward passes
# whether its Infer passes compute through prepacked weights (its default prepack_weights, on a CPU in float32)
SERVER_PREPACKS = prepacks_passes("prepack_weights", ServerConfig.model_fields["prepack_weights"].default,
                                  torch.device("cpu"), torch.float32, "the in-process Infer")


def forward_seconds(model, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The forward in process, in the passes the server cuts the same rows into (at most max_batch_size rows and
    max_tokens_per_pass tokens each): the same work on both sides, so the comparison prices the split alone."""
    with torch.inference_mode():
        start = time.perf_counter()
        values = by_length(lambda t, n: per_token_scores(model, t, n), tokens, lengths,
                           SERVER_PASSES.max_batch_size, max_tokens=SERVER_PASSES.max_tokens_per_pass)
        return time.perf_counter() - start, values


def infer_seconds(client: CriticClient, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    values, _ = client.infer(tokens, lengths).result()
    return time.perf_counter() - start, values


# --- 3. batching ------------------------------------------------------------------------------------------------
def batch_stats(server: ServiceProcess) -> tuple[float, float, float, float, float]:
    """What the server's model worker has done for Infer so far, from its /metrics: (rows, batches, seconds of
    batches computing, requests, seconds requests waited in its queue)."""
    batches, rows = histogram_stats(server, "ppo_critic_batch_size", "Infer")
    _, compute_s = histogram_stats(server, "ppo_critic_compute_duration_seconds", "Infer")
    queued, queue_s = histogram_stats(server, "ppo_critic_queue_duration_seconds", "Infer")
    return rows, batches, compute_s, queued, queue_s


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc; 0.0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Throughput:
    rate: float  # requests per second
    rows_per_batch: float  # mean rows the server ran per batch
    server_cpu: float  # the server process's CPU seconds per request (every thread of it, both torch threads)
    client_cpu: float  # this process's CPU seconds per request (the client threads' encoding, gRPC and decoding)
    batch_s: float  # wall seconds per batch: wall time / batches
    compute_s: float  # of which the server's model worker computed (merge, forward passes, split), per batch
    queue_s: float  # seconds a request waited in the server's queue for its batch to start, mean


def throughput(server: ServiceProcess, clients: list[CriticClient], request: tuple[torch.Tensor, torch.Tensor],
               seconds: float, in_flight: int = 1) -> Throughput:
    """len(clients) threads send `request` back to back for `seconds` (each at least once), counting every request
    sent and the time until the last reply. Each client keeps `in_flight` requests outstanding: it sends the next
    when the oldest is answered (1: it waits for each reply before it sends again)."""
    before = batch_stats(server)
    done = [0] * len(clients)
    errors: list[BaseException] = []
    go = threading.Barrier(len(clients) + 1)
    stop_at = [0.0]

    def client_loop(i: int) -> None:
        go.wait()
        try:
            outstanding = collections.deque(clients[i].infer(*request) for _ in range(in_flight))
            while outstanding:
                outstanding.popleft().result()
                done[i] += 1
                if time.perf_counter() < stop_at[0]:
                    outstanding.append(clients[i].infer(*request))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(len(clients))]
    for th in threads:
        th.start()
    server_cpu, client_cpu = process_cpu_seconds(server.proc.pid), time.process_time()
    start = time.perf_counter()
    stop_at[0] = start + seconds
    go.wait()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    server_cpu, client_cpu = process_cpu_seconds(server.proc.pid) - server_cpu, time.process_time() - client_cpu
    if errors:
        raise RuntimeError(f"a batching client failed: {errors[0]}")
    rows, batches, compute_s, queued, queue_s = (b - a for a, b in zip(before, batch_stats(server), strict=True))
    n, batches = sum(done), max(batches, 1)
    return Throughput(n / wall, rows / batches, server_cpu / n, client_cpu / n, wall / batches, compute_s / batches,
                      queue_s / max(queued, 1))


def batching_rows(model, on: ServiceProcess, off: ServiceProcess, request: tuple[int, int], rounds: int,
                  seconds: float, max_batch_size: int, queue_delay_ms: float,
                  in_flight: int) -> list[tuple[str, str, str, str | None]]:
    """The batching gain for CLIENTS clients sending `request` (rows x tokens), and for scale the most it can be:
    CLIENTS forward passes of one request against one pass of all of them, in process. With `in_flight` above 1, also
    the gain when each client keeps that many requests outstanding (up to 3 rounds; no target)."""
    rb, rs = request
    single = batch_of(rb, rs, seed=2)
    merged = batch_of(CLIENTS * rb, rs, seed=2)
    forward_seconds(model, *merged)
    t_single = statistics.median(forward_seconds(model, *single)[0] for _ in range(5 * rounds))
    t_merged = statistics.median(forward_seconds(model, *merged)[0] for _ in range(3 * rounds))
    ceiling = CLIENTS * t_single / t_merged
    what = f"{CLIENTS} clients x ({rb} x {rs})"
    print(f"Infer throughput, {what}, batching on / off (at most {ceiling:.2f}x):", flush=True)
    clients = {p: [CriticClient(RemoteConfig(address=p.address)) for _ in range(CLIENTS)] for p in (on, off)}
    try:
        for p in (on, off):  # connect and warm up
            throughput(p, clients[p], single, 0.0)
        gains: list[float] = []
        runs: dict[ServiceProcess, list[Throughput]] = {on: [], off: []}
        pipelined: list[tuple[Throughput, Throughput]] = []  # (on, off) with in_flight requests a client
        for r in range(rounds):
            for p in (on, off):
                runs[p].append(throughput(p, clients[p], single, seconds))
            a, b = runs[on][-1], runs[off][-1]
            gains.append(a.rate / b.rate)
            print(f"  round {r + 1}: on {a.rate:7.1f} req/s ({a.rows_per_batch:.1f} rows per batch; CPU a request: "
                  f"server {a.server_cpu * 1000:.2f} ms, clients {a.client_cpu * 1000:.2f} ms), off {b.rate:7.1f} req/s "
                  f"(server {b.server_cpu * 1000:.2f} ms, clients {b.client_cpu * 1000:.2f} ms), gain {gains[-1]:.2f}x",
                  flush=True)
            print(f"           a batch every {a.batch_s * 1000:.1f} ms on, of which {a.compute_s * 1000:.1f} computing "
                  f"(queue wait {a.queue_s * 1000:.2f} ms a request); off: every {b.batch_s * 1000:.1f} ms, "
                  f"{b.compute_s * 1000:.1f} computing", flush=True)
        for r in range(min(rounds, 3) if in_flight > 1 else 0):
            a, b = (throughput(p, clients[p], single, seconds, in_flight) for p in (on, off))
            pipelined.append((a, b))
            print(f"  {in_flight} in flight a client, round {r + 1}: on {a.rate:7.1f} req/s ({a.rows_per_batch:.1f} rows "
                  f"per batch), off {b.rate:7.1f} req/s, gain {a.rate / b.rate:.2f}x", flush=True)
    finally:
        for p in (on, off):
            for c in clients[p]:
                c.close()
    gain = statistics.median(gains)

    def median(p: ServiceProcess, field: str) -> float:
        return statistics.median(getattr(t, field) for t in runs[p])

    def cpu(p: ServiceProcess) -> str:
        return (f"CPU a request: server {median(p, 'server_cpu') * 1000:.2f} ms, clients "
                f"{median(p, 'client_cpu') * 1000:.2f} ms")

    on_batch, on_compute = median(on, "batch_s"), median(on, "compute_s")
    verdict = "pass" if gain >= 3.0 else ("FAIL" if ceiling >= 3.0 else f"FAIL (at most {ceiling:.2f}x possible)")
    ceiling_name = (f"in process, {what}: {CLIENTS} forward passes of {rb} x {rs} / {CLIENTS * rb} x {rs} in the "
                    f"server's passes (the most batching can gain)")
    on_name = (f"Infer throughput, {what}, batching on (max_batch_size {max_batch_size}, max_queue_delay_ms "
               f"{queue_delay_ms:g}; {median(on, 'rows_per_batch'):.1f} rows per batch; {cpu(on)})")
    rows = [
        (ceiling_name, f"{ceiling:.2f}x ({CLIENTS} x {t_single * 1000:.1f} ms / {t_merged * 1000:.1f} ms)", "", None),
        (on_name, f"{median(on, 'rate'):.1f} req/s", "", None),
        (f"Infer throughput, {what}, batching off (batching.max_batch_size=1; {cpu(off)})",
         f"{median(off, 'rate'):.1f} req/s", "", None),
        ((f"batching on, {what}: wall time a batch / the server's compute time in it (merge, passes, split; its "
          "/metrics; the rest is the replies, the clients' next requests and the batch forming)"),
         f"{on_batch * 1000:.1f} / {on_compute * 1000:.1f} ms", "", None),
        (f"Infer throughput gain of batching, {what} (median of {rounds} rounds of {seconds:g} s)", f"{gain:.2f}x",
         ">= 3x", verdict),
    ]
    if pipelined:
        rate_on = statistics.median(a.rate for a, _ in pipelined)
        rate_off = statistics.median(b.rate for _, b in pipelined)
        rows_on = statistics.median(a.rows_per_batch for a, _ in pipelined)
        gain_pipelined = statistics.median(a.rate / b.rate for a, b in pipelined)
        name = (f"Infer throughput gain of batching, {what}, each client keeping {in_flight} requests in flight "
                f"(median of {len(pipelined)} rounds of {seconds:g} s; {rows_on:.1f} rows per batch)")
        rows.append((name, f"{gain_pipelined:.2f}x ({rate_on:.1f} / {rate_off:.1f} req/s)", "", None))
    return rows


def start_servers(model: Path, work: Path, queue_delay_ms: float | None) -> tuple[ServiceProcess, ServiceProcess]:
    """The critic with default batching (or another max_queue_delay_ms) and one with batching off, started
    together."""
    common = ("--model", str(model), f"num_threads={THREADS}", "resume=never")  # flags first, then key=value
    delay = () if queue_delay_ms is None else (f"batching.max_queue_delay_ms={queue_delay_ms:g}",)
    on = ServiceProcess("critic", "--checkpoint-dir", str(work / "ck-on"), *common, *delay, log_dir=work)
    off = ServiceProcess("critic", "--checkpoint-dir", str(work / "ck-off"), *common, "batching.max_batch_size=1",
                         log_dir=work)
    errors: list[BaseException] = []

    def start(p: ServiceProcess) -> None:
        try:
            p.start()
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(p,)) for p in (on, off)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        on.stop()
        off.stop()
        raise errors[0]
    return on, off


def passed(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    retains_freed_memory = retain_freed_memory()  # as every service process does at start
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of each comparison")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each batching round")
    parser.add_argument("--queue-delay-ms", type=float, default=None,
                        help="batching.max_queue_delay_ms of the server with batching on (default: the server's default)")
    parser.add_argument("--in-flight", type=int, default=2,
                        help="also measure batching with each client keeping this many requests outstanding (up to 3 "
                        "rounds; no target); 1 or 0 leaves it out")
    parser.add_argument("--quick", action="store_true", help="tiny model, one short round: checks that it runs")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    queue_delay = SERVER_PASSES.max_queue_delay_ms if args.queue_delay_ms is None else args.queue_delay_ms
    rounds = 1 if args.quick else args.rounds
    seconds = 0.5 if args.quick else args.seconds
    torch.set_num_threads(THREADS)
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    rows: list[tuple[str, str, str, str | None]] = []  # measurement, value, target, verdict (None: no target)

    with tempfile.TemporaryDirectory(prefix="service-split-") as tmp:
        work = Path(tmp)
        model_dir = build_critic(work / "critic", size)
        print("starting the critic servers ...", flush=True)
        on, off = start_servers(model_dir, work, args.queue_delay_ms)
        try:
            model = load_scalar_head_model(str(model_dir)).eval()
            packing = KeptPacking(model, SERVER_PASSES.max_tokens_per_pass, SERVER_PREPACKS)
            with torch.inference_mode():  # its linear weights packed once, as the servers keep theirs
                packing.pack()
            client = CriticClient(RemoteConfig(address=on.address))
            info = client.info()
            tokens, lengths = batch_of(*size.batch, seed=1)
            forward_seconds(model, tokens, lengths)  # warm up both sides
            infer_seconds(client, tokens, lengths)

            b, s = size.batch
            print(f"remote Infer vs in-process forward, {b} x {s} tokens:", flush=True)
            ratios, local_times, remote_times, server_times, split_costs = [], [], [], [], []
            max_diff = 0.0
            for r in range(rounds):
                t_local, v_local = forward_seconds(model, tokens, lengths)
                computed = server_compute_seconds(on)
                t_remote, v_remote = infer_seconds(client, tokens, lengths)
                t_server = server_compute_seconds(on) - computed  # its model thread's time
                max_diff = max(max_diff, float((v_local - v_remote).abs().max()))
                local_times.append(t_local)
                remote_times.append(t_remote)
                server_times.append(t_server)
                split_costs.append((t_remote - t_server) / t_local)
                ratios.append(t_remote / t_local)
                print(f"  round {r + 1}: in process {t_local * 1000:8.1f} ms, remote {t_remote * 1000:8.1f} ms "
                      f"(the server's forward {t_server * 1000:8.1f} ms), ratio {ratios[-1]:.3f}", flush=True)
            ratio = statistics.median(ratios)
            split_cost = statistics.median(split_costs)
            rows.append((f"critic Infer {b} x {s}: in-process forward (median of {rounds})",
                         f"{statistics.median(local_times) * 1000:.1f} ms", "", None))
            rows.append((f"critic Infer {b} x {s}: remote over loopback gRPC (median of {rounds})",
                         f"{statistics.median(remote_times) * 1000:.1f} ms", "", None))
            rows.append((f"critic Infer {b} x {s}: the server's forward within it (its compute-time metric)",
                         f"{statistics.median(server_times) * 1000:.1f} ms", "", None))
            rows.append((f"critic Infer {b} x {s}: remote / in-process (median of the per-round ratios)",
                         f"{ratio:.3f}x", "<= 1.05x", passed(ratio <= 1.05)))
            cost_name = f"critic Infer {b} x {s}: the split's own cost, (remote - the server's forward) / in-process forward"
            rows.append((f"{cost_name} (median)", f"{split_cost:.2%}", "<= 5%", passed(split_cost <= 0.05)))
            rows.append((f"critic Infer {b} x {s}: remote values vs in-process, largest difference", f"{max_diff:.1e}",
                         "<= 1e-4", passed(max_diff <= 1e-4)))

            for rb, rs in size.requests:
                rows += batching_rows(model, on, off, (rb, rs), rounds, seconds, info.max_batch_size, queue_delay,
                                      args.in_flight)
            client.close()
        finally:
            stoppers = [threading.Thread(target=p.stop) for p in (on, off)]
            for th in stoppers:
                th.start()
            for th in stoppers:
                th.join()

    # After the model work, so that the in-process forwards run in a process that has done nothing else yet, as the
    # server's do (the heap this leaves behind changes how many page faults a forward takes).
    print("codec round trips ...", flush=True)
    for i, shape in enumerate(size.codec_shapes):
        rate, n = codec_rate(shape, 0.5 if args.quick else 3.0)
        rows.insert(i, (f"codec round trip, float32 {list(shape)} (encode, serialize, parse, decode; median of {n})",
                        f"{rate:.2f} GB/s", ">= 1 GB/s", passed(rate >= 1.0)))

    load_end = os.getloadavg()[0]
    command = "python -m bench.service_split" + (" --quick" if args.quick else f" --rounds {rounds} --seconds {seconds:g}")
    if args.queue_delay_ms is not None:
        command += f" --queue-delay-ms {args.queue_delay_ms:g}"
    if args.in_flight != 2:
        command += f" --in-flight {args.in_flight}"
    print(f"\n`{command}`: {os.cpu_count()} CPU cores ({len(os.sched_getaffinity(0))} usable), no GPU used; torch "
          f"{torch.__version__} with {THREADS} threads in process and num_threads={THREADS} on each server; "
          f"{CLIENTS} batching clients; glibc malloc thresholds {'raised' if retains_freed_memory else 'default'} "
          f"(serving.codec); 1-minute load average {load_start:.2f} at start, {load_end:.2f} at end; "
          f"{time.monotonic() - started:.0f} s"
          + ("\n--quick: a tiny model and single short rounds; the figures say nothing" if args.quick else "") + "\n")
    print("| measurement | value | target | pass/fail |\n|---|---|---|---|")
    for name, value, target, verdict in rows:
        print(f"| {name} | {value} | {target} | {verdict or ''} |")
    missed = [name for name, _, _, verdict in rows if verdict and verdict != "pass"]
    if missed and not args.quick:
        print(f"\n{len(missed)} target(s) missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
