"""Faults a long run meets: a server killed and restarted mid-run, and one that stays away too long. Real
processes: the servers are SIGKILLed, not mocked."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from actor import checkpoints
from actor.clients import DRAIN_OUTAGE_S, CriticClient, RemoteError
from actor.config import RemoteConfig
from algorithms import adaptive_kl_coef
from ppo_services.v1 import critic_pb2, critic_pb2_grpc
from serving.codec import decode, encode
from tests.network_path import NetworkPath
from tests.service_procs import ROOT, ServiceProcess, actor_command, free_port

RUN = ["ppo.num_prompts_per_step=8", "ppo.num_generations_per_prompt=4", "policy.generation_batch_size=16",
       "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "logger.num_val_samples_to_print=0",
       "ppo.val_period=0", "policy.generation.max_new_tokens=8"]


# a small PPO run (critic and reward server), for the tests that start `configs/ppo.yaml`
PPO_RUN = ("ppo.num_prompts_per_step=8", "policy.generation_batch_size=8", "policy.train_global_batch_size=8",
           "policy.train_micro_batch_size=8", "ppo.val_period=0", "logger.num_val_samples_to_print=0")


@pytest.fixture(scope="module")
def reward(embedded_cache, log_dir):
    """The embedded reward server, for the tests that stop or kill something else."""
    with ServiceProcess("reward", log_dir=log_dir) as server:
        yield server


def start_actor(run_dir, reward_address: str, *overrides: str) -> subprocess.Popen:
    cmd = actor_command("grpo", run_dir, f"reward.address={reward_address}", f"critic.address=127.0.0.1:{free_port()}",
                        *RUN, *overrides)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_steps(run_dir, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    raise TimeoutError(f"no {n} steps in {timeout} s")


def run_with_the_reward_restarted(log_dir, tmp_path, steps: int, *again: str, pause: float = 0.0,
                                  timeout: float = 300) -> tuple[subprocess.Popen, str, Path, str]:
    """A GRPO run of `steps` steps whose reward server is SIGKILLed (no drain: calls in flight break) after step 2
    and started again on the same ports, `pause` seconds later, with `again` added to its command. Returns the
    finished actor, its output, its run_dir and the server's address."""
    grpc_port, http_port = free_port(), free_port()
    first = ServiceProcess("reward", grpc_port=grpc_port, http_port=http_port, log_dir=log_dir).start()
    run_dir = tmp_path / "run"
    actor = start_actor(run_dir, first.address, f"ppo.max_num_steps={steps}", "checkpointing.enabled=false")
    try:
        wait_for_steps(run_dir, 2, actor)
        first.proc.kill()
        first.proc.wait()
        time.sleep(pause)
        with ServiceProcess("reward", *again, grpc_port=grpc_port, http_port=http_port, log_dir=log_dir):
            out, _ = actor.communicate(timeout=timeout)
    finally:
        if actor.poll() is None:
            actor.kill()
    return actor, out, run_dir, first.address


def test_a_reward_server_killed_and_restarted_mid_run_loses_no_step(embedded_cache, log_dir, tmp_path):
    # steps left after the kill: the actor's next Score finds the server gone and retries until it is back
    actor, out, run_dir, _ = run_with_the_reward_restarted(log_dir, tmp_path, 12, pause=1.0)
    assert actor.returncode == 0, out[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    assert "the server is unavailable" in out and "retrying" in out


def test_a_reward_server_restarted_with_another_scorer_stops_the_run(embedded_cache, log_dir, tmp_path):
    """The same address, another reward: a reward server restarted mid-run as a rule scorer in place of its learned
    model was accepted, and the rewards changed meaning from one step to the next. Before every step the actor
    checks that the server still serves what the run started with."""
    actor, out, _, address = run_with_the_reward_restarted(log_dir, tmp_path, 400, "--scorer", "no_negative",
                                                           timeout=120)
    assert actor.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert f"the reward server {address} now serves 'rule:no_negative'" in out, out[-3000:]
    assert "where this run started with 'embedded:reward'" in out, out[-3000:]


@pytest.mark.parametrize("scorer", ["no_negative", "exact_match"])
def test_a_reward_server_restarted_with_another_scorer_within_a_step_stops_before_training_on_it(
        embedded_cache, log_dir, tmp_path, scorer):
    """The reward server dies as it scores the second generation batch of step 2 and comes back as a rule scorer:
    the batch's Score is retried on it, so step 2 held rewards of two meanings. The check at the next step's start
    came one step late: step 2 was trained on and checkpointed as the learned model's. Now the step is checked again
    once its rewards are in, and the run stops before training on it. A scorer that refuses the run's requests
    (exact_match needs labels this data lacks) is named as the restart it is, not only by its refusal."""
    grpc_port, http_port = free_port(), free_port()
    # 16 rows a batch: each generation batch's Score is one call of score_batch (none merged)
    first = ServiceProcess("reward", "batching.max_batch_size=16", grpc_port=grpc_port, http_port=http_port,
                           log_dir=log_dir)
    first.argv[1:3] = [str(ROOT / "tests" / "inject.py"), "reward_server.core:RewardCore.score_batch:4",
                       "reward_server"]
    first.start()
    run_dir = tmp_path / "run"
    actor = start_actor(run_dir, first.address, "ppo.max_num_steps=6", "checkpointing.save_period=1")
    try:
        first.proc.wait(timeout=180)
        with ServiceProcess("reward", "--scorer", scorer, grpc_port=grpc_port, http_port=http_port,
                            log_dir=log_dir):
            out, _ = actor.communicate(timeout=120)
    finally:
        if actor.poll() is None:
            actor.kill()
    assert actor.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert f"the reward server {first.address} now serves 'rule:{scorer}'" in out, out[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]


def test_a_server_away_longer_than_the_bound_ends_the_run_with_a_checkpoint(embedded_cache, log_dir, tmp_path):
    """The reward server dies as it scores step 3's first batch (16 rows a Score: two a step) and stays away. The
    run checkpoints step 2, where step 2 left the data: that checkpoint held step 3's position before (its
    prompts taken, its random numbers drawn), so a resume skipped step 3's prompts."""
    reward = ServiceProcess("reward", "batching.max_batch_size=16", log_dir=log_dir)
    reward.argv[1:3] = [str(ROOT / "tests" / "inject.py"), "reward_server.core:RewardCore.score_batch:5",
                        "reward_server"]
    reward.start()
    run_dir = tmp_path / "run"
    actor = start_actor(run_dir, reward.address, "ppo.max_num_steps=400", "reward.outage_timeout_s=3",
                        "checkpointing.save_period=0")
    try:
        out, _ = actor.communicate(timeout=180)
    finally:
        if actor.poll() is None:
            actor.kill()
        reward.stop()
    assert actor.returncode == 1, out[-3000:]
    assert re.search(rf"reward server {re.escape(reward.address)} Score failed: the server was unavailable",
                     out), out[-3000:]
    assert "reward.outage_timeout_s" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    meta = json.loads((run_dir / "checkpoints" / "step_2" / "checkpoint.json").read_text())
    assert meta["step"] == 2 and meta["consumed_samples"] == rows[-1]["consumed_samples"] == 16


def run_with_the_critic_killed(reward, log_dir, tmp_path, steps: int, *critic_args: str) -> tuple[str, list[dict]]:
    """A PPO run of `steps` steps whose critic (started with `critic_args`) is SIGKILLed after step 3 and started
    again on the same ports with the same arguments; the actor must end with exit 0. Returns its output and its
    metrics rows."""
    grpc_port, http_port = free_port(), free_port()
    args = ("--checkpoint-dir", str(tmp_path / "critic-ckpt"), *critic_args)
    first = ServiceProcess("critic", *args, grpc_port=grpc_port, http_port=http_port, log_dir=log_dir).start()
    run_dir = tmp_path / "run"
    cmd = actor_command("ppo", run_dir, f"reward.address={reward.address}", f"critic.address={first.address}",
                        f"ppo.max_num_steps={steps}", *PPO_RUN, "checkpointing.enabled=false")
    actor = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run_dir, 3, actor)
        first.proc.kill()
        first.proc.wait()
        with ServiceProcess("critic", *args, grpc_port=grpc_port, http_port=http_port, log_dir=log_dir):
            out, _ = actor.communicate(timeout=300)
    finally:
        if actor.poll() is None:
            actor.kill()
    assert actor.returncode == 0, out[-3000:]
    return out, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_critic_killed_mid_run_resumes_from_its_checkpoint_and_the_run_goes_on(reward, log_dir, tmp_path):
    """The critic checkpoints itself after every train step (autosave_every=1) and resumes the latest at start;
    the actor retries the Train in flight (same request id: applied once), notices the restart and goes on. No
    critic step is lost or applied twice: the critic's train step equals the PPO step throughout."""
    out, rows = run_with_the_critic_killed(reward, log_dir, tmp_path, 12, "autosave_every=1")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["critic/train_step"] for r in rows] == [float(r["step"]) for r in rows]
    assert rows[-1]["critic/restarts"] == 1.0
    assert "the critic server" in out and "restarted" in out


