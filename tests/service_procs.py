"""Start the real services as subprocesses, with the same `python -m` commands docker-compose.yml runs.

The compose test compares docker-compose.yml against COMMANDS and PORTS below, so what the tests run and
what the containers run cannot drift apart.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Self

import httpx
from prometheus_client.parser import text_string_to_metric_families

from actor.demo import NotReady, wait_ready

ROOT = Path(__file__).resolve().parent.parent

# Test servers take ports from 15000-31999, below the kernel's usual ephemeral range (32768-60999), so no client
# connection's local port takes one between the check below and the server's bind. Under pytest-xdist each worker
# owns a block of its own, so two workers never name the same port.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_BLOCK = (32000 - 15000) // _WORKERS
_next_port = iter(range(15000 + _WORKER * _BLOCK, 15000 + (_WORKER + 1) * _BLOCK))


def free_port() -> int:
    """A loopback port free now and never handed out before in this test session, by any worker."""
    for port in _next_port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port left in this worker's block of {_BLOCK}")


# Default ports of each service: (gRPC, HTTP). The actor has no gRPC port.
PORTS = {"critic": (5555, 8001), "reward": (5556, 8002), "actor": (None, 8000)}


def service_args(name: str, grpc_port: int | None, http_port: int) -> list[str]:
    """Arguments after `python` that start service `name` on the given ports (loopback host)."""
    module = {"critic": "critic_server", "reward": "reward_server", "actor": "actor"}[name]
    args = ["-m", module]
    if grpc_port is not None:
        args += ["--port", str(grpc_port)]
    return args + ["--http-port", str(http_port)]


def actor_command(config: str, run_dir, *overrides: str, http_port: int = 0, reward_curve: bool = False) -> list[str]:
    """`python -m actor` on configs/<config>.yaml writing into `run_dir`, with `overrides` after. Unless
    `reward_curve`, the run skips drawing reward_curve.png at its end (logger.reward_curve_enabled=false): importing
    matplotlib costs each run most of a second of CPU, and the suite runs about 50 actors; test_end_to_end and the demo test check the
    default, which draws it."""
    return [sys.executable, *service_args("actor", None, http_port), "--config", str(ROOT / "configs" / f"{config}.yaml"),
            f"run_dir={run_dir}", *([] if reward_curve else ["logger.reward_curve_enabled=false"]), *overrides]


class ServiceProcess:
    """A service started as `python -m ...`; waits for /ready, stops with SIGTERM."""

    def __init__(self, name: str, *extra: str, log_dir: Path, env: dict[str, str] | None = None,
                 grpc_port: int | None = None, http_port: int | None = None, ready_scheme: str = "http",
                 ready_verify: str | bool = True, preexec_fn: Callable[[], None] | None = None):
        self.name = name
        self.grpc_port = (grpc_port or free_port()) if PORTS[name][0] is not None else None
        self.http_port = http_port or free_port()
        self.argv = [sys.executable, *service_args(name, self.grpc_port, self.http_port), *extra]
        self.log_path = log_dir / f"{name}-{self.http_port}.log"
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc: subprocess.Popen | None = None
        self.scheme, self.verify = ready_scheme, ready_verify  # https + a CA bundle for a server with TLS
        self.preexec_fn = preexec_fn  # run in the child before it starts (resource limits)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}"

    def start(self, ready_timeout: float = 180.0, wait: bool = True) -> ServiceProcess:
        """Start the process and wait for /ready; `wait=False` returns at once (a client waits for it instead)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - held open for the process lifetime
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=self.preexec_fn)  # noqa: PLW1509 - resource limits only
        if not wait:
            return self
        try:
            wait_ready(self.proc, f"{self.http}/ready", ready_timeout, self.tls_context())
        except NotReady as e:
            self.stop()  # one that timed out is still running
            raise RuntimeError(f"{self.name} {e}:\n{self.log()}") from None
        return self

    def tls_context(self) -> ssl.SSLContext | bool:
        """What httpx verifies this server's HTTPS with: the CA bundle given as ready_verify, or the default; False
        over plain HTTP, where there is nothing to verify (httpx would load the system's CA bundle for each request
        otherwise, about 20 ms of CPU per poll)."""
        if self.scheme == "http":
            return False
        return ssl.create_default_context(cafile=self.verify) if isinstance(self.verify, str) else self.verify

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def histogram_stats(proc: ServiceProcess, name: str, method: str) -> tuple[float, float]:
    """(observations, their sum) of histogram `name` (e.g. ppo_critic_pass_tokens) for `method` on `proc`'s /metrics."""
    text = httpx.get(f"{proc.http}/metrics", verify=proc.tls_context()).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name.startswith(name) and s.labels.get("method") == method}
    return values.get(f"{name}_count", 0.0), values.get(f"{name}_sum", 0.0)
