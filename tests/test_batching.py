"""The model worker: arrival order, dynamic batching limits, backpressure and draining."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serving.batching import ModelWorker
from serving.errors import NotReady, Overloaded
from serving.metrics import ServiceMetrics


def make_worker(**kw) -> ModelWorker:
    args = {"max_batch_size": 8, "max_queue_delay_s": 0.05, "max_queue_size": 100, **kw}
    worker = ModelWorker(ServiceMetrics("test"), **args)
    worker.start()
    return worker


async def test_concurrent_requests_merge_up_to_max_rows_and_keep_their_own_results():
    worker = make_worker(max_batch_size=8)
    batches: list[list[int]] = []

    def run(payloads: list[int]) -> list[int]:
        batches.append(payloads)
        return [p * 10 for p in payloads]

    results = await asyncio.gather(*(worker.run_batched("Infer", 3, i, run) for i in range(6)))
    assert results == [i * 10 for i in range(6)]
    assert all(3 * len(b) <= 8 for b in batches)  # 3 rows each: at most 2 per batch
    assert len(batches) == 3
    await worker.drain(5)


async def test_exclusive_work_runs_alone_in_arrival_order():
    worker = make_worker(max_queue_delay_s=0.2)
    log: list[str] = []
    weights = {"v": 0}

    def infer(payloads):
        log.append(f"infer{payloads}")
        return [weights["v"]] * len(payloads)

    def train():
        log.append("train")
        weights["v"] += 1
        return weights["v"]

    first = asyncio.ensure_future(worker.run_batched("Infer", 1, "a", infer))
    await asyncio.sleep(0)
    trained = asyncio.ensure_future(worker.run_exclusive("Train", train))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(worker.run_batched("Infer", 1, "b", infer))
    assert await first == 0 and await trained == 1 and await second == 1  # the Train came between them
    assert log == ["infer['a']", "train", "infer['b']"]
    await worker.drain(5)


async def test_a_full_queue_is_refused_and_a_failing_batch_fails_only_its_callers():
    gate = threading.Event()
    worker = make_worker(max_queue_size=2)

    def slow():
        gate.wait(10)
        return "done"

    running = asyncio.ensure_future(worker.run_exclusive("Train", slow))
    await asyncio.sleep(0.05)  # taken off the queue and running
    queued = [asyncio.ensure_future(worker.run_exclusive("Train", lambda: "ok")) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="queue is full"):
        await worker.run_exclusive("Train", lambda: "never")
    gate.set()
    assert await running == "done" and [await q for q in queued] == ["ok", "ok"]

    def boom(payloads):
        raise RuntimeError("bad batch")

    with pytest.raises(RuntimeError, match="bad batch"):
        await worker.run_batched("Infer", 1, None, boom)
    assert await worker.run_exclusive("Save", lambda: "still serving") == "still serving"
    await worker.drain(5)


async def test_drain_finishes_accepted_work_then_refuses_new_work():
    worker = make_worker()
    pending = [asyncio.ensure_future(worker.run_exclusive("Train", lambda: time.sleep(0.05) or "ok")) for _ in range(3)]
    await asyncio.sleep(0)
    await worker.drain(10)
    assert [p.result() for p in pending] == ["ok"] * 3
    with pytest.raises(NotReady):
        await worker.run_exclusive("Train", lambda: "late")


async def test_requests_queued_behind_a_running_batch_form_the_next_batch_together():
    """Everything queued while the model thread is busy is taken at once (up to max_batch_size rows), which is
    what batching gains with clients calling concurrently (bench.service_split)."""
    gate = threading.Event()
    worker = make_worker(max_batch_size=8, max_queue_delay_s=0.01)
    batches: list[list[str]] = []

    def run(payloads: list[str]) -> list[str]:
        if payloads == ["first"]:
            gate.wait(10)
        batches.append(payloads)
        return payloads

    first = asyncio.ensure_future(worker.run_batched("Infer", 1, "first", run))
    await asyncio.sleep(0.05)  # running (the delay has passed), holding the model thread
    queued = [asyncio.ensure_future(worker.run_batched("Infer", 2, f"q{i}", run)) for i in range(5)]
    await asyncio.sleep(0.05)
    gate.set()
    assert await first == "first" and [await q for q in queued] == [f"q{i}" for i in range(5)]
    assert batches == [["first"], ["q0", "q1", "q2", "q3"], ["q4"]]  # 2 rows each: 4 fit in 8 rows
    await worker.drain(5)