def test_a_critic_that_restarts_from_scratch_is_reported_with_the_steps_it_lost(reward, log_dir, tmp_path):
    """Without autosave the restarted critic begins again at train step 0. The actor's Train of the step in flight
    lands on the new process before the step ends; the reply names that process, so the actor counts the restart
    once and reports every step the old process had taken as lost (it counted them against the new process's own
    step before, and said 0 were lost)."""
    out, rows = run_with_the_critic_killed(reward, log_dir, tmp_path, 8)
    assert rows[-1]["critic/restarts"] == 1.0
    last_old = max(r["critic/train_step"] for r in rows if r["critic/restarts"] == 0)
    lost = re.findall(r"it resumed at train step (\d+), the last reply was at (\d+), so (\d+) critic optimizer steps "
                      r"were lost", out)
    assert lost == [("0", str(int(last_old)), str(int(last_old)))], (lost, last_old)


def run_with_a_critic_killed_and_restarted(reward, log_dir, run_dir: Path, kill_before: str,
                                           settings: tuple[str, ...], *overrides: str) -> subprocess.CompletedProcess:
    """An actor run (PPO_RUN and `overrides`) against a critic with `settings` that tests/inject.py SIGKILLs before
    the call `kill_before` names, and that a supervisor then starts again, as it was, on the same ports. The run must
    end with exit 0 after exactly that one restart."""
    critic = ServiceProcess("critic", *settings, log_dir=log_dir)
    plain = list(critic.argv)
    critic.argv[1:3] = [str(ROOT / "tests" / "inject.py"), kill_before, "critic_server"]
    critic.start()
    restarted: list[ServiceProcess] = []

    def supervise() -> None:  # a supervisor bringing it back, on the same ports and checkpoint_dir
        critic.proc.wait(timeout=300)
        again = ServiceProcess("critic", log_dir=log_dir, grpc_port=critic.grpc_port, http_port=critic.http_port)
        again.argv = plain
        restarted.append(again.start())

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        run = subprocess.run(actor_command("ppo", run_dir, f"reward.address={reward.address}",
                                           f"critic.address={critic.address}", *PPO_RUN, *overrides),
                             cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        supervisor.join(timeout=60)
    finally:
        for proc in (critic, *restarted):
            proc.stop()
    assert restarted and run.returncode == 0, run.stderr[-3000:]
    return run


def test_a_critic_that_restarts_as_the_last_checkpoint_is_saved_is_not_paired_with_it(reward, log_dir, tmp_path):
    """The critic (no autosave) dies just before the run's final Save and comes back from the run's start: the Save,
    retried on the new process, wrote a critic at train step 0 under the step's tag, and the run ended with exit 0
    saying nothing, its last checkpoint paired with an untrained critic. Now that checkpoint records the critic as
    unsaved, and the run's last line says so."""
    run_dir = tmp_path / "run"
    # its second Save (the first is the run's start, <run_id>-step_0) kills it, as an OOM or a node loss would
    run = run_with_a_critic_killed_and_restarted(reward, log_dir, run_dir, "critic_server.core:CriticCore.save:2",
                                                 ("--checkpoint-dir", str(tmp_path / "critic-ckpt")),
                                                 "ppo.max_num_steps=2", "checkpointing.save_period=2")
    assert ("restarted before this Save and resumed at train step 0, where this run had left it at 2"
            in run.stderr), run.stderr[-3000:]
    assert not checkpoints.holds_its_critic(run_dir / "checkpoints" / "step_2")
    assert "the critic's Save failed for 1 checkpoint(s) of this run, the last one (step 2) included" in run.stderr


def test_a_critic_restarted_from_a_checkpoint_that_holds_the_step_s_train_lost_nothing(reward, log_dir, tmp_path):
    """The critic (autosave_every=1) dies after it applied and autosaved step 2's Train, before its reply went out,
    and a supervisor brings it back: it resumes that autosave, and the actor's retried Train is answered from its
    stored reply (`repeated`). The actor used to log that it resumed before that Train and lost its steps."""
    run_dir = tmp_path / "run"
    # the second autosave's pruning: step 2's Train is applied and in autosave-2, its reply not yet sent
    run = run_with_a_critic_killed_and_restarted(reward, log_dir, run_dir, "critic_server.core:prune_checkpoints:2",
                                                 ("--checkpoint-dir", str(tmp_path / "critic-ckpt"),
                                                  "autosave_every=1", "autosave_keep=2"),
                                                 "ppo.max_num_steps=3", "checkpointing.save_period=100")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["critic/restarts"] for r in rows] == [0.0, 1.0, 1.0]
    assert (f"after it applied this step's Train: it resumed at train step {int(rows[1]['critic/train_step'])} from a "
            "checkpoint that holds it, so the retried Train was answered from its stored reply and no critic "
            "optimizer steps were lost") in run.stderr, run.stderr[-3000:]
    assert "critic optimizer steps were lost" not in run.stderr.replace("no critic optimizer steps were lost", "")
    steps = [r["critic/train_step"] for r in rows]
    assert steps[2] - steps[1] == steps[1] - steps[0] == steps[0] > 0, steps  # nothing applied twice, or lost


