"""The actor's per-step metrics as an operator scrapes them: gauges hold the last step's value, the per-step
generation counts add up in Prometheus counters."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from actor.tracking import MetricsTracker


def test_gauges_hold_the_last_step_and_generation_counts_add_up_in_counters(tmp_path):
    registry = CollectorRegistry()
    tracker = MetricsTracker(tmp_path, total_steps=3, registry=registry, tensorboard=False)
    rows = [
        {"timers/step_time": 2.5, "generation/decode_steps": 15.0, "generation/compiled_steps": 14.0,
         "generation/compactions": 1.0, "generation/row_steps": 700.0},
        {"timers/step_time": 1.5, "generation/decode_steps": 9.0, "generation/compiled_steps": 0.0,
         "generation/compactions": 0.0, "generation/row_steps": 300.0},
        {"timers/step_time": 2.0},  # a backend without counts (TensorRT-LLM's) reports none
    ]
    for step, row in enumerate(rows, start=1):
        tracker.log(step, row)
    value = registry.get_sample_value
    assert value("ppo_actor_step") == 3 and value("ppo_actor_step_seconds") == 2.0
    assert value("ppo_actor_generation_decode_steps_total") == 24
    assert value("ppo_actor_generation_compiled_steps_total") == 14
    assert value("ppo_actor_generation_compactions_total") == 1
    assert value("ppo_actor_generation_row_steps_total") == 1000
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [1, 2, 3] and written[1]["generation/decode_steps"] == 9
    # a run without a critic, or a synchronous one, exports no critic or async series (a 0 read as a perfect critic)
    assert value("ppo_actor_critic_loss") is None and value("ppo_actor_async_buffer_size") is None
    tracker.log(4, {"critic/loss": 0.25})
    assert value("ppo_actor_critic_loss") == 0.25
    tracker.close()


def test_validation_time_is_counted_once_in_the_step_breakdown():
    """Validation generates through the same collector, whose generation timer ran inside validation's: the
    breakdown added both, so a step's phases summed to more than the step."""
    import time

    from actor.tracking import Timers, step_breakdown

    timers = Timers()
    with timers("generate"):
        time.sleep(0.02)
    with timers.only("validation_time"), timers("generate"):
        time.sleep(0.05)
    popped = timers.pop()
    assert 0.02 <= popped["timers/generate"] < 0.05 and popped["timers/validation_time"] >= 0.05
    metrics = {**popped, "timers/step_time": popped["timers/generate"] + popped["timers/validation_time"] + 0.01}
    step_breakdown(1, metrics)
    assert 0.005 < metrics["timers/other"] < 0.02


def test_a_resumed_run_hides_the_tensorboard_events_past_its_checkpoint(tmp_path):
    """metrics.jsonl keeps the rows up to the checkpoint a resume starts from; TensorBoard's events of the steps
    after it (written by the attempt that crashed) are purged too, not shown twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsTracker(tmp_path, total_steps=4, registry=CollectorRegistry())
    for step in (1, 2, 3):
        first.log(step, {"train_rollouts/rewards": float(step)})
    first.close()  # crashed after step 3; its checkpoint is of step 2
    again = MetricsTracker(tmp_path, total_steps=4, registry=CollectorRegistry(), resume_step=2)
    for step in (3, 4):
        again.log(step, {"train_rollouts/rewards": 10.0 + step})
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    seen = [(e.step, e.value) for e in events.Scalars("train_rollouts/rewards")]
    assert seen == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
