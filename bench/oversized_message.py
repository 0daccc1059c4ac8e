"""Memory of a critic before and after oversized junk messages: they are refused by gRPC (RESOURCE_EXHAUSTED, the
message is beyond the receive limit that follows from the model's max length), so its memory must stay flat.

    python -m bench.oversized_message [--size-mb 256] [--times 3] [critic key=value ...]

Starts `python -m critic_server` on the embedded default (loopback, free ports; trailing arguments are passed to
it), prints its resident memory (VmRSS) before and after each message, the status each message got, and the growth.
`max_request_rows=10000000` lifts the receive limit to max_message_mb (1 GiB), as before it followed the model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import grpc

from serving.wire import grpc_options
from tests.service_procs import ServiceProcess

INFER = "/ppo_services.v1.CriticService/Infer"


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (Linux: /proc/<pid>/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def send_junk(address: str, size_mb: int) -> tuple[grpc.StatusCode, str]:
    """Send `size_mb` MiB of bytes that are no message to the critic's Infer; returns (status code, details)."""
    with grpc.insecure_channel(address, options=grpc_options(max(size_mb + 1, 4))) as ch:
        call = ch.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        try:
            call(b"\xff" * (size_mb * 1024 * 1024), timeout=120)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def measure(address: str, pid: int, size_mb: int, times: int, settle_s: float = 0.5) -> list[float]:
    """RSS (MiB) before and after each of `times` junk messages of `size_mb` MiB; prints each step."""
    rss = [rss_mib(pid)]
    print(f"critic RSS before: {rss[0]:.1f} MiB", flush=True)
    for i in range(times):
        code, details = send_junk(address, size_mb)
        time.sleep(settle_s)
        rss.append(rss_mib(pid))
        print(f"{size_mb} MiB junk #{i + 1}: {code.name} ({details[:80]}); RSS {rss[-1]:.1f} MiB", flush=True)
    return rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--times", type=int, default=3)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="critic config overrides")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, ServiceProcess("critic", "--checkpoint-dir", f"{tmp}/ckpt",
                                                              *args.overrides, log_dir=Path(tmp)) as critic:
        assert critic.proc is not None
        rss = measure(critic.address, critic.proc.pid, args.size_mb, args.times)
        print(f"growth after {args.times} x {args.size_mb} MiB: {rss[-1] - rss[0]:+.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
