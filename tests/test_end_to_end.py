"""The whole system: real critic and reward servers as subprocesses, the actor as `python -m actor`."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from actor import checkpoints
from ppo_services.v1 import common_pb2, critic_pb2, critic_pb2_grpc
from serving.codec import decode, encode
from serving.modeling import last_token_scores, load_scalar_head_model, per_token_scores
from tests.grpc_helpers import channel
from tests.service_procs import ROOT, ServiceProcess, actor_command, free_port

REQUIRED = ["step", "train_rollouts/rewards", "train_rollouts/init_policy_kl", "train_optim/loss", "critic/loss",
            "timers/rollout_time", "timers/generate", "timers/logprobs", "timers/init_logprobs", "timers/critic_wait",
            "timers/train_time"]
TWO_STEPS = ["ppo.max_num_steps=2", "checkpointing.save_period=0", "ppo.val_period=0", "ppo.num_prompts_per_step=16",
             "policy.generation_batch_size=8", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
             "logger.num_val_samples_to_print=2"]


def run_actor(run_dir, *overrides: str, http_port: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(actor_command("ppo", run_dir, *TWO_STEPS, *overrides, http_port=http_port), check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def servers(embedded_cache, log_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("critic-ckpt")
    with ServiceProcess("critic", "--checkpoint-dir", str(ckpt), log_dir=log_dir) as critic, \
            ServiceProcess("reward", "components=[positive_fraction]", log_dir=log_dir) as reward:
        yield critic, reward


def test_actor_trains_two_steps_and_writes_metrics_and_checkpoints(servers, tmp_path):
    critic, reward = servers
    port = free_port()
    run_dir = tmp_path / "run"
    cmd = actor_command("ppo", run_dir, *TWO_STEPS, f"critic.address={critic.address}", f"reward.address={reward.address}",
                        http_port=port, reward_curve=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready_seen = False
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                ready_seen = "ppo_actor_step" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert ready_seen, "the actor's /ready and /metrics never answered while it trained"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in REQUIRED:
        assert all(key in r for r in rows), key
    assert 0.0 <= rows[0]["train_rollouts/rewards"] <= 1.0
    assert "train_rollouts/reward/positive_fraction" in rows[0]
    for r in rows:  # the decode work of the step's generation, eager (no policy.generation.compile)
        assert r["generation/decode_steps"] > 0 and r["generation/compiled_steps"] == 0
        assert r["generation/decode_steps"] <= r["generation/row_steps"] <= \
            r["generation/decode_steps"] * r["train_rollouts/rollout_size"]
    assert rows[1]["critic/train_step"] > rows[0]["critic/train_step"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert "samples before training" in out and "samples after training" in out
    # eager float32 on a CPU: the reference's log-prob passes compute through prepacked weights, and say so
    assert "policy.generation.prepack_weights=true: the log-prob passes compute through linear weights prepacked" in out

    meta = json.loads((run_dir / "checkpoints" / "step_2" / "checkpoint.json").read_text())
    actor = AutoModelForCausalLM.from_pretrained(meta["actor"])
    assert actor.config.vocab_size > 0
    critic_model = AutoModelForSequenceClassification.from_pretrained(meta["critic"])
    assert critic_model.config.num_labels == 1
    assert not list((run_dir / "checkpoints").glob("tmp_*"))


def test_actor_fails_clearly_when_the_critic_is_unreachable(servers, tmp_path):
    _, reward = servers
    dead = f"127.0.0.1:{free_port()}"
    result = run_actor(tmp_path / "run", f"critic.address={dead}", "critic.connect_timeout_s=4",
                       f"reward.address={reward.address}", timeout=120)
    assert result.returncode == 1
    assert f"cannot reach the critic server at {dead}" in result.stderr and "critic.address" in result.stderr
    assert "connection refused" in result.stderr
    assert f"waiting for the critic server at {dead}: connection refused" in result.stderr  # logged while waiting


def test_actor_pointed_at_an_http_port_says_it_is_no_grpc_server(servers, tmp_path):
    critic, reward = servers
    wrong = f"127.0.0.1:{reward.http_port}"
    start = time.monotonic()
    result = run_actor(tmp_path / "run", f"critic.address={critic.address}", f"reward.address={wrong}",
                       "reward.connect_timeout_s=60", timeout=120)
    assert result.returncode == 1
    assert f"reward server {wrong}" in result.stderr and "not a gRPC server" in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - start < 45, "an HTTP port is reported at once, not after the whole connect timeout"


def test_actor_rejects_a_bad_config_key_naming_it(tmp_path):
    result = run_actor(tmp_path / "run", "ppo.adv_estimator.gae_gama=0.9", timeout=60)
    assert result.returncode == 2
    assert "ppo.adv_estimator.gae_gama" in result.stderr and "gae_gamma" in result.stderr
    result = run_actor(tmp_path / "run", "ppo.kl_controller.kl_type=k9", timeout=60)
    assert result.returncode == 2 and "ppo.kl_controller.kl_type" in result.stderr and "'k1'" in result.stderr


def test_combined_reward_and_critic_server(embedded_cache, embedded_assets, log_dir, tmp_path):
    """NeMo-Aligner's default layout: one server gives values and rewards; the actor trains against it."""
    with ServiceProcess("critic", "--reward-model", "embedded:reward", "--checkpoint-dir", str(tmp_path / "ckpt"),
                        log_dir=log_dir) as critic:
        ch = channel(critic.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).serves_rewards
        tokens = torch.randint(4, 20, (3, 9), generator=torch.Generator().manual_seed(0))
        lengths = torch.tensor([9, 5, 7])
        reply = stub.Infer(critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths)), timeout=60)
        rm = load_scalar_head_model(str(embedded_assets.reward_model)).eval()
        with torch.no_grad():
            expected = last_token_scores(per_token_scores(rm, tokens, lengths), lengths)
        torch.testing.assert_close(decode(reply.rewards, "rewards"), expected, atol=1e-5, rtol=1e-5)
        ch.close()

        result = run_actor(tmp_path / "run", f"critic.address={critic.address}", "reward.source=critic")
        assert result.returncode == 0, result.stdout + result.stderr
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all("critic/loss" in r for r in rows)


