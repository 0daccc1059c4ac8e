"""gRPC adapter of the reward core: decode, validate, queue on the model worker, encode."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
from prometheus_client import Counter

from ppo_services.v1 import reward_pb2, reward_pb2_grpc
from serving.codec import decode, encode
from serving.server import Service, rpc_method
from serving.wire import add_parsing_service

from .config import RewardConfig
from .core import RewardCore, ScoreInput
from .rest import add_reward_routes


def optional(msg, field: str):
    return decode(getattr(msg, field), field) if msg.HasField(field) else None


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, service: RewardService):
        self.service = service
        self.core = service.core
        self.metrics = service.metrics

    @rpc_method("Score")
    async def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:
        worker = self.service.require_ready()
        self.core.check_rows(texts=len(request.texts), conversations=len(request.conversations),
                             prompts=len(request.prompts), labels=len(request.labels))
        inp = await self.service.validated(
            tokens=optional(request, "tokens"),
            lengths=optional(request, "lengths"),
            prompt_lengths=optional(request, "prompt_lengths"),
            texts=list(request.texts),
            prompts=list(request.prompts),
            labels=list(request.labels),
            conversations=[[{"role": m.role, "content": m.content} for m in c.messages] for c in request.conversations],
        )
        rewards, components = await worker.run_batched("Score", inp.rows, inp, self.core.score_batch)
        reply = reward_pb2.ScoreResponse(rewards=encode(rewards))
        for name, values in components.items():
            reply.components[name].CopyFrom(encode(values))
        return reply

    @rpc_method("GetInfo")
    async def GetInfo(self, request, context) -> reward_pb2.RewardInfo:
        self.service.require_ready()
        return reward_pb2.RewardInfo(**self.core.info())


class RewardService(Service):
    name = "reward"

    def __init__(self, cfg: RewardConfig):
        super().__init__(cfg)
        truncated = Counter(f"{self.metrics.prefix}_truncated_texts", "Texts cut to the model's max length "
                            "(long_texts=truncate)", registry=self.metrics.registry)
        timeouts = Counter(f"{self.metrics.prefix}_math_verify_timeouts", "Samples scored 0.0 by math_verify because "
                           "their worker passed math_verify.timeout_s (and was replaced), or their batch passed "
                           "math_verify.batch_timeout_s before they were sent", registry=self.metrics.registry)
        self.core = RewardCore(cfg, self.metrics.observe_pass, truncated.inc, timeouts.inc,
                               abandoned=lambda: self.worker is not None and self.worker.batch_abandoned())
        # one thread: the fast tokenizer is not safe to call from two at once, and it lets the event loop go while
        # it encodes (a 14.5 MiB text request held /health for 1.8 s when it tokenized on the loop)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-tokenize")
        add_reward_routes(self)

    async def validated(self, **request) -> ScoreInput:
        """`core.validate(**request)`: at once for token ids, on the tokenizing thread for texts and conversations."""
        if not (request.get("texts") or request.get("conversations")) or self.core.model is None:
            return self.core.validate(**request)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, partial(self.core.validate,
                                                                                         **request))

    def load(self) -> None:
        self.core.load()

    def max_length_hint(self) -> int | None:
        return self.core.max_length_hint()

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        return [add_parsing_service(server, RewardServicer(self), reward_pb2.DESCRIPTOR.services_by_name["RewardService"], self.metrics)]
