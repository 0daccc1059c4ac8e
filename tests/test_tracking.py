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