def test_checkpoints_whose_critic_save_failed_resume_only_with_the_critic_where_they_left_it(reward, log_dir, tmp_path):
    """The critic's disk is full (a file size limit of 100 kB, below its weights): every Save fails. The actor keeps
    its own checkpoints, each recording where it left the critic, and the critic leaves no half-written directory.
    A resume against the same critic process, still at that train step, goes on; after the critic restarted (its
    training lost) the resume stops, saying why and what to do, instead of pairing the policy with another critic."""
    ckpt = tmp_path / "critic-ckpt"
    critic = ServiceProcess("critic", "--checkpoint-dir", str(ckpt), log_dir=log_dir,
                            preexec_fn=_file_size_limit(100_000)).start()
    run_dir = tmp_path / "run"

    def actor(steps: int) -> subprocess.CompletedProcess:
        return subprocess.run(actor_command("ppo", run_dir, f"reward.address={reward.address}",
                                            f"critic.address={critic.address}", f"ppo.max_num_steps={steps}", *PPO_RUN,
                                            "checkpointing.save_period=1"),
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)

    try:
        first = actor(2)
        assert first.returncode == 0, first.stderr[-3000:]
        assert "checkpoint of step 2 without the critic" in first.stderr, first.stderr[-3000:]
        assert "RESOURCE_EXHAUSTED: could not write the checkpoint" in first.stderr, first.stderr[-3000:]
        assert "File too large; nothing was saved" in first.stderr, first.stderr[-3000:]
        assert ("the critic's Save failed for 2 checkpoint(s) of this run, the last one (step 2) included"
                in first.stderr), first.stderr[-3000:]  # said last, where an operator reads
        assert list(ckpt.iterdir()) == []  # no .tmp-* left behind
        assert not checkpoints.holds_its_critic(run_dir / "checkpoints" / "step_2")

        again = actor(3)  # the same critic process at the same train step: exact
        assert again.returncode == 0, again.stderr[-3000:]
        assert "is still where that step left it (the same process, train step 2)" in again.stderr
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["critic/train_step"] for r in rows] == [1.0, 2.0, 3.0]
    finally:
        critic.stop()
    critic = ServiceProcess("critic", "--checkpoint-dir", str(ckpt), grpc_port=critic.grpc_port, log_dir=log_dir).start()
    try:
        lost = actor(4)
    finally:
        critic.stop()
    assert lost.returncode == 1 and "Traceback" not in lost.stderr, lost.stderr[-3000:]
    assert (f"{run_dir / 'checkpoints' / 'step_3'} holds no critic checkpoint (the critic's Save failed: "
            in lost.stderr), lost.stderr[-3000:]
    assert "(train step 3 of process" in lost.stderr and "now train step 0 of process" in lost.stderr
    assert "no earlier checkpoint of this run holds its critic: start over (checkpointing.resume=never)" in lost.stderr


def test_a_resume_whose_servers_cannot_take_it_stops_naming_the_way_on(reward, log_dir, tmp_path):
    """Two resumes that would not go on as the run did: the critic's checkpoint of the step is gone (its disk lost),
    so its Load fails (before: the raw NOT_FOUND on every restart, naming neither the checkpoint nor a way on); the
    reward server came back with another scorer while the actor was down too (before: resumed silently, the rewards
    changing meaning; a change while the actor runs was already refused)."""
    run_dir = tmp_path / "run"
    with ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / "ck"), log_dir=log_dir) as critic:
        def actor(steps: int, reward_address: str) -> subprocess.CompletedProcess:
            return subprocess.run(actor_command("ppo", run_dir, f"reward.address={reward_address}",
                                                f"critic.address={critic.address}", f"ppo.max_num_steps={steps}",
                                                *PPO_RUN, "checkpointing.save_period=1"),
                                  cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)

        first = actor(2, reward.address)
        assert first.returncode == 0, first.stderr[-3000:]
        with ServiceProcess("reward", "--scorer", "positive_fraction", log_dir=log_dir) as rule:
            other = actor(3, rule.address)
        assert other.returncode == 1 and "Traceback" not in other.stderr, other.stderr[-3000:]
        assert (f"{run_dir / 'checkpoints' / 'step_2'} was written while the reward server served 'embedded:reward'"
                in other.stderr), other.stderr[-3000:]
        shutil.rmtree(tmp_path / "ck" / f"{(run_dir / 'run_id').read_text().strip()}-step_2")
        lost = actor(3, reward.address)
    assert lost.returncode == 1 and "Traceback" not in lost.stderr, lost.stderr[-3000:]
    assert "cannot return to its checkpoint of that step" in lost.stderr and "NOT_FOUND" in lost.stderr
    assert f"resume from {run_dir / 'checkpoints' / 'step_1'}, the newest earlier checkpoint" in lost.stderr
    # the way on when the critic came back on another checkpoint_dir (a new volume): point it at the old one
    assert f"restart it with --checkpoint-dir {(tmp_path / 'ck').resolve()} (or copy that checkpoint" in lost.stderr


