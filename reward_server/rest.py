"""REST adapter: OpenRLHF's remote reward protocol, `POST /get_reward`.

Request `{"query": [prompt+response text], "prompts": [...], "labels": [...]}` (prompts and labels optional),
response `{"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}`; rewards and scores are the
same here, extra_logs carries the components. Requests share the gRPC Score queue, so concurrent calls of
both protocols are merged into one forward pass.

OpenRLHF passes its dataset's labels through as they are, so a label may be any JSON value: a string is used as
it is, anything else as its JSON text (42 -> "42", null -> "null", [1, 2] -> "[1, 2]"). A query that does not
start with its prompt (OpenRLHF truncates long prompts) is scored whole. What standard JSON and UTF-8 cannot
carry (NaN, Infinity, lone surrogates) is refused with 400 (422 where a string is due) naming the field.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from serving.errors import InvalidArgument, ServiceError

if TYPE_CHECKING:
    from .servicer import RewardService

log = logging.getLogger(__name__)


class GetRewardRequest(BaseModel):
    query: list[str] = Field(min_length=1, description="Prompt + response text of each sample.")
    prompts: list[str] | None = Field(None, description="Prompt of each sample, normally a prefix of its query; "
                                      "a query that does not start with it is scored whole.")
    labels: list[Any] | None = Field(None, description="Reference answer of each sample: any JSON value; one "
                                     "that is not a string is used as its JSON text.")


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
            for field in ("query", "prompts"):
                for i, text in enumerate(getattr(body, field) or []):
                    _check_unicode(text, f"{field}[{i}]")
            labels = [_label_text(v, f"labels[{i}]") for i, v in enumerate(body.labels or [])]
            inp = service.core.validate(texts=body.query, prompts=body.prompts, labels=labels, texts_field="query")
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


def _label_text(value: Any, field: str) -> str:
    """A label as the scorers see it: a string as it is, any other JSON value as its JSON text."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except ValueError:
            raise InvalidArgument(f"{field}: NaN and Infinity (or a number beyond float range) are not JSON "
                                  "numbers") from None
        except RecursionError:
            raise InvalidArgument(f"{field}: nested too deeply") from None
    _check_unicode(text, field)
    return text


def _check_unicode(text: str, field: str) -> None:
    """JSON's \\uXXXX escapes can spell a lone surrogate, which is no Unicode character (nor UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{field}: contains a lone surrogate (\\ud800-\\udfff escape), which is not valid "
                              "Unicode") from None
