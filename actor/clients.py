"""Clients of the remote critic and reward servers. Calls return a `Pending` result at once, so the
actor keeps working (generating, computing log-probs, training) while the servers compute."""

from __future__ import annotations

import logging
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import httpx
import numpy as np
import torch

from ppo_services.v1 import common_pb2, critic_pb2, critic_pb2_grpc, reward_pb2, reward_pb2_grpc
from serving.codec import decode, encode
from serving.security import BearerClientInterceptor, check_ca_file, is_loopback, load_key_pair, read_pem
from serving.wire import grpc_options

from .config import RemoteConfig, RewardConfig, grpc_target_hosts

T = TypeVar("T")
log = logging.getLogger(__name__)

# rewards float32 [B] and named components {name: float32 [B]}
Scores = tuple[torch.Tensor, dict[str, torch.Tensor]]


def as_sent(metrics: Mapping[str, float]) -> dict[str, float]:
    """A Train reply's metrics (float32 on the wire) as the shortest decimals that are those float32 values: a
    learning rate of 1e-4 reads 1e-4, not 9.999999747378752e-05."""
    return {k: float(str(np.float32(v))) for k, v in metrics.items()}


class RemoteError(RuntimeError):
    """A remote call failed; the message names the server, the call and the gRPC status (`code`, where the server
    answered with one)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class IncompatibleServer(RuntimeError):
    """A server runs a model the actor cannot work with (different vocabulary, too short context)."""


# While a server is away, a call is retried after 0.5, 1, 2, 2, ... s, and the channel tries to reconnect as often
# (gRPC's own reconnect backoff grows to 120 s): a restarted server is found within about 2 s of its return, for one
# connection attempt every 2 s while it is away.
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 2.0
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", int(RETRY_FIRST_S * 1000)),
                     ("grpc.min_reconnect_backoff_ms", int(RETRY_FIRST_S * 1000)),
                     ("grpc.max_reconnect_backoff_ms", int(RETRY_MAX_S * 1000))]


# Set when the actor was asked to stop (SIGTERM): an outage met from then on is waited out for at most
# DRAIN_OUTAGE_S, so that a drain whose servers stop at the same time (a pod deletion, `docker compose down`) ends
# well within a grace period instead of waiting `outage_timeout_s` for servers that are not coming back.
draining = threading.Event()
DRAIN_OUTAGE_S = 10.0

# The codes that mean "the server is not there (now)": UNAVAILABLE (unreachable, restarting, loading, draining) and
# CANCELLED, which a server that is shutting down gives the calls that reached it in its last instant (gRPC
# cancels the calls it has not handed to a handler). The actor never cancels its own calls, so a CANCELLED is
# always the server's, and an idempotent call is safe to start again.
OUTAGE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Pending(Generic[T]):
    """A call in flight; result() waits for it and converts the reply. A call started by `start` (an idempotent
    gRPC call) is started again, with exponential backoff, while the server is away (OUTAGE_CODES: restarting,
    unreachable, shutting down), for up to `outage_s` seconds; past that, result() raises RemoteError naming the server."""

    def __init__(self, start: Callable[[], grpc.Future | Future], convert: Callable, what: str,
                 outage_s: float = 0.0, outage_key: str = ""):
        self._start, self._convert, self._what = start, convert, what
        self._outage_s, self._outage_key = outage_s, outage_key
        self._call = start()

    def done(self) -> bool:
        return self._call.done()

    def result(self) -> T:
        outage_since, delay = None, RETRY_FIRST_S
        while True:
            try:
                return self._convert(self._call.result())
            except grpc.RpcError as e:
                if e.code() not in OUTAGE_CODES or self._outage_s <= 0:
                    raise RemoteError(f"{self._what} failed: {e.code().name}: {e.details()}", e.code()) from None
                now = time.monotonic()
                outage_since = outage_since or now
                if draining.is_set() and now + delay - outage_since > min(self._outage_s, DRAIN_OUTAGE_S):
                    raise RemoteError(
                        f"{self._what} failed: the server was unavailable for {now - outage_since:.0f} s while the "
                        f"actor was stopping (SIGTERM), which waits at most {DRAIN_OUTAGE_S:.0f} s for it: "
                        f"{unreachable_reason(e)}") from None
                if now + delay - outage_since > self._outage_s:
                    raise RemoteError(
                        f"{self._what} failed: the server was unavailable for {now - outage_since:.1f} s, and the next "
                        f"try would be past {self._outage_key} ({self._outage_s:g} s): {unreachable_reason(e)}") from None
                log.warning("%s: the server is unavailable (%s); retrying in %.1f s", self._what,
                            unreachable_reason(e), delay)
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                self._call = self._start()

    def then(self, convert: Callable[[T], Any]) -> Mapped:
        """The same call with a further conversion of its result (the call is not started again)."""
        return Mapped(self, convert)


def retrying(method, request, convert: Callable, what: str, cfg: RemoteConfig, name: str, retry: bool = True) -> Pending:
    """`method(request)` as a Pending that, for an idempotent call (`retry`), is started again while the server is
    unavailable, for up to `<name>.outage_timeout_s`."""
    return Pending(lambda: method.future(request, timeout=cfg.timeout_s), convert, what,
                   cfg.outage_timeout_s if retry else 0.0, f"{name}.outage_timeout_s")


class Mapped(Generic[T]):
    """A Pending's result, converted once more."""

    def __init__(self, parent: Pending, convert: Callable):
        self._parent, self._convert = parent, convert

    def done(self) -> bool:
        return self._parent.done()

    def result(self) -> T:
        return self._convert(self._parent.result())