def test_a_critic_that_freezes_behind_its_address_is_replaced_without_waiting_for_the_call_deadline(reward, log_dir,
                                                                                                     tmp_path):
    """The critic's node freezes (SIGSTOP; its connections stay open and swallow everything) and a replacement
    starts behind the same address. The actor's keepalive pings go unanswered, so within keepalive_s +
    keepalive_timeout_s (1 + 1 s here) it drops the dead connection, retries the call in flight on a new one, which
    reaches the replacement, and finishes every step; without pings the call would hang until critic.timeout_s."""
    first = ServiceProcess("critic", "min_ping_interval_s=0.5", log_dir=log_dir).start()
    path = NetworkPath(first.grpc_port)
    run_dir = tmp_path / "run"
    cmd = actor_command("ppo", run_dir, f"reward.address={reward.address}", f"critic.address=127.0.0.1:{path.port}",
                        "ppo.max_num_steps=8", *PPO_RUN, "checkpointing.enabled=false", "critic.keepalive_s=1",
                        "critic.keepalive_timeout_s=1", "critic.timeout_s=240")
    actor = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with ServiceProcess("critic", "min_ping_interval_s=0.5", log_dir=log_dir) as second:
            wait_for_steps(run_dir, 3, actor)
            first.proc.send_signal(signal.SIGSTOP)
            path.fail_over(second.grpc_port)
            froze = time.monotonic()
            out, _ = actor.communicate(timeout=200)
            took = time.monotonic() - froze
    finally:
        if actor.poll() is None:
            actor.kill()
        first.proc.kill()
        first.proc.wait()
        path.close()
    assert actor.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["critic/restarts"] == 1.0 and "restarted" in out, out[-3000:]
    assert took < 30, took  # not critic.timeout_s (240 s)


def test_two_runs_on_one_critic_are_stopped_naming_the_sharing(reward, log_dir, tmp_path):
    """Two actors given the same critic would each train it on their own rollouts, and a resume of one would return
    it to that run's checkpoint under the other. Each run knows the train step its last Train left the critic at;
    a step it did not take, with no restart in between, stops it with a message saying a critic serves one run."""
    with ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / "ck"), log_dir=log_dir) as critic:
        actors = []
        for name in ("a", "b"):
            cmd = actor_command("ppo", tmp_path / name, f"reward.address={reward.address}",
                                f"critic.address={critic.address}", "ppo.max_num_steps=200", *PPO_RUN,
                                "checkpointing.enabled=false")
            actors.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            if name == "a":
                wait_for_steps(tmp_path / name, 2, actors[-1])
        try:
            deadline = time.monotonic() + 120
            while all(a.poll() is None for a in actors) and time.monotonic() < deadline:
                time.sleep(0.1)
            deadline = time.monotonic() + 5  # the other one may be stopping on the same finding
            while any(a.poll() is None for a in actors) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            for a in actors:
                if a.poll() is None:
                    a.kill()
            outs = [a.communicate()[0] for a in actors]
    # one that found the sharing and ended by itself (the other may have been killed while it, too, was stopping)
    stopped = [(a.returncode, out) for a, out in zip(actors, outs) if a.returncode >= 0 and "A critic serves one run" in out]
    assert stopped, outs[0][-2000:] + outs[1][-2000:]
    code, out = stopped[0]
    assert code == 1 and "Traceback" not in out and "another client trained it" in out, out[-2000:]


def _with_another_vocabulary(source, target):
    """A copy of the model at `source` whose tokenizer gives two words each other's ids: the same shapes, other
    token ids."""
    shutil.copytree(source, target)
    path = target / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = [word for word in vocab if word.isalpha()][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tokenizer))
    return target


def _run_with_the_critic_replaced(log_dir, tmp_path, first: list[str], then: list[str], after_steps: int,
                                  *overrides: str) -> tuple[int, str, Path]:
    """A PPO run whose critic (started with `first`) is SIGKILLed after `after_steps` steps and replaced, on the same
    ports, by one started with `then`. Returns the actor's exit code, its output and its run_dir."""
    grpc_port, http_port = free_port(), free_port()
    critic = ServiceProcess("critic", *first, grpc_port=grpc_port, http_port=http_port, log_dir=log_dir).start()
    run_dir = tmp_path / "run"
    cmd = actor_command("ppo", run_dir, f"critic.address={critic.address}", *overrides, "ppo.max_num_steps=200",
                        *PPO_RUN, "checkpointing.save_period=100")
    actor = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run_dir, after_steps, actor)
        critic.proc.kill()
        critic.proc.wait()
        with ServiceProcess("critic", *then, grpc_port=grpc_port, http_port=http_port, log_dir=log_dir):
            out, _ = actor.communicate(timeout=120)
    finally:
        if actor.poll() is None:
            actor.kill()
    return actor.returncode, out, run_dir


def test_a_critic_restarted_with_a_model_of_another_vocabulary_stops_the_run(embedded_assets, reward, log_dir,
                                                                             tmp_path):
    """At start-up a critic whose tokenizer maps words to other ids is refused; the same check now runs on a critic
    that restarts mid-run (it was accepted, and valued every token as another)."""
    other = _with_another_vocabulary(embedded_assets.policy, tmp_path / "other-vocab")
    returncode, out, run_dir = _run_with_the_critic_replaced(
        log_dir, tmp_path, ["--checkpoint-dir", str(tmp_path / "ck")],
        [f"model={other}", "resume=never", "--checkpoint-dir", str(tmp_path / "ck2")], 3,
        f"reward.address={reward.address}")
    assert returncode == 1 and "Traceback" not in out, out[-3000:]
    assert "restarted" in out and "uses a different tokenizer vocabulary than the policy" in out, out[-3000:]
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert _stopped_with_a_checkpoint(out, "a server restarted with a model this run cannot use", done), out[-3000:]


