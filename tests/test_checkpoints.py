"""The actor's checkpoint bookkeeping: which checkpoint a run resumes from, leftovers, retention."""

from __future__ import annotations

import json

import pytest

from actor import checkpoints
from actor.config import CheckpointingConfig


def make(root, step: int, metric: float | None = None, complete: bool = True):
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    if complete:
        (d / checkpoints.STATE_FILE).write_text(json.dumps({"step": step, "metric": metric}))
    return d


def test_resume_auto_takes_the_latest_complete_checkpoint(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 10)
    make(tmp_path, 12, complete=False)  # killed while writing its trainer state: not a resume point
    (tmp_path / "tmp_step_14").mkdir()
    assert checkpoints.resume_point(CheckpointingConfig(), tmp_path) == tmp_path / "step_10"
    assert checkpoints.resume_point(CheckpointingConfig(resume="never"), tmp_path) is None
    assert checkpoints.resume_point(CheckpointingConfig(resume=str(tmp_path / "step_2")), tmp_path) == tmp_path / "step_2"
    assert checkpoints.resume_point(CheckpointingConfig(resume="step_2"), tmp_path) == tmp_path / "step_2"
    with pytest.raises(checkpoints.ResumeError, match="checkpointing.resume"):
        checkpoints.resume_point(CheckpointingConfig(resume=str(tmp_path / "step_12")), tmp_path)
    for incomplete_or_absent in ("step_12", "step_4"):
        with pytest.raises(checkpoints.ResumeError, match="expected auto, never, step_N"):
            checkpoints.resume_point(CheckpointingConfig(resume=incomplete_or_absent), tmp_path)
    checkpoints.remove_leftovers(tmp_path)
    assert not (tmp_path / "tmp_step_14").exists() and (tmp_path / "step_12").exists()
    assert checkpoints.resume_point(CheckpointingConfig(), tmp_path / "missing") is None


