"""At-most-once Train: the replies of the last N request ids, and the Trains of an id still queued or running.

A Train is applied at most once per non-empty request_id: `TrainGate` answers a repeat from `TrainWindow` (ids
already applied) or by waiting for the call of the same id in flight; the model thread checks the window again
just before training (`CriticCore.apply_train`), so a repeat that slipped past the gate still trains nothing.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import struct
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from serving.errors import InvalidArgument

REQUEST_ID_MAX = 256


@dataclass(frozen=True)
class TrainResult:
    """What a Train answers: mean loss, metrics, and the train step reached; with the fingerprint of the request it
    answers (its payload without the id), so that a repeat can be told from another request under the same id."""

    loss: float
    metrics: dict[str, float]
    train_step: int
    fingerprint: str = ""  # "" where unknown (a window stored before fingerprints were kept)


# what a fingerprint is taken of: FINGERPRINT_VERSION + the hex digest; one stored by an earlier version (the raw
# request's bytes) cannot be compared and is taken as unknown
FINGERPRINT_VERSION = "v2:"


def fingerprint(tensors: Sequence[torch.Tensor], settings: Sequence[float | int]) -> str:
    """SHA-256 of what a Train trains on, as validated: its tensors (dtype, shape and bytes: int64 ids, padding as
    0; float32 per-action values; float32 mask) and settings (as float32). Requests that train alike fingerprint alike, however
    they were encoded (the mask as bool or float32, the ids as int32, epochs unset or 0, value_clip unset or at the
    server's default, padding ids, an unknown field a newer client adds)."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.numpy().tobytes())
    # as the wire's float32 carries them: value_clip=0.2 sent is the server's default of 0.2
    digest.update(struct.pack(f"<{len(settings)}f", *settings))
    return FINGERPRINT_VERSION + digest.hexdigest()


def same_request(request_id: str, stored: TrainResult, request_fingerprint: str) -> TrainResult:
    """The stored result, if it answered this request; InvalidArgument naming the id when the same id came with
    another payload (another step's batch, another client reusing ids), which would otherwise get a reply computed
    for other data and train nothing. A fingerprint of another version (or none) is not compared."""
    comparable = stored.fingerprint.startswith(FINGERPRINT_VERSION) and request_fingerprint.startswith(FINGERPRINT_VERSION)
    if comparable and stored.fingerprint != request_fingerprint:
        raise InvalidArgument(f"request_id: {request_id!r} was applied already to another Train request (other tokens, "
                              f"lengths, returns, old_values, mask, value_clip, loss_scale or epochs; reached train step "
                              f"{stored.train_step}); a repeat must send the same request, and a new request needs a "
                              f"new id")
    return stored


def check_request_id(request_id: str) -> str:
    """The id, if it is at most 256 printable ASCII characters (0x20-0x7E); else InvalidArgument."""
    if len(request_id) > REQUEST_ID_MAX or not all(" " <= c <= "~" for c in request_id):
        shown = repr(request_id[:64]) + ("..." if len(request_id) > 64 else "")
        raise InvalidArgument(f"request_id: expected at most {REQUEST_ID_MAX} printable ASCII characters, got {shown} "
                              f"({len(request_id)} characters)")
    return request_id


class TrainWindow:
    """The results of the last `size` applied request ids, oldest first. Thread-safe: the model thread writes,
    the event loop reads."""

    def __init__(self, size: int):
        self.size = size
        self._results: collections.OrderedDict[str, TrainResult] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, request_id: str) -> TrainResult | None:
        with self._lock:
            return self._results.get(request_id)

    def put(self, request_id: str, result: TrainResult) -> None:
        with self._lock:
            self._results[request_id] = result
            self._results.move_to_end(request_id)
            while len(self._results) > self.size:
                self._results.popitem(last=False)

    def to_json(self) -> list[list]:
        """[[request_id, {loss, metrics, train_step}], ...], oldest first (what critic_state.json stores)."""
        with self._lock:
            return [[k, asdict(v)] for k, v in self._results.items()]

    def load_json(self, entries: list[list], replace: bool = False) -> None:
        """Add the entries of `to_json`; with `replace`, they become the whole window."""
        if replace:
            with self._lock:
                self._results.clear()
        for request_id, result in entries:
            self.put(str(request_id), TrainResult(float(result["loss"]), {k: float(v) for k, v in result["metrics"].items()},
                                                  int(result["train_step"]), str(result.get("fingerprint", ""))))

    def __len__(self) -> int:
        return len(self._results)


class Ticket:
    """One queued Train, claimed either by the model thread (start) or by its caller going away (abandon), never
    both: a Train whose caller left before it started is not applied."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "queued"

    def start(self) -> bool:
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "started"
            return True

    def abandon(self) -> bool:
        """True when the Train had not started (and now never will)."""
        with self._lock:
            if self._state == "started":
                return False
            self._state = "abandoned"
            return True


class TrainGate:
    """Runs each request id's Train once at a time on the event loop: a repeat of an id already applied gets the
    stored result; a repeat of an id still in flight waits for it (and runs itself if the first one failed)."""

    def __init__(self, window: TrainWindow):
        self.window = window
        self._in_flight: dict[str, asyncio.Future] = {}

    async def run(self, request_id: str, request_fingerprint: str,
                  train: Callable[[], Awaitable[tuple[TrainResult, bool]]]) -> tuple[TrainResult, bool]:
        """(result, whether it is a repeat's stored result). `train()` applies the request on the model worker
        and returns the same pair (a repeat found there by the model thread's own check). A repeat whose payload
        (`request_fingerprint`) differs from the first call's is InvalidArgument."""
        if not request_id:
            return await train()
        while True:
            if (stored := self.window.get(request_id)) is not None:
                return same_request(request_id, stored, request_fingerprint), True
            first = self._in_flight.get(request_id)
            if first is None:
                break
            await asyncio.wait([first])  # our own cancellation propagates; the first call's failure does not
            if not first.cancelled() and first.exception() is None:
                return same_request(request_id, first.result(), request_fingerprint), True
        mine = asyncio.get_running_loop().create_future()
        self._in_flight[request_id] = mine
        try:
            result, duplicate = await train()
            mine.set_result(result)
            return result, duplicate
        finally:
            if not mine.done():
                mine.cancel()  # not applied (or failed): a waiting repeat tries itself
            del self._in_flight[request_id]