@pytest.mark.parametrize("restarted_with", ["no-reward-model", "another-reward-model"])
def test_a_combined_critic_restarted_with_other_rewards_stops_the_run(embedded_assets, log_dir, tmp_path,
                                                                      restarted_with):
    """A critic that serves the rewards too (reward.source=critic), restarted mid-run without its reward model,
    crashed the actor with a TypeError traceback and no checkpoint; restarted with another reward model, the rewards
    changed meaning mid-run and the run ended with exit 0. Both now stop it, naming what changed."""
    other = reward_model_with_head(embedded_assets, tmp_path / "other-rm", lambda w: w * 2)
    again = [] if restarted_with == "no-reward-model" else ["--reward-model", str(other)]
    returncode, out, run_dir = _run_with_the_critic_replaced(
        log_dir, tmp_path, ["--reward-model", "embedded:reward", "--checkpoint-dir", str(tmp_path / "ck")],
        [*again, "--checkpoint-dir", str(tmp_path / "ck")], 2, "reward.source=critic")
    assert returncode == 1 and "Traceback" not in out, out[-3000:]
    if restarted_with == "no-reward-model":  # found by its first Infer reply, or by the check between steps
        assert ("returned values without rewards: it was restarted without its reward model" in out or
                "restarted serving no rewards (no reward_model), where this run (reward.source=critic) started with "
                "rewards of 'embedded:reward'" in out), out[-3000:]
    else:
        assert (f"restarted serving rewards of '{other}', where this run (reward.source=critic) started with rewards "
                f"of 'embedded:reward'") in out, out[-3000:]
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert _stopped_with_a_checkpoint(out, "a server restarted with a model this run cannot use", done), out[-3000:]


def _stopped_with_a_checkpoint(out: str, why: str, done: int) -> bool:
    """Whether a run that stopped after `done` logged steps said it checkpointed: step `done` (the failure met the
    next step before its policy update), or the next step itself (after it: a restart met by the step's Train)."""
    return (f"{why}: checkpoint of step {done} at" in out
            or f"{why}: checkpoint of step {done + 1} (its policy update done, its critic training unconfirmed" in out)


def reward_model_with_head(embedded_assets, target: Path, change) -> Path:
    """A copy of the embedded reward model at `target` whose score head's weight is `change(weight)`."""
    shutil.copytree(embedded_assets.reward_model, target)
    weights = load_file(target / "model.safetensors")
    weights["score.weight"] = change(weights["score.weight"])
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_reward_model_that_returns_nan_stops_the_run_naming_it(embedded_assets, log_dir, tmp_path):
    """A reward model whose weights went NaN: its rewards would make every policy loss non-finite, so each optimizer
    step was skipped and the run ended with exit 0 having trained nothing (with a critic, the critic refused the
    returns and the error named the critic). The run stops at the first such batch, naming the reward server."""
    diverged = reward_model_with_head(embedded_assets, tmp_path / "nan-rm", lambda w: torch.full_like(w, float("nan")))
    with ServiceProcess("reward", f"model={diverged}", log_dir=log_dir) as reward:
        run = subprocess.run(actor_command("grpo", tmp_path / "run", f"reward.address={reward.address}",
                                           f"critic.address=127.0.0.1:{free_port()}", *RUN, "ppo.max_num_steps=3"),
                             cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert (f"error: the reward server {reward.address} returned rewards that are NaN or infinite for 32 of 32 "
            f"samples") in run.stderr, run.stderr[-3000:]


def test_a_run_whose_every_critic_step_is_skipped_stops_after_three_steps(embedded_assets, log_dir, tmp_path):
    """Rewards huge but finite (a reward model gone wrong: 1e35 and more) make every critic loss non-finite (and at
    larger ones every policy loss); each optimizer step is skipped, which keeps the weights, but the run went on to
    its end having trained nothing (exit 0). After three such steps in a row it stops, saying what the rewards
    were."""
    wrong = reward_model_with_head(embedded_assets, tmp_path / "huge-rm", lambda w: w * 1e35)
    with ServiceProcess("reward", f"model={wrong}", log_dir=log_dir) as reward, \
            ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / "ck"), log_dir=log_dir) as critic:
        def actor() -> subprocess.CompletedProcess:
            return subprocess.run(actor_command("ppo", tmp_path / "run", f"reward.address={reward.address}",
                                                f"critic.address={critic.address}", *PPO_RUN, "ppo.max_num_steps=20",
                                                "checkpointing.save_period=1"),
                                  cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)

        run = actor()
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
        assert "error: 3 steps in a row took no critic optimizer step" in run.stderr, run.stderr[-3000:]
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["critic/train_step"] for r in rows] == [0.0, 0.0], rows
        # the count is part of the checkpoint: a resume stops after the same third step (it started again at 0,
        # and the resumed run trained two more steps of nothing before it stopped)
        state = json.loads((tmp_path / "run" / "checkpoints" / "step_2" / "trainer_state.json").read_text())
        assert state["stalled_steps"] == 2
        again = actor()
    assert again.returncode == 1 and "error: 3 steps in a row took no critic optimizer step" in again.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def _file_size_limit(limit: int):
    """For the child: files may grow to `limit` bytes, past which a write fails with EFBIG, as on a full disk."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_run_that_cannot_write_its_files_stops_with_one_line_saying_so(reward, tmp_path):
    """A full disk under run_dir (here a file size limit of 2000 bytes, which the first metrics row passes) stopped
    the actor with chained tracebacks; it now stops with one line naming run_dir and how to go on. TensorBoard's
    writer thread, which meets the full disk too, no longer prints its own traceback before that line."""
    run = subprocess.run(actor_command("grpo", tmp_path / "run", f"reward.address={reward.address}",
                                       f"critic.address=127.0.0.1:{free_port()}", *RUN, "ppo.max_num_steps=3"),
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                         preexec_fn=_file_size_limit(2000))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"error: cannot write the run's files under {tmp_path / 'run'}: [Errno 27] File too large" in run.stderr, \
        run.stderr[-3000:]


def test_a_run_whose_checkpoints_cannot_be_written_stops_with_one_line_saying_so(reward, tmp_path):
    """A checkpoints directory the actor may not write (read-only; as root, under setpriv without the capability
    that overrides file modes) stopped it with a PermissionError traceback; now one line names run_dir and the way
    on, as for a full disk."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    checkpoints.chmod(0o555)
    cmd = actor_command("grpo", tmp_path / "run", f"reward.address={reward.address}", *RUN, "ppo.max_num_steps=1")
    if os.geteuid() == 0:
        cmd = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
               "--bounding-set=-dac_override,-dac_read_search", *cmd]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    checkpoints.chmod(0o755)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"error: cannot write the run's files under {tmp_path / 'run'}: [Errno 13] Permission denied" in run.stderr
    assert "make it writable and start the same command again" in run.stderr