def test_keep_top_k_keeps_the_latest_and_the_best(tmp_path):
    for step, metric in ((1, 0.5), (2, 0.9), (3, None), (4, 0.7), (5, 0.1)):
        make(tmp_path, step, metric)
    checkpoints.prune(tmp_path, CheckpointingConfig(keep_top_k=2, metric_name="val/rewards"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4", "step_5"]  # best two + the latest
    checkpoints.prune(tmp_path, CheckpointingConfig(keep_top_k=1, metric_name="val/loss", higher_is_better=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]


def test_the_ranking_metric_is_one_the_run_logs(tmp_path):
    """NeMo-RL's val:accuracy is the mean validation reward; a name no step logs stops the run at its first
    checkpoint (keep_top_k ranked every checkpoint last and kept the oldest), and one no run logs at start."""
    assert CheckpointingConfig(metric_name="val:accuracy").metric_name == "val/rewards"
    assert CheckpointingConfig(metric_name="val:response_lengths").metric_name == "val/response_lengths"
    for bad in ("accuracy", "train:loss", "val_reward"):
        with pytest.raises(ValueError, match=f"checkpointing.metric_name={bad.replace(':', '/')} is no metric"):
            CheckpointingConfig(metric_name=bad)
    step = {"train_rollouts/rewards": 0.5, "timers/step_time": 1.0}
    assert checkpoints.ranking_metric("val/rewards", step) is None  # a step without validation
    assert checkpoints.ranking_metric("val/rewards", {**step, "val/rewards": 0.7}) == 0.7
    assert checkpoints.ranking_metric("train_rollouts/rewards", step) == 0.5
    for name, metrics in (("val/reward", {**step, "val/rewards": 0.7}), ("train_rollouts/reward", step)):
        with pytest.raises(checkpoints.UnknownMetric, match=f"metric_name={name} is none of .*train_rollouts/rewards"):
            checkpoints.ranking_metric(name, metrics)
    # checkpoints without the metric rank last, the newer first among equals
    for n in range(1, 6):
        make(tmp_path, n, 0.9 if n == 2 else None)
    checkpoints.prune(tmp_path, CheckpointingConfig(keep_top_k=2, metric_name="val/rewards"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4", "step_5"]


def test_keep_top_k_keeps_the_newest_checkpoint_that_holds_its_critic(tmp_path):
    """Once the critic's Saves fail (its disk full), the checkpoints after hold no critic: the newest one that does
    is kept whatever its metric, so the run can still resume exactly from it."""
    for step, metric in ((1, 0.1), (2, 0.2), (3, 0.9), (4, 0.8), (5, 0.7)):
        d = make(tmp_path, step, metric)
        if step >= 3:
            state = json.loads((d / checkpoints.STATE_FILE).read_text())
            state["critic_unsaved"] = {"error": "disk full", "instance_id": "a", "train_step": step}
            (d / checkpoints.STATE_FILE).write_text(json.dumps(state))
    assert [checkpoints.holds_its_critic(tmp_path / f"step_{s}") for s in (2, 3)] == [True, False]
    checkpoints.prune(tmp_path, CheckpointingConfig(keep_top_k=1, metric_name="val/rewards"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3", "step_5"]


def test_retention_and_deadline_settings_are_checked():
    with pytest.raises(ValueError, match="checkpointing.keep_top_k needs checkpointing.metric_name"):
        CheckpointingConfig(keep_top_k=3)
    with pytest.raises(ValueError, match="HH:MM:SS"):
        CheckpointingConfig(checkpoint_must_save_by="4h")
    assert CheckpointingConfig(checkpoint_must_save_by="01:02:03:04").must_save_by_s == 86400 + 7200 + 180 + 4


def test_a_resume_names_the_settings_that_differ_from_the_checkpoint_s():
    """A resume with another policy, seed or critic epochs computes other steps than the uninterrupted run would: the
    actor warns, naming each; where it runs, how long, its logging and its servers' addresses may change freely."""
    from actor.checkpoints import changed_settings
    from actor.config import ActorConfig

    saved = ActorConfig().model_dump(mode="json")
    now = ActorConfig(run_dir="elsewhere", num_threads=2, critic={"address": "host:1", "ppo_epochs": 2},
                      policy={"model_name": "./other"}, ppo={"max_num_steps": 900, "seed": 3},
                      logger={"tensorboard_enabled": False}).model_dump(mode="json")
    assert changed_settings(saved, now) == ["critic.ppo_epochs (was 1, now 2)",
                                            "policy.model_name (was 'embedded:policy', now './other')",
                                            "ppo.seed (was 42, now 3)"]
    assert changed_settings(saved, saved) == [] and changed_settings({}, now) == []
    # a key a later version added, missing from the saved config: a change only where this run sets it otherwise
    defaults, older = ActorConfig.model_construct().model_dump(mode="json"), ActorConfig().model_dump(mode="json")
    del older["env"]["step_timeout_s"]
    assert changed_settings(older, saved, defaults) == []
    assert changed_settings(older, ActorConfig(env={"step_timeout_s": 5}).model_dump(mode="json"), defaults) == \
        ["env.step_timeout_s (not in the checkpoint's config, now 5.0)"]


def test_a_resume_across_a_change_of_meaning_names_it_and_settings_switched_off_are_no_difference():
    """0.2.0 gave ppo.policy_training_start_step and ppo.reward_shaping NeMo-RL's meanings: a run written before,
    resumed after, trained otherwise with the same config and nothing said so (the checkpoint recorded no version).
    A checkpoint now records the meanings it was written under, and a resume across a change names it. Defaults of a
    section switched off (reward shaping's overlong keys lost their defaults) are no difference either."""
    from actor.checkpoints import CONFIG_MEANINGS, changed_settings, meaning_changes
    from actor.config import ActorConfig

    now = ActorConfig(ppo={"policy_training_start_step": 3}).model_dump(mode="json")
    old = json.loads(json.dumps(now))
    old["ppo"]["reward_shaping"].update(overlong_buffer_length=4, overlong_buffer_penalty=1.0)  # the old defaults
    (why,) = meaning_changes({"config": old}, now)  # no config_meanings: written before 0.2.0
    assert "ppo.policy_training_start_step=3 now means 3 critic-only steps" in why and "set it to 2" in why
    assert meaning_changes({"config": old, "config_meanings": CONFIG_MEANINGS}, now) == []
    assert meaning_changes({"config": old}, ActorConfig().model_dump(mode="json")) == []
    assert changed_settings(old, now) == []  # shaping is off then and now: its keys change nothing
    old["ppo"]["reward_shaping"].update(enabled=True, stop_properly_penalty_coef=0.5)
    shaped = ActorConfig(ppo={"reward_shaping": {"enabled": True, "stop_properly_penalty_coef": 0.5}}).model_dump(
        mode="json")
    assert any("applied together" in w for w in meaning_changes({"config": old}, shaped))
    assert changed_settings(old, shaped)  # shaping is on: the overlong keys' change is named