def keepalive_options(cfg: RemoteConfig) -> list[tuple[str, int]]:
    """HTTP/2 pings while a call is in flight (none on an idle channel), every `keepalive_s` however long the call
    sends no data (gRPC stops after two such pings by default): a connection whose pings go unanswered for
    `keepalive_timeout_s` is closed, and its calls fail UNAVAILABLE and are retried like any outage. So a server that
    froze, or a network path that silently drops packets (a node lost behind a Kubernetes Service), is found in
    about keepalive_s + keepalive_timeout_s, not at the call's deadline (`timeout_s`)."""
    if cfg.keepalive_s <= 0:
        return []
    return [("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
            # gRPC waits for a ping's answer for grpc.http2.ping_timeout_ms (1 minute), whatever the keepalive timeout
            ("grpc.http2.ping_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 0)]


def check_tls_files(name: str, cfg: RemoteConfig) -> None:
    """The actor's TLS files for server `name`, as OpenSSL reads them: one it cannot use stops the actor at start
    (actor.servers.Servers checks them all before it waits for any server), naming the setting (gRPC would have
    refused each connection with a handshake error, and OpenSSL asked the terminal for an encrypted key's
    passphrase)."""
    for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):  # regular files first: OpenSSL would block on a FIFO
        read_pem(getattr(cfg, key), f"{name}.{key}")
    if cfg.tls_ca_file:
        check_ca_file(cfg.tls_ca_file, f"{name}.tls_ca_file")
    if cfg.tls_cert_file:
        load_key_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cfg.tls_cert_file, cfg.tls_key_file, f"{name}.")


def target_hosts(target: str) -> list[str]:
    """The hosts a gRPC target (`host:port`, `[::1]:5555`, `dns:///host:port`, `ipv4:10.0.0.1:5555,10.0.0.2:5555`) or
    an http(s) URL may dial; none for a Unix socket. The config checked both forms when it was read."""
    if "://" in target and not target.startswith(("dns:", "unix:")):
        return [urllib.parse.urlsplit(target).hostname or ""]
    return grpc_target_hosts(target)


def warn_clear_text_token(name: str, cfg: RemoteConfig) -> None:
    """Log that the bearer token goes to server `name` (its address, or its URL for an OpenRLHF-protocol reward
    server) without TLS beyond this machine: anyone who can watch that network can read it and call the server as
    this run (gRPC's own token credentials refuse an insecure channel for that reason). Inside a private network
    (compose, a cluster with NetworkPolicies) that may be the choice; it is said once, at start."""
    if isinstance(cfg, RewardConfig) and cfg.source == "openrlhf" and cfg.url:
        target, tls = cfg.url, cfg.url.lower().startswith("https://")
    else:
        target, tls = cfg.address, bool(cfg.tls_ca_file or cfg.tls_cert_file)
    beyond = [host for host in target_hosts(target) if not is_loopback(host)]
    if tls or not beyond:
        return
    log.warning("the bearer token goes to the %s server at %s in clear text (no TLS, and %s is not a loopback "
                "address): anyone who can watch that network can read it and call the server. Serve it over TLS "
                "(the server's --tls-cert-file/--tls-key-file, this run's %s.tls_ca_file) unless the network is "
                "private", name, target, " and ".join(beyond), name)


def open_channel(name: str, cfg: RemoteConfig, token: str | None = None) -> grpc.Channel:
    """A channel to the server (TLS when a CA or client certificate is configured; the bearer token on every
    call). It connects lazily: `wait_for_info` waits for the server and says why it cannot reach it."""
    options = grpc_options(cfg.max_message_mb) + RECONNECT_OPTIONS + keepalive_options(cfg)
    if cfg.tls_ca_file or cfg.tls_cert_file:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read_pem(cfg.tls_ca_file, f"{name}.tls_ca_file"),
            private_key=read_pem(cfg.tls_key_file, f"{name}.tls_key_file"),
            certificate_chain=read_pem(cfg.tls_cert_file, f"{name}.tls_cert_file"))
        channel = grpc.secure_channel(cfg.address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(cfg.address, options=options)
    if token:
        channel = grpc.intercept_channel(channel, BearerClientInterceptor(token))
    return channel


_WAIT_LOG_EVERY_S = 5.0
_RETRY_WHILE_CONNECTING = (*OUTAGE_CODES, grpc.StatusCode.DEADLINE_EXCEEDED)


def unreachable_reason(e: grpc.RpcError) -> str:
    """Why a call did not reach a working server, in words an operator can act on."""
    code, details = e.code(), e.details() or ""
    low = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if "not loaded yet" in low:
            return "its model is still loading"
        if "connection refused" in low:
            return "connection refused: nothing listens on that port"
        if "dns" in low or "resolv" in low or "name or service not known" in low:
            return "the host name does not resolve"
        if (tls := tls_failure(low)) is not None:
            return f"the TLS handshake failed: {tls} ({details})"
        if "http1" in low:
            return f"something answers on that port, but not a gRPC server ({details})"
        if "settings" in low and ("timed out" in low or "timeout" in low):  # TCP accepted, HTTP/2 never began
            return (f"the server accepted the connection but did not answer it: it is frozen or overloaded (or, "
                    f"when this persists, something else listens there) ({details})")
        if "socket closed" in low or "stream removed" in low or "connection reset" in low or "broken pipe" in low:
            return (f"the server closed the connection: it stopped or restarted, or (when this persists) it serves "
                    f"TLS to a plaintext client, or wants a client certificate this client does not present "
                    f"(tls_ca_file, tls_cert_file) ({details})")
        if "http" in low or "protocol" in low or "frame" in low:
            return f"something answers on that port, but not a gRPC server ({details})"
        return details or "unavailable"
    if code == grpc.StatusCode.CANCELLED:
        return "the call was cancelled by the server as it shut down"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer (a firewall dropping packets, or a server too busy to answer)"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return f"a gRPC server answers on that port, but not one of ours ({details})"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"{code.name}: {details}: the server wants its bearer token; give the actor the same token file "
                f"(auth_token_file, --auth-token-file, or $PPO_SERVICES_AUTH_TOKEN holding the token)")
    return f"{code.name}: {details}"


