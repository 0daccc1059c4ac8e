"""Clients of the remote critic and reward servers. Calls return a `Pending` result at once, so the
actor keeps working (generating, computing log-probs, training) while the servers compute."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import torch

from ppo_services.v1 import common_pb2, critic_pb2, critic_pb2_grpc, reward_pb2, reward_pb2_grpc
from serving.codec import decode, encode
from serving.server import grpc_options

from .config import RemoteConfig

T = TypeVar("T")


class RemoteError(RuntimeError):
    """A remote call failed; the message names the server, the call and the gRPC status."""


class IncompatibleServer(RuntimeError):
    """A server runs a model the actor cannot work with (different vocabulary, too short context)."""


class Pending(Generic[T]):
    """A call in flight; result() waits for it and converts the reply."""

    def __init__(self, call: grpc.Future, convert: Callable, what: str):
        self._call, self._convert, self._what = call, convert, what

    def done(self) -> bool:
        return self._call.done()

    def result(self) -> T:
        try:
            reply = self._call.result()
        except grpc.RpcError as e:
            raise RemoteError(f"{self._what} failed: {e.code().name}: {e.details()}") from None
        return self._convert(reply)


def open_channel(name: str, cfg: RemoteConfig) -> grpc.Channel:
    """Connect, waiting up to connect_timeout_s; a wrong address fails with a message that says so."""
    channel = grpc.insecure_channel(cfg.address, options=grpc_options(cfg.max_message_mb))
    try:
        grpc.channel_ready_future(channel).result(timeout=cfg.connect_timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise RemoteError(
            f"cannot reach the {name} server at {cfg.address} after {cfg.connect_timeout_s:.0f} s: is it running, "
            f"and is `{name}.address` right?"
        ) from None
    return channel


def wait_for_info(name: str, cfg: RemoteConfig, get_info: Callable, request) -> Any:
    """GetInfo, retried while the server answers UNAVAILABLE (listening, model still loading), until
    connect_timeout_s has passed since the call."""
    deadline = time.monotonic() + cfg.connect_timeout_s
    delay = 0.1
    while True:
        try:
            return get_info(request, timeout=max(1.0, min(cfg.timeout_s, deadline - time.monotonic())))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise RemoteError(f"{name} server {cfg.address} GetInfo failed: {e.code().name}: {e.details()}") from None
            if time.monotonic() + delay > deadline:
                raise RemoteError(
                    f"the {name} server at {cfg.address} did not become ready within {cfg.connect_timeout_s:.0f} s "
                    f"(`{name}.connect_timeout_s`); last answer: {e.details()}"
                ) from None
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def _call(what: str, fn, request, timeout: float):
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as e:
        raise RemoteError(f"{what} failed: {e.code().name}: {e.details()}") from None


@dataclass
class TrainResult:
    loss: float
    metrics: dict[str, float]
    train_step: int


class CriticClient:
    def __init__(self, cfg: RemoteConfig):
        self.cfg = cfg
        self.channel = open_channel("critic", cfg)
        self.stub = critic_pb2_grpc.CriticServiceStub(self.channel)
        self.what = f"critic server {cfg.address}"

    def info(self) -> critic_pb2.CriticInfo:
        """What the server runs; waits while its model is still loading."""
        return wait_for_info("critic", self.cfg, self.stub.GetInfo, common_pb2.GetInfoRequest())

    def infer(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Pending[tuple[torch.Tensor, torch.Tensor | None]]:
        """Values float32 [B, S] (and rewards [B] from a combined server, else None)."""
        req = critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths))

        def convert(r: critic_pb2.InferResponse):
            return decode(r.values, "values"), (decode(r.rewards, "rewards") if r.HasField("rewards") else None)

        return Pending(self.stub.Infer.future(req, timeout=self.cfg.timeout_s), convert, f"{self.what} Infer")

    def train(self, tokens: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor) -> Pending[TrainResult]:
        req = critic_pb2.TrainRequest(tokens=encode(tokens), returns=encode(returns.float()),
                                      old_values=encode(old_values.float()), mask=encode(mask.float()))
        return Pending(self.stub.Train.future(req, timeout=self.cfg.timeout_s),
                       lambda r: TrainResult(r.loss, dict(r.metrics), r.train_step), f"{self.what} Train")

    def save(self, tag: str) -> str:
        """Checkpoint the critic; returns the directory written on the server."""
        return _call(f"{self.what} Save", self.stub.Save, critic_pb2.SaveRequest(tag=tag), self.cfg.timeout_s).path

    def close(self) -> None:
        self.channel.close()


class RewardClient:
    def __init__(self, cfg: RemoteConfig):
        self.cfg = cfg
        self.channel = open_channel("reward", cfg)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.what = f"reward server {cfg.address}"

    def info(self) -> reward_pb2.RewardInfo:
        """What the server runs; waits while its model is still loading."""
        return wait_for_info("reward", self.cfg, self.stub.GetInfo, common_pb2.GetInfoRequest())

    def score(self, tokens: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor) -> Pending[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Rewards float32 [B] and named components {name: [B]}."""
        req = reward_pb2.ScoreRequest(tokens=encode(tokens), lengths=encode(lengths), prompt_lengths=encode(prompt_lengths))

        def convert(r: reward_pb2.ScoreResponse):
            return decode(r.rewards, "rewards"), {k: decode(v, k) for k, v in r.components.items()}

        return Pending(self.stub.Score.future(req, timeout=self.cfg.timeout_s), convert, f"{self.what} Score")

    def close(self) -> None:
        self.channel.close()


def check_compatible(name: str, info, vocab_sha256: str, vocab_size: int, needed_length: int, why: str) -> None:
    """Fail at start-up, with a message saying what differs, if a server cannot serve this actor."""
    if info.vocab_sha256 and info.vocab_sha256 != vocab_sha256:
        raise IncompatibleServer(
            f"the {name} server's model {info.model!r} uses a different tokenizer vocabulary than the policy "
            f"(vocab sha256 {info.vocab_sha256[:12]} vs {vocab_sha256[:12]}); serve a model with the policy's tokenizer"
        )
    if info.vocab_size < vocab_size:
        raise IncompatibleServer(f"the {name} server's model {info.model!r} has vocab size {info.vocab_size}, "
                                 f"smaller than the policy's {vocab_size}")
    if info.max_length < needed_length:
        raise IncompatibleServer(
            f"the {name} server's model {info.model!r} accepts at most {info.max_length} tokens, but {why} "
            f"need {needed_length}"
        )
