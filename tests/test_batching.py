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
    """Drain waits for queued and running work, and takes the work of callers it is told are still coming (requests
    that arrived before the server began to stop), then refuses any more."""
    worker = make_worker()
    pending = [asyncio.ensure_future(worker.run_exclusive("Train", lambda: time.sleep(0.05) or "ok")) for _ in range(3)]
    coming = asyncio.get_running_loop().create_future()

    async def late_caller():
        await asyncio.sleep(0.3)  # still validating its request when the drain began
        coming.set_result(await worker.run_exclusive("Train", lambda: "late but admitted"))

    caller = asyncio.ensure_future(late_caller())
    await asyncio.sleep(0)
    await worker.drain(10, coming=lambda: not coming.done())
    assert [p.result() for p in pending] == ["ok"] * 3 and coming.result() == "late but admitted"
    await caller
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


async def test_a_lone_caller_never_waits_for_company():
    """max_queue_delay holds a batch only for callers known to be coming: one caller calling back to back runs at
    once, however long the delay."""
    worker = make_worker(max_queue_delay_s=1.0)
    start = time.monotonic()
    for i in range(5):
        assert await worker.run_batched("Infer", 1, i, lambda payloads: payloads) == i
    assert time.monotonic() - start < 1.0  # each call would have waited 1 s for more rows
    await worker.drain(5)


async def _closed_loop_clients(worker: ModelWorker, clients: int, rounds: int, run) -> None:
    """`clients` callers that each send their next request a little after their reply, as remote clients do."""

    async def client(i: int) -> None:
        for r in range(rounds):
            await worker.run_batched("Infer", 1, (i, r), run)
            await asyncio.sleep(0.002 * (i + 1))  # the reply's way back and the next request's way in

    await asyncio.gather(*(client(i) for i in range(clients)))


async def test_callers_calling_back_to_back_are_waited_for_and_the_batch_closes_when_all_are_in():
    """4 clients whose next requests arrive 2-8 ms after their replies: each batch waits for the ones still on their
    way (which alone would form batches of 1-3 behind the running one) and closes as soon as all 4 are in, well
    before the delay runs out."""
    worker = make_worker(max_batch_size=64, max_queue_delay_s=0.5)
    batches: list[int] = []

    def run(payloads: list) -> list:
        batches.append(len(payloads))
        time.sleep(0.01)
        return payloads

    start = time.monotonic()
    await _closed_loop_clients(worker, 4, 10, run)
    assert batches == [4] * 10
    assert time.monotonic() - start < 2.5  # 10 waits of the whole 0.5 s delay would take 5 s
    await worker.drain(5)


async def test_a_caller_that_stops_is_waited_for_once_at_most():
    """After 3 of 4 clients stop, the next batch waits the delay for them once; the one left then runs at once."""
    worker = make_worker(max_batch_size=64, max_queue_delay_s=0.3)
    batches: list[int] = []

    def run(payloads: list) -> list:
        batches.append(len(payloads))
        return payloads

    await _closed_loop_clients(worker, 4, 3, run)
    times = []
    for i in range(4):
        start = time.monotonic()
        await worker.run_batched("Infer", 1, i, run)
        times.append(time.monotonic() - start)
    assert times[0] >= 0.25 and max(times[1:]) < 0.15, times
    assert batches[-4:] == [1, 1, 1, 1]
    await worker.drain(5)