def tls_failure(details: str) -> str | None:
    """What a failed TLS handshake's details (lower case) say about the certificates, in words an operator can act
    on; None when they are not about TLS. Waiting cannot mend any of these."""
    if "hostname verification" in details or "hostname mismatch" in details or "ip address mismatch" in details:
        return "the server's certificate is for another host name than the address this client dials"
    if "certificate_verify_failed" in details or "certificate verify failed" in details:
        if "expired" in details:
            return "the server's certificate has expired"
        return "the server's certificate is not signed by the CA this client trusts (tls_ca_file)"
    if "alert certificate required" in details or "alert bad certificate" in details or "alert unknown ca" in details:
        return ("the server refused this client's certificate, or wants one: present one its tls_client_ca_file "
                "signed (tls_cert_file, tls_key_file)")
    if "tls handshake failed" in details or "ssl handshake failed" in details:
        return "the server's TLS settings do not fit this client's"
    return None


def wait_for_info(name: str, cfg: RemoteConfig, get_info: Callable, request) -> Any:
    """GetInfo, retried while the server cannot be reached or is still loading its model, for up to
    connect_timeout_s; every few seconds a log line says which server the actor waits for and why. Fails with
    that reason; at once for answers that waiting cannot change (a wrong token, not our server)."""
    start = time.monotonic()
    deadline = start + cfg.connect_timeout_s
    next_log = start + 1.0
    delay = 0.1
    while True:
        remaining = deadline - time.monotonic()
        try:
            return get_info(request, timeout=max(0.5, min(5.0, cfg.timeout_s, remaining)))
        except grpc.RpcError as e:
            reason = unreachable_reason(e)
            low = (e.details() or "").lower()
            # an HTTP/1 server will not turn into a gRPC one, nor will a certificate come to fit by waiting
            not_grpc, bad_tls = "http1" in low, tls_failure(low) is not None
            if e.code() not in _RETRY_WHILE_CONNECTING or not_grpc or bad_tls:
                raise RemoteError(f"{name} server {cfg.address} GetInfo failed: {reason}") from None
            now = time.monotonic()
            if now + delay > deadline:
                raise RemoteError(
                    f"cannot reach the {name} server at {cfg.address} within {cfg.connect_timeout_s:.0f} s "
                    f"(`{name}.connect_timeout_s`): {reason}. Is it running, and is `{name}.address` right?"
                ) from None
            if now >= next_log:
                log.warning("waiting for the %s server at %s: %s (%.0f s left)", name, cfg.address, reason,
                            deadline - now)
                next_log = now + _WAIT_LOG_EVERY_S
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