def _actor_with_its_own_servers(log_dir, tmp_path, http_port: int):
    critic = ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / "critic-ckpt"), log_dir=log_dir).start()
    reward = ServiceProcess("reward", log_dir=log_dir).start()
    run_dir = tmp_path / "run"
    cmd = actor_command("ppo", run_dir, f"reward.address={reward.address}", f"critic.address={critic.address}",
                        "ppo.max_num_steps=500", *PPO_RUN, http_port=http_port)
    log = tmp_path / "actor.log"
    with open(log, "wb") as out:
        actor = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return critic, reward, actor, run_dir, log


def _ready_or_gone(http_port: int, actor: subprocess.Popen) -> int | None:
    """The actor's /ready status, or None when nothing answers any more because the actor is exiting (SIGTERM
    landed as its step was ending: it checkpoints and goes in well under a second)."""
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=5).status_code
    except httpx.TransportError:
        actor.wait(timeout=30)
        return None


def test_an_actor_stopped_with_its_servers_ends_within_a_grace_period(embedded_cache, log_dir, tmp_path):
    """A pod deletion or `docker compose down` sends SIGTERM to every service at once: the servers drain and exit
    in a second, and the actor, finishing its step, finds them gone. It is not ready from the signal on, waits for
    them at most clients.DRAIN_OUTAGE_S (not outage_timeout_s, 300 s) and keeps its last complete step's
    checkpoint."""
    http_port = free_port()
    critic, reward, actor, run_dir, log = _actor_with_its_own_servers(log_dir, tmp_path, http_port)
    try:
        wait_for_steps(run_dir, 1, actor)
        signalled = time.monotonic()
        for proc in (critic.proc, reward.proc, actor):
            proc.send_signal(signal.SIGTERM)
        assert _ready_or_gone(http_port, actor) in (503, None)
        actor.wait(timeout=60)
        elapsed = time.monotonic() - signalled
    finally:
        for proc in (critic, reward):
            proc.stop()
        if actor.poll() is None:
            actor.kill()
    out = log.read_text()
    assert "SIGTERM: finishing the step in progress" in out and "Traceback" not in out, out[-3000:]
    assert actor.returncode in (0, 1) and elapsed < 30, (actor.returncode, elapsed, out[-3000:])
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    if f"checkpoint of step {done + 1} (its policy update done" in out:  # the signal came while the next step
        done += 1  # waited for the critic's Train, after its policy update: checkpointed as itself, without its row
    assert json.loads((run_dir / "checkpoints" / f"step_{done}" / "checkpoint.json").read_text())["step"] == done


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain", "second-sigterm"])
def test_an_actor_stopped_while_it_waits_for_its_servers(embedded_cache, log_dir, tmp_path, second_signal):
    """The servers are gone and the actor is retrying its call (outage_timeout_s would let it wait 300 s) when
    SIGTERM comes: /ready answers 503 at once, the outage is waited out for at most clients.DRAIN_OUTAGE_S from
    its start, and the run ends with its last complete step's checkpoint, exit 1 naming the drain; a second
    SIGTERM ends it at once (exit 128 + 15), without a traceback."""
    http_port = free_port()
    critic, reward, actor, run_dir, log = _actor_with_its_own_servers(log_dir, tmp_path, http_port)
    try:
        wait_for_steps(run_dir, 1, actor)
        critic.stop()
        reward.stop()
        deadline = time.monotonic() + 120
        while "the server is unavailable" not in log.read_text():
            assert actor.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        signalled = time.monotonic()
        actor.send_signal(signal.SIGTERM)
        assert httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=5).status_code == 503
        if second_signal:
            actor.send_signal(signal.SIGTERM)
        actor.wait(timeout=60)
        elapsed = time.monotonic() - signalled
    finally:
        if actor.poll() is None:
            actor.kill()
    out = log.read_text()
    assert "SIGTERM: finishing the step in progress" in out and "Traceback" not in out, out[-3000:]
    if second_signal:
        assert actor.returncode == 128 + signal.SIGTERM and "stopped at once by a second SIGTERM" in out, out[-3000:]
        assert elapsed < 5, elapsed  # not the drain's wait for the servers
        return
    assert actor.returncode == 1 and "while the actor was stopping (SIGTERM)" in out, out[-3000:]
    assert elapsed < DRAIN_OUTAGE_S + 5, elapsed
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    # the last finished step's checkpoint; or, when the outage met the step after its policy update (waiting for
    # the critic's Train), that step's, which says its critic training is unconfirmed
    (last,) = checkpoints.complete_checkpoints(run_dir / "checkpoints")[-1:]
    step = json.loads((last / "checkpoint.json").read_text())["step"]
    assert step == done or (step == done + 1 and "its critic training unconfirmed" in out), (step, done, out[-3000:])


