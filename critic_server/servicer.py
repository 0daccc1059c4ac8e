"""gRPC adapter of the critic core: decode, validate, queue on the model worker, encode."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
from prometheus_client import Counter, Gauge

from ppo_services.v1 import common_pb2, critic_pb2, critic_pb2_grpc
from serving.codec import decode, encode
from serving.errors import DeadlineExceeded, InvalidArgument, ServiceError
from serving.server import Service, rpc_method
from serving.wire import add_parsing_service

from .config import CriticConfig
from .core import CriticCore
from .dedupe import Ticket, TrainGate, TrainResult, check_request_id, fingerprint

log = logging.getLogger(__name__)


def required(msg, field: str):
    if not msg.HasField(field):
        raise InvalidArgument(f"{field}: required")
    return decode(getattr(msg, field), field)


def optional(msg, field: str):
    """The field's value (a Tensor decoded), or None when the request leaves it unset."""
    if not msg.HasField(field):
        return None
    value = getattr(msg, field)
    return decode(value, field) if isinstance(value, common_pb2.Tensor) else value


class CriticServicer(critic_pb2_grpc.CriticServiceServicer):
    def __init__(self, service: CriticService):
        self.service = service
        self.core = service.core
        self.metrics = service.metrics
        self.train_steps = service.metrics_train_steps
        self.last_loss = service.metrics_last_loss
        self.gate = TrainGate(self.core.window)

    @rpc_method("Infer")
    async def Infer(self, request: critic_pb2.InferRequest, context) -> critic_pb2.InferResponse:
        worker = self.service.require_ready()
        tokens, lengths = self.core.validate_infer(required(request, "tokens"), required(request, "lengths"))
        values, rewards = await worker.run_batched("Infer", tokens.shape[0], (tokens, lengths), self.core.infer_batch)
        reply = critic_pb2.InferResponse(values=encode(values))
        if rewards is not None:
            reply.rewards.CopyFrom(encode(rewards))
        return reply

    @rpc_method("Train")
    async def Train(self, request: critic_pb2.TrainRequest, context) -> critic_pb2.TrainResponse:
        worker = self.service.require_ready()
        remaining = context.time_remaining()  # None without a client deadline
        deadline = None if remaining is None else time.monotonic() + remaining
        request_id = check_request_id(request.request_id)
        batch = self.core.validate_train(
            *(required(request, f) for f in ("tokens", "returns", "old_values", "mask")),
            lengths=optional(request, "lengths"),
            value_clip=optional(request, "value_clip"),
            loss_scale=optional(request, "loss_scale"),
            epochs=optional(request, "epochs"),
        )
        if request_id:  # a repeat must be the same request (dedupe.same_request)
            batch = dataclasses.replace(batch, fingerprint=fingerprint(
                (batch.tokens, batch.lengths, batch.returns, batch.old_values, batch.mask),
                (batch.value_clip, batch.loss_scale, batch.epochs)))

        async def apply() -> tuple[TrainResult, bool]:
            if deadline is not None and time.monotonic() >= deadline:
                self.service.metrics_expired.inc()
                raise DeadlineExceeded("deadline exceeded before the Train was queued; not applied")
            ticket = Ticket()
            try:
                return await worker.run_exclusive("Train", lambda: self.core.apply_train(request_id, deadline, batch,
                                                                                         ticket))
            except DeadlineExceeded:
                self.service.metrics_expired.inc()
                raise
            except asyncio.CancelledError:  # the caller left (its deadline, or a cancel) before the model thread
                # Counted whatever the reason: the client's deadline fires a little before the one taken here at
                # arrival, so its cancel can come in first, and a Train not applied is one either way.
                if ticket.abandon():
                    self.service.metrics_expired.inc()
                raise

        result, duplicate = await self.gate.run(request_id, batch.fingerprint, apply)
        if duplicate:
            self.service.metrics_duplicates.inc()
        else:
            self.train_steps.set(result.train_step)
            self.last_loss.set(result.loss)
        return critic_pb2.TrainResponse(loss=result.loss, metrics=result.metrics, train_step=result.train_step,
                                        instance_id=self.core.instance_id, repeated=duplicate)

    @rpc_method("Save")
    async def Save(self, request: critic_pb2.SaveRequest, context) -> critic_pb2.SaveResponse:
        worker = self.service.require_ready()
        tag = self.core.validate_tag(request.tag)
        path, step = await worker.run_exclusive("Save", lambda: self.core.save(tag))
        return critic_pb2.SaveResponse(path=path, train_step=step)

    @rpc_method("Load")
    async def Load(self, request: critic_pb2.LoadRequest, context) -> critic_pb2.LoadResponse:
        worker = self.service.require_ready()
        tag = self.core.validate_tag(request.tag)
        path, step = await worker.run_exclusive("Load", lambda: self.core.restore(tag))
        self.train_steps.set(step)
        return critic_pb2.LoadResponse(path=path, train_step=step)

    @rpc_method("GetInfo")
    async def GetInfo(self, request: common_pb2.GetInfoRequest, context) -> critic_pb2.CriticInfo:
        self.service.require_ready()
        return critic_pb2.CriticInfo(**self.core.info())


class CriticService(Service):
    name = "critic"
    tls_alone_authenticates = False  # Train, Save and Load change it

    def __init__(self, cfg: CriticConfig):
        super().__init__(cfg)
        self.core = CriticCore(cfg, self.metrics.observe_pass)
        p = self.metrics.prefix
        self.metrics_train_steps = Gauge(f"{p}_train_steps", "Critic optimizer steps taken", registry=self.metrics.registry)
        self.metrics_last_loss = Gauge(f"{p}_last_loss", "Value loss of the last Train call", registry=self.metrics.registry)
        self.metrics_duplicates = Counter(f"{p}_duplicate_trains", "Trains answered from an earlier call of the same "
                                          "request_id, not applied again", registry=self.metrics.registry)
        self.metrics_expired = Counter(f"{p}_expired_trains", "Trains not applied because their deadline passed, "
                                       "or their caller left, before the model worker reached them", registry=self.metrics.registry)

    def load(self) -> None:
        self.core.load()
        self.metrics_train_steps.set(self.core.train_step)

    async def serve(self) -> int:
        """Serve until SIGTERM; then, with autosave_every > 0, checkpoint what the drained Trains applied."""
        code = await super().serve()
        if self.core.cfg.autosave_every <= 0 and getattr(self.core, "unsaved", False):
            log.warning("critic stopping at train step %d with Trains applied since its last checkpoint, which "
                        "autosave_every=0 does not write: a restart resumes an older state (an actor resuming its run "
                        "returns it to the checkpoint of its step)", self.core.train_step)
        if self.worker is not None and not self.abandoned and not self.worker.failed:
            try:
                if (path := self.core.save_on_exit()) is not None:
                    log.info("critic saved %s on exit (train step %d)", path, self.core.train_step)
            except ServiceError as e:  # its reason in one line (a full disk); anything else with its traceback
                log.error("critic could not save on exit: %s", e)
                code = code or 1
            except Exception:
                log.exception("critic could not save on exit")
                code = code or 1
        return code

    def max_length_hint(self) -> int | None:
        return self.core.max_length_hint()

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        return [add_parsing_service(server, CriticServicer(self), critic_pb2.DESCRIPTOR.services_by_name["CriticService"], self.metrics)]
