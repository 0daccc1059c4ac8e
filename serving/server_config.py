"""Settings every server shares, in a module without torch: `python -m critic_server` and `python -m
reward_server` validate their config before the heavy imports, so a config error answers at once."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from .config import (
    MAX_GRPC_MS_S,
    MAX_MESSAGE_MB,
    MAX_QUEUE_DELAY_MS,
    MAX_THREADS,
    MAX_TIMEOUT_S,
    DeviceSpec,
    StrictModel,
    not_blank,
)
from .security import SecurityConfig


class BatchingConfig(StrictModel):
    """Dynamic batching of concurrent inference requests."""

    max_batch_size: int = Field(64, ge=1, description="Most rows merged from concurrent requests into one batch, "
                                "and into one forward pass.")
    max_tokens_per_pass: int = Field(
        2048, ge=0, description="Most tokens in one forward pass, counted padded (its rows x its longest row): a batch's "
        "rows are sorted by length and cut into passes of at most max_batch_size rows and this many tokens, so long "
        "rows go few to a pass and short ones many (a row longer than this gets a pass of its own); on a CPU such "
        "passes ran faster than one pass of the whole batch (docs/PERFORMANCE.md). On a GPU, where small models' "
        "passes are bound by launching kernels, fewer and larger passes may pay (not measured). 0: rows only. "
        "Each pass's padded tokens are on /metrics (ppo_<service>_pass_tokens, by method).")
    max_queue_delay_ms: float = Field(
        10.0, ge=0, le=MAX_QUEUE_DELAY_MS, description="Longest a partial batch waits for more rows (at most a minute). It waits only while fewer requests of its "
        "method are in it than were in the server at once since that method's last batch (callers that call back to "
        "back, whose next requests follow the replies just sent) and closes as soon as they are in; a lone caller never "
        "waits. 0: take only what is queued. Callers that keep two or more requests in flight keep the model busy while "
        "replies and new requests cross, where callers that wait for each reply leave it idle then (docs/PERFORMANCE.md, "
        "\"The service split\").")
    max_queue_size: int = Field(1024, ge=1, description="Queued requests beyond which new ones get RESOURCE_EXHAUSTED.")


class ServerConfig(SecurityConfig):
    """Network, security and lifecycle settings every server shares."""

    host: Annotated[str, not_blank("a host name or address, e.g. 127.0.0.1, or 0.0.0.0 for every interface")] = Field(
        "127.0.0.1", description="Interface to listen on; containers pass 0.0.0.0.")
    port: int = Field(..., ge=0, le=65535, description="gRPC port.")
    http_port: int = Field(..., ge=0, le=65535, description="REST port for /health, /ready, /metrics.")
    max_message_mb: int = Field(
        1024, ge=4, le=MAX_MESSAGE_MB, description="gRPC send limit in MiB (gRPC's own limit is 2 GiB - 1 B), and the most the receive limit may be (512 x 4096 tokens fit). "
        "The receive limit is min(max_message_mb MiB, max(4 MiB, 2 x max_request_rows x max_length x 32 B + 1 MiB)), "
        "where max_length is the model's (read from its config before the weights load; unknown or unlimited, as for a "
        "rule scorer or a model with ALiBi positions, gives max_message_mb) and 32 B is the largest encoding of one token (int64 token + three float64 "
        "per-action values); a larger message gets RESOURCE_EXHAUSTED from gRPC before it is buffered.")
    max_request_rows: int = Field(
        4096, ge=1, description="Rows of max_length tokens one request may carry (a Train carries the whole "
        "rollout); sets the gRPC receive limit (see max_message_mb). Rows of shorter sequences fit in proportion; a "
        "request of more tokens (or, without a max length, more rows) is INVALID_ARGUMENT.")
    grace_period_s: float = Field(30.0, ge=0, le=MAX_TIMEOUT_S, description="How long in-flight work may take after SIGTERM.")
    http_read_timeout_s: float = Field(
        30.0, gt=0, le=MAX_GRPC_MS_S, allow_inf_nan=False, description="How long a REST client may take to send a whole request (head "
        "and body), counted from its connection's opening or its last response, plus one second for every 64 KiB it "
        "sends (a large body arrives at any average rate above that), and how long it may fall silent within one; "
        "past either the connection is closed. A client that leaves the server's writes blocked (its replies unread) "
        "for as long is dropped, and so is one (REST or gRPC) that has not finished its handshake by then (TLS, "
        "HTTP/2's opening). Without "
        "these a client that sends nothing, or a byte every few seconds, or reads nothing, holds a connection and its "
        "file descriptor for good. Computing the reply is not timed.")
    min_ping_interval_s: float = Field(
        5.0, ge=0, le=MAX_GRPC_MS_S, allow_inf_nan=False, description="The shortest interval at which a client may send keepalive "
        "pings while its call sends no data (the actor pings every keepalive_s, 30 s by default, to find a frozen "
        "server or a dead network path); a client pinging more often gets GOAWAY too_many_pings after two such pings. "
        "gRPC's default is 5 minutes, which would refuse any client keepalive shorter than that.")
    device: DeviceSpec = Field("auto", description="torch device for the model: auto (cuda if available), cpu, cuda, cuda:N.")
    num_threads: int = Field(0, ge=0, le=MAX_THREADS, description="torch CPU threads of this process (its thread budget when services "
                             "share a machine's cores); 0: torch's default, one per core.")
    compile: bool = Field(False, description="torch.compile the model's passes (Infer, Score, and the critic's Train "
                          "forward and backward) into fused kernels, with dynamic shapes so one graph serves every batch "
                          "width. They compile at load, on a 2-row dummy batch, before the server reports ready (tens of "
                          "seconds on a CPU); on a CPU a Train micro-batch of over 4096 tokens compiles once more when "
                          "it first comes. On the CPU it needs a C++ compiler (g++ or "
                          "clang++), checked at start. Results equal eager ones up to float reduction order.")
    prepack_weights: bool = Field(True, description="On a CPU in float32, every linear layer (torch.nn.Linear, and "
                                  "transformers' Conv1D: GPT-2's projections) of the model computes Infer and Score "
                                  "batches (the critic's combined reward model too) through a copy of its weight "
                                  "prepacked for oneDNN, made at the first batch after the weights last changed and "
                                  "kept until they change again (the critic's "
                                  "Train and Load; a reward model's never do): one more copy of those weights while "
                                  "it is kept (false saves that memory). With compile on, the compiled Infer and Score "
                                  "passes call the packed layers between their fused kernels. Train computes on the "
                                  "weights themselves. "
                                  "Results equal unpacked ones up to float rounding.")
    trust_remote_code: bool = Field(False, description="Let transformers run the model code a checkpoint ships (the auto_map of its config.json) for the model and tokenizer: only for checkpoints you trust. The critic copies those code files into its checkpoints.")
    batching: BatchingConfig = Field(default_factory=BatchingConfig)

    @model_validator(mode="after")
    def _a_port_each(self) -> ServerConfig:
        if self.port == self.http_port != 0:
            raise ValueError(f"port and http_port are both {self.port}: the gRPC and the REST server need a port each "
                             "(0 for any free one)")
        return self