@dataclass
class TrainResult:
    loss: float
    metrics: dict[str, float]
    train_step: int
    instance_id: str = ""  # the critic process that answered ("" from a server that does not say)
    repeated: bool = False  # the stored reply of an earlier Train with this request id: nothing applied now


class _ServerClient:
    """A channel to one of our gRPC servers (`name`: critic or reward) and its GetInfo, at start-up and during a
    run; the subclasses add the service's own calls."""

    name: str
    stub_class: type

    def __init__(self, cfg: RemoteConfig, token: str | None = None):
        self.cfg = cfg
        self.channel = open_channel(self.name, cfg, token)
        self.stub = self.stub_class(self.channel)
        self.what = f"{self.name} server {cfg.address}"

    def info(self):
        """What the server runs; waits while its model is still loading."""
        return wait_for_info(self.name, self.cfg, self.stub.GetInfo, common_pb2.GetInfoRequest())

    def current_info(self):
        """GetInfo during a run: retried through an outage of up to <name>.outage_timeout_s, like every call."""
        return retrying(self.stub.GetInfo, common_pb2.GetInfoRequest(), lambda r: r, f"{self.what} GetInfo",
                        self.cfg, self.name).result()

    def close(self) -> None:
        self.channel.close()


class CriticClient(_ServerClient):
    name, stub_class = "critic", critic_pb2_grpc.CriticServiceStub

    def infer(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Pending[tuple[torch.Tensor, torch.Tensor | None]]:
        """Values float32 [B, S] (and rewards [B] from a combined server, else None)."""
        req = critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths))

        def convert(r: critic_pb2.InferResponse):
            return decode(r.values, "values"), (decode(r.rewards, "rewards") if r.HasField("rewards") else None)

        return retrying(self.stub.Infer, req, convert, f"{self.what} Infer", self.cfg, "critic")

    def train(self, tokens: torch.Tensor, lengths: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor,
              mask: torch.Tensor, value_clip: float, loss_scale: float, request_id: str = "",
              epochs: int = 1) -> Pending[TrainResult]:
        """`epochs` critic training passes; `lengths` gives the attention mask inference used, the value-loss
        settings travel with the request (the actor's value_loss_fn). With a `request_id` the server applies it
        at most once, so the call is retried like the idempotent ones."""
        req = critic_pb2.TrainRequest(tokens=encode(tokens), lengths=encode(lengths), returns=encode(returns.float()),
                                      old_values=encode(old_values.float()), mask=encode(mask.float()),
                                      value_clip=value_clip, loss_scale=loss_scale, request_id=request_id,
                                      epochs=epochs)
        return retrying(self.stub.Train, req, lambda r: TrainResult(r.loss, as_sent(r.metrics), r.train_step, r.instance_id,
                                                                     r.repeated),
                        f"{self.what} Train", self.cfg, "critic", retry=bool(request_id))

    def save(self, tag: str, retry: bool = True) -> tuple[str, int]:
        """Checkpoint the critic; returns (the directory written on the server, the train step it holds). With
        `retry`, retried through an outage like the idempotent calls: a Save of the same tag writes the same
        checkpoint again (a critic that restarted in between writes the state it resumed: the caller compares the
        train step with the one it left the critic at)."""
        return retrying(self.stub.Save, critic_pb2.SaveRequest(tag=tag), lambda r: (r.path, r.train_step),
                        f"{self.what} Save", self.cfg, "critic", retry=retry).result()

    def load(self, tag: str) -> tuple[str, int]:
        """Return the critic to its checkpoint `tag`; returns (path, train_step). Retried through an outage (a Load
        of the same tag twice ends in the same state)."""
        return retrying(self.stub.Load, critic_pb2.LoadRequest(tag=tag), lambda r: (r.path, r.train_step),
                        f"{self.what} Load", self.cfg, "critic").result()


