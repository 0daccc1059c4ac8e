"""At-most-once Train: the replies of the last N request ids, and the Trains of an id still queued or running.

A Train is applied at most once per non-empty request_id: `TrainGate` answers a repeat from `TrainWindow` (ids
already applied) or by waiting for the call of the same id in flight; the model thread checks the window again
just before training (`CriticCore.apply_train`), so a repeat that slipped past the gate still trains nothing.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from serving.errors import InvalidArgument

REQUEST_ID_MAX = 256


@dataclass(frozen=True)
class TrainResult:
    """What a Train answers: mean loss, metrics, and the train step reached."""

    loss: float
    metrics: dict[str, float]
    train_step: int


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
                                                  int(result["train_step"])))

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

    async def run(self, request_id: str, train: Callable[[], Awaitable[tuple[TrainResult, bool]]]) -> tuple[TrainResult, bool]:
        """(result, whether it is a repeat's stored result). `train()` applies the request on the model worker
        and returns the same pair (a repeat found there by the model thread's own check)."""
        if not request_id:
            return await train()
        while True:
            if (stored := self.window.get(request_id)) is not None:
                return stored, True
            first = self._in_flight.get(request_id)
            if first is None:
                break
            await asyncio.wait([first])  # our own cancellation propagates; the first call's failure does not
            if not first.cancelled() and first.exception() is None:
                return first.result(), True
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
