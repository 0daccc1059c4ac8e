"""REST adapter: OpenRLHF's remote reward protocol, `POST /get_reward`.

Request `{"query": [prompt+response text], "prompts": [...], "labels": [...]}` (prompts and labels optional),
response `{"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}`; rewards and scores are the
same here, extra_logs carries the components. Requests share the gRPC Score queue, so concurrent calls of
both protocols are merged into one forward pass.

OpenRLHF passes its dataset's labels through as they are, so a label may be any JSON value: a string is used as
it is, a number in plain decimal (42 -> "42", 1e-05 -> "0.00001"), anything else as its JSON text (null -> "null",
[1, 2] -> "[1, 2]"). A query that does not start with its prompt (OpenRLHF truncates long prompts) is scored whole.
What standard JSON and UTF-8 cannot carry (NaN, Infinity, lone surrogates) is refused with 400 (422 where a string
is due) naming the field.

OpenRLHF decodes its padded batch with the special tokens kept, so a query may begin with pad text and end with
pad text after its EOS. As OpenRLHF's own reward server, this one drops runs of pad (and EOS) text at the start of
each query and prompt and of pad text at the end, and a run of EOS text at the end counts once (whitespace between
the marks, as tokenizers that decode word by word put there, is part of a run); a query that came unpadded is
scored as it is, as gRPC Score scores it. The rule scorers read each response without the special-token text it ends
with (core.RewardCore._validate_texts). An empty request (OpenRLHF spreads a batch over several
servers, so a slice may hold nothing) gets empty lists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from transformers import PreTrainedTokenizerBase

from serving.errors import InvalidArgument, ServiceError
from serving.labels import label_text

from .special_text import leading_run_end, special_marks, trailing_run

if TYPE_CHECKING:
    from .servicer import RewardService

log = logging.getLogger(__name__)


class GetRewardRequest(BaseModel):
    query: list[str] = Field(description="Prompt + response text of each sample.")
    prompts: list[str] | None = Field(None, description="Prompt of each sample, normally a prefix of its query; "
                                      "a query that does not start with it is scored whole.")
    labels: list[Any] | None = Field(None, description="Reference answer of each sample: any JSON value; one "
                                     "that is not a string is used as its JSON text.")


class GetRewardResponse(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]]


class _ClientGone(Exception):
    pass


# How often a /get_reward whose work is still on the model thread checks that its client is still there
DISCONNECT_CHECK_S = 0.5


async def _unless_gone(work: asyncio.Future, request: Request) -> Any:
    """`work`'s result; once the client has disconnected (OpenRLHF's own timeout closes the connection), `work` is
    cancelled, so the model thread may stop what comes in parts (math_verify's samples), and _ClientGone raised."""
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=DISCONNECT_CHECK_S)
            if done:
                return work.result()
            if await request.is_disconnected():
                raise _ClientGone
    finally:
        work.cancel()  # a no-op once it is done; else (gone, or this request cancelled at shutdown) it stops


def add_reward_routes(service: RewardService) -> None:
    metrics = service.metrics
    metrics.requests.labels("get_reward", grpc.StatusCode.OK.name)  # at 0 from the start, as every gRPC method

    @service.app.post("/get_reward", response_model=GetRewardResponse)
    async def get_reward(body: GetRewardRequest, request: Request):
        """One reward per query; 400 names the bad field, 503 until the model is loaded."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            worker = service.require_ready()
            service.core.check_rows(query=len(body.query), prompts=len(body.prompts or []),
                                    labels=len(body.labels or []))
            for field in ("query", "prompts"):
                for i, text in enumerate(getattr(body, field) or []):
                    _check_unicode(text, f"{field}[{i}]")
            labels = [_label_text(v, f"labels[{i}]") for i, v in enumerate(body.labels or [])]
            if not body.query and not body.prompts and not labels:  # an empty slice of a batch
                return GetRewardResponse(rewards=[], scores=[], extra_logs={})
            strip = unpadded(service.core.tokenizer)
            inp = await service.validated(texts=[strip(q) for q in body.query],
                                          prompts=[strip(p, start_only=True) for p in body.prompts or []] or None,
                                          labels=labels, texts_field="query")
            scoring = asyncio.ensure_future(worker.run_batched("Score", inp.rows, inp, service.core.score_batch))
            rewards, components = await _unless_gone(scoring, request)
            values = rewards.tolist()
            return GetRewardResponse(rewards=values, scores=values,
                                     extra_logs={k: v.tolist() for k, v in components.items()})
        except ServiceError as e:
            code = e.grpc_code
            return JSONResponse({"detail": str(e)}, status_code=e.http_status)
        except _ClientGone:  # nobody reads an answer; counted as a gRPC call its caller cancelled
            code = grpc.StatusCode.CANCELLED
            return JSONResponse({"detail": "the client disconnected"}, status_code=499)
        except asyncio.CancelledError:  # the shutdown's grace period ended first (answered 503: ServingRequests)
            code = grpc.StatusCode.UNAVAILABLE
            raise
        except Exception as e:
            log.exception("get_reward failed")
            code = grpc.StatusCode.INTERNAL
            return JSONResponse({"detail": f"get_reward failed: {type(e).__name__}: {e}"}, status_code=500)
        finally:
            metrics.record_request("get_reward", code.name, time.perf_counter() - start)


def unpadded(tokenizer: PreTrainedTokenizerBase | None) -> Callable[..., str]:
    """A function dropping the padding OpenRLHF's decoded batches carry: runs of the tokenizer's pad and EOS text at
    the start; at the end, runs of pad text, and a run of EOS text down to one (where pad and EOS are the same text,
    a run of it at the end becomes one EOS). Whitespace between the marks counts as part of a run (tokenizers that
    decode word by word put a space between special tokens). Without `start_only` it strips both ends; a text with
    nothing to drop comes back as it is."""
    pad, eos = (getattr(tokenizer, "pad_token", None), getattr(tokenizer, "eos_token", None))
    marks = special_marks((pad, eos))
    if not marks:
        return lambda text, start_only=False: text
    pads = (pad,) if isinstance(pad, str) and pad and pad != eos else ()
    eos_marks = (eos,) if isinstance(eos, str) and eos else ()

    def strip(text: str, start_only: bool = False) -> str:
        text = text[leading_run_end(text, marks):]
        if start_only:
            return text
        end, padded = trailing_run(text, pads, len(text)) if pads else (len(text), 0)
        start, ends = trailing_run(text, eos_marks, end) if eos_marks else (end, 0)
        if ends and (padded or ends > 1):
            return text[:start] + eos
        return text[:end].rstrip() if padded else text

    return strip


def _label_text(value: Any, field: str) -> str:
    """A label as the scorers see it (serving.labels.label_text), as the actor sends it; InvalidArgument naming
    `field` for what JSON cannot carry."""
    try:
        text = label_text(value)
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