def test_actor_sigterm_finishes_the_step_checkpoints_and_exits_zero(servers, tmp_path):
    critic, reward = servers
    run_dir = tmp_path / "run"
    cmd = actor_command("ppo", run_dir, *TWO_STEPS, "ppo.max_num_steps=500", f"critic.address={critic.address}",
                        f"reward.address={reward.address}")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert 1 <= len(steps) < 500
    meta = json.loads((run_dir / "checkpoints" / f"step_{steps[-1]}" / "checkpoint.json").read_text())
    assert meta["step"] == steps[-1] and "SIGTERM" in out


def test_an_actor_started_before_its_servers_waits_for_them(embedded_cache, log_dir, tmp_path):
    critic_port, reward_port = free_port(), free_port()
    run_dir = tmp_path / "run"
    cmd = actor_command("ppo", run_dir, *TWO_STEPS, f"critic.address=127.0.0.1:{critic_port}",
                        f"reward.address=127.0.0.1:{reward_port}", "critic.connect_timeout_s=180",
                        "reward.connect_timeout_s=180")
    actor = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2)
        assert actor.poll() is None, actor.communicate()[0]
        with ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / "ckpt"), grpc_port=critic_port,
                            log_dir=log_dir), ServiceProcess("reward", grpc_port=reward_port, log_dir=log_dir):
            out, _ = actor.communicate(timeout=300)
    finally:
        if actor.poll() is None:
            actor.kill()
    assert actor.returncode == 0, out
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (run_dir / "reward_curve.png").exists()  # logger.reward_curve_enabled=false (actor_command)


def test_a_checkpoint_metric_the_run_does_not_log_stops_it_after_the_checkpoint(servers, tmp_path):
    """keep_top_k ranks checkpoints by checkpointing.metric_name; a name no step logs ranked them all last and kept
    the oldest. The first checkpoint of a step with validation finds it missing: the checkpoint is written, the run
    stops with exit 2 listing the names it logs. NeMo-RL's `val:accuracy` is the mean validation reward."""
    _, reward = servers
    run_dir = tmp_path / "run"
    cmd = actor_command("grpo", run_dir, *TWO_STEPS, "ppo.max_num_steps=1", "ppo.val_at_end=true",
                        "ppo.max_val_samples=4", "ppo.val_batch_size=4", "checkpointing.keep_top_k=1",
                        "checkpointing.metric_name=val/reward", f"reward.address={reward.address}")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "checkpointing.metric_name=val/reward is none of the metrics this run logs" in done.stderr
    assert "val/rewards" in done.stderr and (run_dir / "checkpoints" / "step_1" / "checkpoint.json").exists()
    state = json.loads((run_dir / "checkpoints" / "step_1" / checkpoints.STATE_FILE).read_text())
    assert state["metric"] is None and state["config"]["checkpointing"]["metric_name"] == "val/reward"


def test_a_diverging_update_stops_the_run_with_an_error_saying_so(servers, tmp_path):
    """A learning rate far too large: the run stops with an error saying the policy diverged, not with a torch
    traceback from the next step's sampling, and no checkpoint holds non-finite weights. An infinite learning rate
    is a config error."""
    _, reward = servers
    run_dir = tmp_path / "run"
    cmd = actor_command("grpo", run_dir, *TWO_STEPS, "ppo.max_num_steps=6", "checkpointing.save_period=1",
                        "policy.optimizer.kwargs.lr=1e30", "ppo.overlong_filtering=false",
                        f"reward.address={reward.address}")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    # the weights overflow in the update (stopped before they are saved) or stay finite but huge (stopped at the
    # sampling they break)
    assert ("error: the policy's weights are not finite after this step's update (policy.optimizer.kwargs.lr=1e+30"
            in done.stderr or "error: sampling met next-token probabilities that are not finite" in done.stderr)
    for saved in (run_dir / "checkpoints").glob("step_*"):
        model = AutoModelForCausalLM.from_pretrained(saved / "actor")
        assert all(bool(torch.isfinite(w).all()) for w in model.parameters()), saved
    done = subprocess.run([*cmd[:cmd.index("policy.optimizer.kwargs.lr=1e30")], "policy.optimizer.kwargs.lr=inf"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "policy.optimizer.kwargs.lr" in done.stderr, done.stderr[-2000:]