def test_calls_that_meet_a_critic_restart_are_retried_until_they_succeed(embedded_cache, log_dir, caplog):
    """A critic restarted (SIGTERM, then the same command on the same port) while the actor's calls keep coming:
    a call that reaches it while it drains gets UNAVAILABLE, and one that reaches it in its last instant gets
    CANCELLED from gRPC itself (the server cancels what it has not handed to a handler). The actor never cancels
    its own calls, so its client retries both for an idempotent call: every call returns values."""
    grpc_port, http_port = free_port(), free_port()
    client = CriticClient(RemoteConfig(address=f"127.0.0.1:{grpc_port}", outage_timeout_s=120))
    tokens = torch.randint(3, 50, (4, 32))
    lengths = torch.full((4,), 32)
    stop, failures, answered = threading.Event(), [], []

    def keep_calling():
        while not stop.is_set():
            try:
                values, _ = client.infer(tokens, lengths).result()
                answered.append(values.shape == (4, 32))
            except Exception as e:  # noqa: BLE001 - what the test looks for
                failures.append(repr(e))

    server = ServiceProcess("critic", grpc_port=grpc_port, http_port=http_port, log_dir=log_dir).start()
    callers = [threading.Thread(target=keep_calling) for _ in range(3)]
    try:
        with caplog.at_level(logging.WARNING, logger="actor.clients"):
            for t in callers:
                t.start()
            for _ in range(2):
                time.sleep(1.0)
                assert server.terminate() == 0
                server = ServiceProcess("critic", grpc_port=grpc_port, http_port=http_port, log_dir=log_dir).start()
            before = len(answered)
            while len(answered) < before + 10:
                assert not failures, failures[:3]
                time.sleep(0.05)
    finally:
        stop.set()
        for t in callers:
            t.join(timeout=120)
        server.stop()
        client.close()
    assert not failures, failures[:3]
    assert all(answered)
    assert "retrying in" in caplog.text  # the restarts were met


class _ShuttingDownOnce(critic_pb2_grpc.CriticServiceServicer):
    """Fault injection: answers its first Infer as a critic in the last instant of its shutdown does (CANCELLED,
    which on a real restart depends on timing), and its first Save and Load as a critic killed mid-call, then as a
    working one."""

    def __init__(self):
        self.calls, self.trains, self.saves, self.loads = 0, 0, 0, 0

    def Train(self, request, context):
        self.trains += 1
        context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    def Infer(self, request, context):
        self.calls += 1
        if self.calls == 1:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        values = torch.zeros(decode(request.tokens, "tokens").shape, dtype=torch.float32)
        return critic_pb2.InferResponse(values=encode(values))

    def Save(self, request, context):  # a critic killed while it saves: the connection breaks
        self.saves += 1
        if self.saves == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")
        return critic_pb2.SaveResponse(path=f"/ck/{request.tag}", train_step=4)

    def Load(self, request, context):
        self.loads += 1
        if self.loads == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")
        return critic_pb2.LoadResponse(path=f"/ck/{request.tag}", train_step=4)


def test_an_idempotent_call_the_server_cancels_is_retried_and_a_train_without_request_id_is_not(caplog):
    servicer = _ShuttingDownOnce()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    critic_pb2_grpc.add_CriticServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = CriticClient(RemoteConfig(address=f"127.0.0.1:{port}", outage_timeout_s=30))
    try:
        with caplog.at_level(logging.WARNING, logger="actor.clients"):
            values, _ = client.infer(torch.ones(2, 3, dtype=torch.long), torch.full((2,), 3)).result()
        assert values.shape == (2, 3) and servicer.calls == 2
        assert "(the call was cancelled by the server as it shut down); retrying" in caplog.text
        # Save and Load are idempotent too: a critic killed during the actor's checkpoint no longer leaves the
        # checkpoint without the critic that is back seconds later at the same step
        assert client.save("run-step_4") == ("/ck/run-step_4", 4) and client.load("run-step_4") == ("/ck/run-step_4", 4)
        assert "the server closed the connection: it stopped or restarted" in caplog.text
        with pytest.raises(RemoteError, match="Save failed: UNAVAILABLE"):  # unless told not to wait
            servicer.saves = 0
            client.save("run-step_5", retry=False)
        # a call that is not idempotent (a Train without a request id) is not started twice
        with pytest.raises(RemoteError, match="Train failed: CANCELLED"):
            client.train(*(torch.ones(1, 3),) * 5, value_clip=0.2, loss_scale=1.0).result()
        assert servicer.trains == 1
    finally:
        client.close()
        server.stop(0)


def _comparable(row: dict) -> dict:
    """A metrics row without what legitimately differs between two runs of the same steps (wall-clock times)."""
    return {k: v for k, v in row.items() if not k.startswith("timers/")}