class RewardClient(_ServerClient):
    name, stub_class = "reward", reward_pb2_grpc.RewardServiceStub

    def score_tokens(self, tokens: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                     labels: list[str] | None = None) -> Pending[Scores]:
        """Score the policy's token ids (the server shares the policy's tokenizer)."""
        req = reward_pb2.ScoreRequest(tokens=encode(tokens), lengths=encode(lengths),
                                      prompt_lengths=encode(prompt_lengths), labels=labels or [])
        return retrying(self.stub.Score, req, _convert_scores, f"{self.what} Score", self.cfg, "reward")

    def score_texts(self, texts: list[str], prompts: list[str], labels: list[str] | None = None) -> Pending[Scores]:
        """Score prompt+response strings (the server tokenizes them with its own tokenizer)."""
        req = reward_pb2.ScoreRequest(texts=texts, prompts=prompts, labels=labels or [])
        return retrying(self.stub.Score, req, _convert_scores, f"{self.what} Score", self.cfg, "reward")

    def score_conversations(self, conversations: list[list[dict[str, str]]],
                            labels: list[str] | None = None) -> Pending[Scores]:
        """Score chat conversations, the response last (the server renders them with its own chat template)."""
        req = reward_pb2.ScoreRequest(labels=labels or [], conversations=[
            reward_pb2.Conversation(messages=[reward_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
            for messages in conversations])
        return retrying(self.stub.Score, req, _convert_scores, f"{self.what} Score", self.cfg, "reward")


def _convert_scores(r: reward_pb2.ScoreResponse) -> Scores:
    return decode(r.rewards, "rewards"), {k: decode(v, k) for k, v in r.components.items()}


class OpenRLHFRewardClient:
    """Any server speaking OpenRLHF's remote reward protocol: POST {"query", "prompts", "labels"} to `url`,
    read `rewards` (and components from `extra_logs`). Requests run on a small thread pool so the actor keeps
    working; a request that cannot connect is retried with backoff (`reward.retries`), each within
    `reward.timeout_s`."""

    def __init__(self, cfg: RewardConfig, token: str | None = None):
        assert cfg.url is not None
        self.cfg, self.url = cfg, cfg.url
        tls = ssl.create_default_context(cafile=cfg.tls_ca_file)
        if cfg.tls_cert_file:
            load_key_pair(tls, cfg.tls_cert_file, cfg.tls_key_file, "reward.")
        self.http = httpx.Client(timeout=cfg.timeout_s, verify=tls,
                                 headers={"Authorization": f"Bearer {token}"} if token else None)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="openrlhf-reward")

    def score_texts(self, texts: list[str], prompts: list[str], labels: list[Any] | None = None) -> Pending[Scores]:
        body: dict[str, Any] = {"query": texts, "prompts": prompts}
        if labels is not None:
            body["labels"] = labels
        return Pending(lambda: self.pool.submit(self._post, body), lambda scores: scores, f"reward server {self.url}")

    def _post(self, body: dict) -> Scores:
        n = len(body["query"])
        delay = 0.5
        for attempt in range(self.cfg.retries + 1):
            try:
                reply = self.http.post(self.url, json=body)
                break
            except (httpx.ConnectError, httpx.RemoteProtocolError) as e:
                if (tls := tls_failure(str(e).lower())) is not None:  # waiting cannot mend a certificate
                    raise RemoteError(f"reward server {self.url} (reward.url): the TLS handshake failed: {tls} "
                                      f"({e})") from None
                if attempt == self.cfg.retries:
                    raise RemoteError(f"reward server {self.url} (reward.url): cannot connect after "
                                      f"{attempt + 1} tries: {e}") from None
                log.warning("reward server %s: %s; retrying in %.1f s", self.url, e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 8.0)
            except httpx.TimeoutException:
                raise RemoteError(f"reward server {self.url} (reward.url) did not answer within "
                                  f"{self.cfg.timeout_s:.0f} s (reward.timeout_s)") from None
            except httpx.HTTPError as e:
                raise RemoteError(f"reward server {self.url} (reward.url): {type(e).__name__}: {e}") from None
        if reply.status_code != 200:
            raise RemoteError(f"reward server {self.url} answered HTTP {reply.status_code}: {reply.text[:500]}")
        try:
            data = reply.json()
            rewards = torch.tensor([float(x) for x in data["rewards"]], dtype=torch.float32)
            components = {k: torch.tensor([float(x) for x in v], dtype=torch.float32)
                          for k, v in (data.get("extra_logs") or {}).items() if isinstance(v, list) and len(v) == n}
        except (ValueError, KeyError, TypeError) as e:
            raise RemoteError(f"reward server {self.url}: expected JSON with a list of {n} numbers under "
                              f"'rewards', got {reply.text[:200]!r} ({e})") from None
        if rewards.shape != (n,):
            raise RemoteError(f"reward server {self.url}: {rewards.numel()} rewards for {n} queries")
        return rewards, components

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def check_compatible(name: str, info, vocab_sha256: str, vocab_size: int, needed_length: int, why: str) -> None:
    """Fail at start-up, with a message saying what differs, if a server cannot take this actor's token ids."""
    server = "reward" if name == "rule" else name
    if info.vocab_sha256 and info.vocab_sha256 != vocab_sha256:
        fix = {
            "critic": "the critic must share the policy's tokenizer (it scores every policy token): serve a critic "
                      "built on the policy's tokenizer",
            "reward": "set reward.input=text (or auto) so the actor sends decoded texts, or serve a reward model with "
                      "the policy's tokenizer",
            "rule": "the rule scorer decodes token ids with the reward server's `tokenizer` key: start it with "
                    "tokenizer=<the policy's path>, or set reward.input=text (or auto)",
        }[name]
        raise IncompatibleServer(
            f"the {server} server's model {info.model!r} uses a different tokenizer vocabulary than the policy "
            f"(vocab sha256 {info.vocab_sha256[:12]} vs {vocab_sha256[:12]}); {fix}"
        )
    if info.vocab_size < vocab_size:
        raise IncompatibleServer(f"the {server} server's model {info.model!r} has vocab size {info.vocab_size}, "
                                 f"smaller than the policy's {vocab_size}")
    if info.max_length < needed_length:
        raise IncompatibleServer(
            f"the {server} server's model {info.model!r} accepts at most {info.max_length} tokens, but {why} "
            f"need {needed_length}"
        )
