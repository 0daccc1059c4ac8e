"""The model worker: all model work of a server runs on one thread, in arrival order.

Consecutive requests of the same batchable method are merged into one call of the model (dynamic
batching), up to `max_batch_size` rows: what queued while the model was busy, and the requests of callers
that are known to be calling. Clients that wait for each reply before they send again come back a few
milliseconds after it, so a batch waits up to `max_queue_delay` while it holds fewer requests than were in
the worker at once since the method's last batch, and closes as soon as they are in; a lone caller never
waits, and a caller that stopped is waited for once. Exclusive work (a training step, a save) runs alone,
so a Train that arrived before an Infer is applied before that Infer runs. A bounded queue gives
backpressure (Overloaded).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import NotReady, Overloaded
from .metrics import ServiceMetrics

log = logging.getLogger(__name__)


@dataclass
class _Work:
    method: str
    rows: int
    payload: Any
    run: Callable[..., Any]  # batchable: run(list[payload]) -> list[result]; exclusive: run() -> result
    batchable: bool
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class ModelWorker:
    def __init__(self, metrics: ServiceMetrics, max_batch_size: int, max_queue_delay_s: float, max_queue_size: int,
                 on_failure: Callable[[], None] | None = None):
        self.metrics = metrics
        self.on_failure = on_failure
        self.failed = False
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self._queue: collections.deque[_Work] = collections.deque()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._busy = False
        # Batchable requests of each method inside the worker (queued or running), and the most there were at once
        # since that method's last batch: how many callers are calling it concurrently, back to back.
        self._inside: collections.Counter[str] = collections.Counter()
        self._peak: collections.Counter[str] = collections.Counter()
        self._running: list[_Work] = []  # the batch on the model thread

    def batch_abandoned(self) -> bool:
        """Whether every caller of the batch running on the model thread has gone (its deadline, a cancel): work
        that comes in parts (rule scorers in worker processes) may stop there, its results unread."""
        running = self._running
        return bool(running) and all(w.future.cancelled() for w in running)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop only ends by cancellation; anything else is a bug that must not leave clients hanging."""
        if task.cancelled() or task.exception() is None:
            return
        log.critical("model worker failed", exc_info=task.exception())
        self.failed = True
        self._accepting = False
        for w in self._queue:
            if not w.future.done():
                w.future.set_exception(NotReady("the model worker failed; the server is stopping"))
        if self.on_failure is not None:
            self.on_failure()

    async def run_exclusive(self, method: str, fn: Callable[[], Any]) -> Any:
        """Run fn() alone on the model thread after everything queued before it."""
        return await self._submit(_Work(method, 0, None, fn, False, asyncio.get_running_loop().create_future()))

    async def run_batched(self, method: str, rows: int, payload: Any, run_batch: Callable[[list], list]) -> Any:
        """Queue `payload` (`rows` rows); `run_batch` maps a list of payloads to a list of results."""
        return await self._submit(_Work(method, rows, payload, run_batch, True, asyncio.get_running_loop().create_future()))

    async def _submit(self, work: _Work) -> Any:
        if not self._accepting:
            raise NotReady("server is shutting down")
        if len(self._queue) >= self.max_queue_size:
            raise Overloaded(f"work queue is full ({self.max_queue_size} requests); retry later")
        self._queue.append(work)
        if work.batchable:
            self._inside[work.method] += 1
            self._peak[work.method] = max(self._peak[work.method], self._inside[work.method])
        self.metrics.queue_depth.set(len(self._queue))
        self._wakeup.set()
        return await work.future

    async def _next(self, timeout: float | None) -> _Work | None:
        """Wait until the queue is non-empty (or timeout) and return its head without removing it."""
        while not self._queue:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                return None
        return self._queue[0]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            head = await self._next(None)
            assert head is not None
            self._queue.popleft()
            self._busy = True  # from here until its results are delivered, even while the batch still forms
            batch = [head]
            if head.batchable:
                batch = await self._gather(head)
                self._peak[head.method] = self._inside[head.method]  # the batch and what is still queued
            self.metrics.queue_depth.set(len(self._queue))
            now = time.monotonic()
            for w in batch:
                self.metrics.queue_time.labels(head.method).observe(now - w.enqueued)
            live = [w for w in batch if not w.future.cancelled()]  # callers that went away are skipped
            self._running = live
            try:
                if not live:
                    continue
                if head.batchable:
                    self.metrics.batch_size.labels(head.method).observe(sum(w.rows for w in live))
                    results = await loop.run_in_executor(self._executor, head.run, [w.payload for w in live])
                else:
                    results = [await loop.run_in_executor(self._executor, head.run)]
                self.metrics.compute_time.labels(head.method).observe(time.monotonic() - now)
                for w, r in zip(live, results, strict=True):
                    if not w.future.done():
                        w.future.set_result(r)
            except Exception as e:  # noqa: BLE001 - delivered to every caller of the failed batch
                for w in live:
                    if not w.future.done():
                        w.future.set_exception(e)
            finally:
                self._busy, self._running = False, []
                if head.batchable:
                    self._inside[head.method] -= len(batch)

    async def _gather(self, head: _Work) -> list[_Work]:
        """`head`, the queued requests of its method behind it, and ones still coming: while fewer of the method's
        requests are in the batch than were inside the worker at once since its last batch (callers calling back to
        back, whose next requests follow the replies just sent), wait up to max_queue_delay for them. A lone caller
        never waits; the batch closes at max_batch_size rows."""
        expected = self._peak[head.method]
        deadline = time.monotonic() + self.max_queue_delay_s
        batch, rows = [head], head.rows
        while rows < self.max_batch_size and len(batch) < expected:
            nxt = await self._next(max(0.0, deadline - time.monotonic()))
            if nxt is None or not nxt.batchable or nxt.method != head.method or rows + nxt.rows > self.max_batch_size:
                break
            batch.append(self._queue.popleft())
            rows += nxt.rows
        return batch

    async def drain(self, timeout: float, coming: Callable[[], bool] = lambda: False) -> bool:
        """Wait up to `timeout` for what is queued or running to finish, and for the work of callers still
        `coming()` (requests admitted before the server began to stop; the caller refuses any other), then stop
        accepting work. Returns False when work was still running at the deadline (its thread is then left to the
        caller)."""
        deadline = time.monotonic() + timeout
        while (self._queue or self._busy or coming()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._accepting = False
        finished = not (self._queue or self._busy)
        if self._task is not None:
            self._task.cancel()
        for w in self._queue:  # only left when the deadline passed
            if not w.future.done():
                w.future.set_exception(NotReady("server is shutting down"))
        self._executor.shutdown(wait=finished, cancel_futures=True)
        return finished
