"""gRPC adapter of the critic core: decode, validate, queue on the model worker, encode."""

from __future__ import annotations

import grpc
from prometheus_client import Gauge

from ppo_services.v1 import common_pb2, critic_pb2, critic_pb2_grpc
from serving.codec import decode, encode
from serving.errors import InvalidArgument
from serving.server import Service, add_servicer, rpc_method

from .config import CriticConfig
from .core import CriticCore


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
        batch = self.core.validate_train(
            *(required(request, f) for f in ("tokens", "returns", "old_values", "mask")),
            lengths=optional(request, "lengths"),
            value_clip=optional(request, "value_clip"),
            loss_scale=optional(request, "loss_scale"),
        )
        loss, metrics, step = await worker.run_exclusive("Train", lambda: self.core.train(batch))
        self.train_steps.set(step)
        self.last_loss.set(loss)
        return critic_pb2.TrainResponse(loss=loss, metrics=metrics, train_step=step)

    @rpc_method("Save")
    async def Save(self, request: critic_pb2.SaveRequest, context) -> critic_pb2.SaveResponse:
        worker = self.service.require_ready()
        tag = self.core.validate_tag(request.tag)
        path, step = await worker.run_exclusive("Save", lambda: self.core.save(tag))
        return critic_pb2.SaveResponse(path=path, train_step=step)

    @rpc_method("GetInfo")
    async def GetInfo(self, request: common_pb2.GetInfoRequest, context) -> critic_pb2.CriticInfo:
        self.service.require_ready()
        return critic_pb2.CriticInfo(**self.core.info())


class CriticService(Service):
    name = "critic"

    def __init__(self, cfg: CriticConfig):
        super().__init__(cfg)
        self.core = CriticCore(cfg)
        p = self.metrics.prefix
        self.metrics_train_steps = Gauge(f"{p}_train_steps", "Critic optimizer steps taken", registry=self.metrics.registry)
        self.metrics_last_loss = Gauge(f"{p}_last_loss", "Value loss of the last Train call", registry=self.metrics.registry)

    def load(self) -> None:
        self.core.load()
        self.metrics_train_steps.set(self.core.train_step)

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        return [add_servicer(server, CriticServicer(self), critic_pb2.DESCRIPTOR.services_by_name["CriticService"], self.metrics)]
