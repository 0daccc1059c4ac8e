"""REST adapter: OpenRLHF's remote reward protocol, `POST /get_reward`.

Request `{"query": [prompt+response text], "prompts": [...], "labels": [...]}` (prompts and labels optional),
response `{"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}`; rewards and scores are the
same here, extra_logs carries the components. Requests share the gRPC Score queue, so concurrent calls of
both protocols are merged into one forward pass.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from serving.errors import ServiceError

if TYPE_CHECKING:
    from .servicer import RewardService

log = logging.getLogger(__name__)


class GetRewardRequest(BaseModel):
    query: list[str] = Field(min_length=1, description="Prompt + response text of each sample.")
    prompts: list[str] | None = Field(None, description="Prompt of each sample, a prefix of its query.")
    labels: list[str] | None = Field(None, description="Reference answer of each sample.")


class GetRewardResponse(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]]


def add_reward_routes(service: RewardService) -> None:
    metrics = service.metrics

    @service.app.post("/get_reward", response_model=GetRewardResponse)
    async def get_reward(body: GetRewardRequest):
        """One reward per query; 400 names the bad field, 503 until the model is loaded."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            worker = service.require_ready()
            inp = service.core.validate(texts=body.query, prompts=body.prompts, labels=body.labels,
                                        texts_field="query")
            rewards, components = await worker.run_batched("Score", inp.rows, inp, service.core.score_batch)
            values = rewards.tolist()
            return GetRewardResponse(rewards=values, scores=values,
                                     extra_logs={k: v.tolist() for k, v in components.items()})
        except ServiceError as e:
            code = e.grpc_code
            return JSONResponse({"detail": str(e)}, status_code=e.http_status)
        except Exception as e:
            log.exception("get_reward failed")
            code = grpc.StatusCode.INTERNAL
            return JSONResponse({"detail": f"get_reward failed: {type(e).__name__}: {e}"}, status_code=500)
        finally:
            metrics.record_request("get_reward", code.name, time.perf_counter() - start)
