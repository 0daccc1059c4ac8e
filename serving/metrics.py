"""Prometheus metrics every server exports on /metrics, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

# (method, padded tokens) of each forward pass a server's model runs: ServiceMetrics.observe_pass
PassObserver = Callable[[str, int], None]


def no_observer(method: str, tokens: int) -> None:
    """A PassObserver that records nothing (a core used without a server)."""

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)


def process_registry() -> CollectorRegistry:
    """A registry of one service's own series, with the process's (process_resident_memory_bytes,
    process_start_time_seconds, open file descriptors, CPU seconds) and python_info beside them, as the
    client library's default registry has them: an operator alerts on memory and sees restarts."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class ServiceMetrics:
    """Request counts by method and status, latency, queue time, batch size, padded tokens per forward pass, queue
    depth.

    Names are prefixed `ppo_<service>_`, e.g. `ppo_critic_requests_total{method="Infer",code="OK"}`.
    """

    def __init__(self, service: str):
        self.registry = process_registry()
        p = f"ppo_{service}"
        self.prefix = p
        self.requests = Counter(f"{p}_requests", "Requests by method and status code", ["method", "code"],
                                registry=self.registry)
        self.latency = Histogram(f"{p}_request_duration_seconds", "Time from request arrival to reply",
                                 ["method"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(f"{p}_queue_duration_seconds", "Time a request waited for the model worker",
                                    ["method"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.compute_time = Histogram(f"{p}_compute_duration_seconds", "Model time per executed batch",
                                      ["method"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram(f"{p}_batch_size", "Rows per executed batch", ["method"],
                                    buckets=_BATCH_BUCKETS, registry=self.registry)
        self.pass_tokens = Histogram(f"{p}_pass_tokens", "Padded tokens (rows x width) of each model forward pass a "
                                     "batch is cut into (by length and batching.max_tokens_per_pass; a critic's "
                                     "Train also by train.micro_batch_size)", ["method"], buckets=_TOKEN_BUCKETS,
                                     registry=self.registry)
        self.queue_depth = Gauge(f"{p}_queue_size", "Requests waiting for the model worker", registry=self.registry)
        self.ready = Gauge(f"{p}_ready", "1 when the model is loaded and the server accepts work",
                           registry=self.registry)

    def certificate_expiry(self, expires: float) -> None:
        """Export when the server's TLS certificate expires (only a server with TLS has the series, so that an alert
        on it never fires for one without)."""
        Gauge(f"{self.prefix}_tls_certificate_expiry_timestamp_seconds", "When the first certificate of the "
              "server's TLS chain expires (seconds since the epoch; tls_cert_file)", registry=self.registry).set(expires)

    def record_request(self, method: str, code: str, seconds: float = 0.0) -> None:
        """Count one finished request by method and status code, and observe its seconds in the latency histogram,
        so that the histogram's count is the requests' (a refusal before the method runs, by the token check, the
        parser or the body limit, takes microseconds and is observed as 0)."""
        self.requests.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)

    def observe_pass(self, method: str, tokens: int) -> None:
        """One forward pass of `method` over `tokens` padded tokens (rows x width)."""
        self.pass_tokens.labels(method).observe(tokens)