def test_an_actor_killed_and_resumed_continues_exactly_as_an_uninterrupted_run(reward, log_dir, tmp_path):
    """SIGKILL the actor mid-run and start the same command again: it resumes from its latest checkpoint (policy,
    optimizer, data position, random states, KL coefficient; the critic returns to its checkpoint of that step),
    and every step's metrics equal those of a run that was never interrupted. A metrics row cut off by the kill is
    left out with a warning (the resume crashed on it before). Killed before its first checkpoint, the run starts
    again with the critic returned to where the run first found it: before, the critic kept the dead attempt's
    training and refused the new step 1 under the run's request id, so the same command failed on every start."""
    overrides = ["ppo.max_num_steps=12", "checkpointing.save_period=4", *PPO_RUN, "ppo.kl_controller.type=adaptive"]

    def command(run_dir, critic, reward) -> list[str]:
        return actor_command("ppo", run_dir, f"critic.address={critic.address}", f"reward.address={reward.address}",
                             *overrides)

    with ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / "ck-a"), log_dir=log_dir) as critic:
        whole = subprocess.run(command(tmp_path / "a", critic, reward), check=False, cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        assert whole.returncode == 0, whole.stderr[-3000:]
    with ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / "ck-b"), log_dir=log_dir) as critic:
        for steps in (2, 6):  # before the first checkpoint (save_period 4), then after it
            first = subprocess.Popen(command(tmp_path / "b", critic, reward), cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
            try:
                wait_for_steps(tmp_path / "b", steps, first)
            finally:
                first.kill()
                out = first.communicate()[0]
            if steps == 6:
                assert "starts again at step 1 (no checkpoint of it is complete): the critic returned to" in out, \
                    out[-3000:]
        # as if the kill (or a full disk) had cut the last row while it was written
        written = tmp_path / "b" / "metrics.jsonl"
        written.write_text(written.read_text()[:-40])
        again = subprocess.run(command(tmp_path / "b", critic, reward), check=False, cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after step" in again.stderr and "the critic returned to" in again.stderr
    assert "not a whole metrics row (cut off by a crash?)" in again.stderr
    a = [_comparable(json.loads(line)) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [_comparable(json.loads(line)) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, 13))
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (ra["step"], key)


def test_checkpoint_must_save_by_checkpoints_and_stops(reward, tmp_path):
    run = subprocess.run(actor_command("grpo", tmp_path / "run", f"reward.address={reward.address}",
                                       f"critic.address=127.0.0.1:{free_port()}", *RUN, "ppo.max_num_steps=50",
                                       "checkpointing.checkpoint_must_save_by=00:00:00:01",
                                       "checkpointing.save_period=0"),
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert 1 <= steps < 50
    assert (tmp_path / "run" / "checkpoints" / f"step_{steps}" / "trainer_state.json").is_file()
    assert "checkpoint_must_save_by" in run.stdout + run.stderr


def test_an_infer_reply_without_the_rewards_a_run_needs_names_the_restart():
    """A combined critic restarted without its reward model can answer the step's own Infer before the check
    between steps sees it: the reply's missing rewards stop the run naming why (a TypeError traceback before)."""
    from actor.clients import IncompatibleServer
    from actor.rollouts import critic_rewards

    values, rewards = torch.zeros(2, 3), torch.ones(2)
    assert critic_rewards((values, rewards))[0] is rewards
    with pytest.raises(IncompatibleServer, match="restarted without its reward model"):
        critic_rewards((values, None))


def test_a_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(reward, tmp_path):
    """`checkpointing.resume=step_2` in a run that reached step 4: the run goes on from step 2, and its steps 3 and 4
    are the new attempt's. The old attempt's step_3 and step_4 stayed where an automatic resume looks, so a crash
    after the new step 3 resumed from the old step 4, with metrics.jsonl holding the new attempt's rows. They are
    moved to checkpoints/abandoned/<time>/ now, and so is every checkpoint of a run that starts over."""
    run_dir = tmp_path / "run"

    def actor(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(actor_command("grpo", run_dir, f"reward.address={reward.address}",
                                            f"critic.address=127.0.0.1:{free_port()}", *RUN,
                                            "checkpointing.save_period=1", *overrides),
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)

    assert actor("ppo.max_num_steps=4").returncode == 0
    old_step_4 = (run_dir / "checkpoints" / "step_4" / "trainer_state.json").read_text()
    again = actor("ppo.max_num_steps=3", "checkpointing.resume=step_2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the checkpoints of steps after 2 (step_3, step_4) belong to the attempt this run resumed before" in \
        again.stderr, again.stderr[-3000:]
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_2", "step_3"]
    (aside,) = (root / "abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["step_3", "step_4"]
    assert (aside / "step_4" / "trainer_state.json").read_text() == old_step_4
    later = actor("ppo.max_num_steps=3")  # an automatic resume finds the new attempt's last step
    assert later.returncode == 0 and "nothing to train: the run resumed after step 3" in later.stdout + later.stderr
    over = actor("ppo.max_num_steps=1", "checkpointing.resume=never")
    assert over.returncode == 0 and "belong to the attempt this run started over from" in over.stderr
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1"]


def test_a_server_that_accepts_but_never_answers_is_not_called_another_kind_of_server():
    """A frozen server (SIGSTOP) still has its socket accepted by the kernel; gRPC gives up waiting for its HTTP/2
    settings. The retry lines called it 'not a gRPC server', sending an operator after the wrong port."""
    from actor.clients import unreachable_reason

    class Frozen(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:5555: HTTP2 connection " \
                   "timed out before receiving SETTINGS frame"

    reason = unreachable_reason(Frozen())
    assert reason.startswith("the server accepted the connection but did not answer it: it is frozen or overloaded")


def test_a_step_that_fails_after_its_policy_update_is_checkpointed_as_that_step(reward, log_dir, tmp_path):
    """The critic dies as its third Train arrives and stays away past critic.outage_timeout_s: step 3's policy update
    is done, its critic training never confirmed. The run used to checkpoint 'step 2' holding step 3's weights and
    data position (a resume then skipped a step's prompts); now it checkpoints step 3, saying the critic's training
    is unconfirmed, and a resume against the critic restarted from its autosave (which never took that Train) goes
    on, saying so. Its checkpoint holds the adaptive KL coefficient after step 3's update (it held step 2's: the
    update came after the critic's reply)."""
    ckpt, run_dir = tmp_path / "critic-ckpt", tmp_path / "run"
    critic = ServiceProcess("critic", "--checkpoint-dir", str(ckpt), "autosave_every=1", log_dir=log_dir)
    ports = (critic.grpc_port, critic.http_port)
    critic.argv[1:3] = [str(ROOT / "tests" / "inject.py"), "critic_server.core:CriticCore.apply_train:3",
                        "critic_server"]
    critic.start()

    def actor(steps: int) -> subprocess.CompletedProcess:
        return subprocess.run(actor_command("ppo", run_dir, f"reward.address={reward.address}",
                                            f"critic.address={critic.address}", f"ppo.max_num_steps={steps}",
                                            *PPO_RUN, "checkpointing.save_period=100", "critic.outage_timeout_s=3",
                                            "ppo.kl_controller.type=adaptive", "ppo.kl_controller.target=0.01",
                                            "ppo.kl_controller.horizon=100"),
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)

    try:
        first = actor(4)
    finally:
        critic.stop()
    assert first.returncode == 1, first.stderr[-3000:]
    out = first.stdout + first.stderr
    assert "checkpoint of step 3 (its policy update done, its critic training unconfirmed" in out, out[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    state = json.loads((run_dir / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["critic_unsaved"]["train_unconfirmed"] and state["consumed_samples"] == 3 * 8
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after_2 = adaptive_kl_coef(rows[1]["train_rollouts/kl_coef"], rows[1]["train_rollouts/init_policy_kl"], 0.01, 100, 8)
    assert state["kl_coef"] != pytest.approx(after_2, rel=1e-9, abs=0), (state["kl_coef"], after_2)
    with ServiceProcess("critic", "--checkpoint-dir", str(ckpt), "autosave_every=1", grpc_port=ports[0],
                        http_port=ports[1], log_dir=log_dir):
        again = actor(4)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "never took that step's training" in again.stderr and "resuming after step 3" in again.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 4]
    assert rows[2]["train_rollouts/kl_coef"] == pytest.approx(state["kl_coef"], rel=1e-6)
