"""Operational figures of the servers, measured on this machine: start-up, shutdown and restart times, and a load
test of concurrent clients that must see zero failures.

    python -m bench.reliability [--clients 32] [--requests 20] [--repeats 3]

Everything runs on loopback against `python -m critic_server` / `python -m reward_server` processes started the
way the tests start them. Prints one table; docs/RELIABILITY.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ppo_services.v1 import critic_pb2, critic_pb2_grpc, reward_pb2, reward_pb2_grpc
from serving.codec import encode
from tests.service_procs import ServiceProcess


def timed_start(name: str, *args: str, log_dir: Path, **kw) -> tuple[ServiceProcess, float]:
    start = time.monotonic()
    proc = ServiceProcess(name, *args, log_dir=log_dir, **kw).start()
    return proc, time.monotonic() - start


def timed_stop(proc: ServiceProcess) -> float:
    start = time.monotonic()
    code = proc.terminate(60)
    assert code == 0, proc.log()[-2000:]
    return time.monotonic() - start


def load_test(address: str, kind: str, clients: int, requests: int) -> tuple[int, int, list[float], float]:
    """`clients` threads, each with its own channel, send `requests` calls each. Returns (ok, failed, latencies, s)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 40, (8, 48), generator=g)
    lengths = torch.full((8,), 48)
    if kind == "critic":
        request = critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths))
    else:
        request = reward_pb2.ScoreRequest(tokens=encode(tokens), lengths=encode(lengths))
    ok, failed, latencies = [0], [0], []
    lock = threading.Lock()

    def client() -> None:
        with grpc.insecure_channel(address) as ch:
            stub = critic_pb2_grpc.CriticServiceStub(ch) if kind == "critic" else reward_pb2_grpc.RewardServiceStub(ch)
            call = stub.Infer if kind == "critic" else stub.Score
            for _ in range(requests):
                t = time.monotonic()
                try:
                    call(request, timeout=120)
                    with lock:
                        ok[0] += 1
                        latencies.append(time.monotonic() - t)
                except grpc.RpcError:
                    with lock:
                        failed[0] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return ok[0], failed[0], latencies, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from embedded import ensure_built

    ensure_built()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        starts, stops = [], []
        for i in range(args.repeats):
            proc, t = timed_start("critic", "--checkpoint-dir", str(logs / f"ck{i}"), log_dir=logs)
            starts.append(t)
            stops.append(timed_stop(proc))
        rows.append(("critic start to /ready (embedded model)", statistics.median(starts), "s"))
        rows.append(("critic SIGTERM to exit, idle", statistics.median(stops), "s"))

        ck = logs / "ck-resume"
        proc, _ = timed_start("critic", "--checkpoint-dir", str(ck), "autosave_every=1", log_dir=logs)
        with grpc.insecure_channel(proc.address) as ch:
            stub = critic_pb2_grpc.CriticServiceStub(ch)
            tokens = torch.randint(4, 40, (16, 32), generator=torch.Generator().manual_seed(1))
            request = critic_pb2.TrainRequest(tokens=encode(tokens), returns=encode(torch.ones(16, 31)),
                                              old_values=encode(torch.zeros(16, 31)), mask=encode(torch.ones(16, 31)))
            for step in range(3):
                request.request_id = f"bench/{step}/0"
                stub.Train(request, timeout=120)
        rows.append(("critic SIGTERM to exit, with its exit checkpoint", timed_stop(proc), "s"))
        proc, t = timed_start("critic", "--checkpoint-dir", str(ck), "autosave_every=1", log_dir=logs)
        rows.append(("critic restart to /ready, resuming its latest checkpoint", t, "s"))
        proc.terminate(60)

        for kind in ("critic", "reward"):
            extra = ("--checkpoint-dir", str(logs / "ck-load")) if kind == "critic" else ()
            with ServiceProcess(kind, *extra, log_dir=logs) as server:
                ok, failed, lat, wall = load_test(server.address, kind, args.clients, args.requests)
            lat.sort()
            method = "Infer" if kind == "critic" else "Score"
            rows.append((f"{kind} {method}: {args.clients} clients x {args.requests} requests (8 x 48 tokens): failed",
                         failed, f"of {ok + failed}"))
            rows.append((f"{kind} {method}: throughput", ok / wall, "requests/s"))
            p50, p99 = lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99) - 1] * 1000
            rows.append((f"{kind} {method}: latency p50 / p99", f"{p50:.0f} / {p99:.0f}", "ms"))

    import os

    print(f"{len(os.sched_getaffinity(0))} CPU cores, no GPU; `python -m bench.reliability --clients {args.clients} "
          f"--requests {args.requests} --repeats {args.repeats}`\n")
    print("| figure | value | unit |\n|---|---|---|")
    for name, value, unit in rows:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"| {name} | {shown} | {unit} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
