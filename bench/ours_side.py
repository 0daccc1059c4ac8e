"""Our side of `bench.trl_ppo`: critic_server and reward_server started as processes on the bench models (the same
`python -m` commands as actor/demo.py and the containers), then `python -m actor` with overrides that make one of
our steps the same work as one TRL step; step times and per-phase timers are read from the run's metrics.jsonl.

The settings that match TRL's (bench/trl_side.py): `batch` prompts per step, one sample each; ppo_epochs passes,
each one optimizer step over the whole batch (train_global_batch_size = batch) micro-batched by micro_batch; GAE
(gamma 1, lambda 0.95) on the critic's values, advantages whitened; the KL to the reference (same weights) in the
reward as TRL does it: k1, not absolute, beta 0.05 (TRL's kl_coef default); value loss clipped at 0.2 and scaled
by 0.1 (TRL's vf_coef); temperature 1, no top-k/top-p; fp32 on the CPU (or --device/--precision of
bench.trl_ppo, for all three processes); no validation, checkpoints or TensorBoard.
Samples that did not stop at EOS still get their policy gradient (ppo.overlong_filtering=false): TRL has no such
filter, and in W1/W2 no sample stops. The critic trains `epochs` passes per step (critic.ppo_epochs), as TRL's
value model trains in every PPO epoch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from actor.demo import NotReady, free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class OursRun:
    steps: list[dict[str, float]]  # per step: every timers/* key (seconds), plus response length and critic time
    skipped_keys: list[str] = field(default_factory=list)  # actor keys this checkout lacks (left at their default)


def actor_keys(python: str) -> set[str]:
    """Dotted keys of ActorConfig in this checkout (the lead adds keys while this bench is written)."""
    code = ("import json\nfrom pydantic import BaseModel\nfrom actor.config import ActorConfig\n"
            "def walk(m, p=''):\n"
            "    for k, f in m.model_fields.items():\n"
            "        a = f.annotation\n"
            "        if isinstance(a, type) and issubclass(a, BaseModel): yield from walk(a, p + k + '.')\n"
            "        else: yield p + k\n"
            "print(json.dumps(sorted(walk(ActorConfig))))")
    out = subprocess.run([python, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


class Service:
    def __init__(self, name: str, argv: list[str], log: Path, http_port: int, env: dict[str, str]):
        self.name, self.http_port, self.log = name, http_port, log
        self._log = open(log, "wb")  # noqa: SIM115 - held for the process lifetime
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        try:
            wait_ready(self.proc, f"http://127.0.0.1:{self.http_port}/ready", timeout)
        except NotReady as e:
            raise RuntimeError(f"{self.name} server {e}:\n{self.tail()}") from None

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def run_ours(*, python: str, models: Path, work: Path, batch: int, micro_batch: int, response_length: int,
             epochs: int, steps: int, stop_eos: bool, threads: tuple[int, ...], generation_batch: int,
             logprob_batch: int, lr: float = 1e-5, seed: int = 42, compile_: bool = False,
             compile_decode: bool = False, device: str = "cpu", precision: str = "float32",
             cuda_graphs: bool = False) -> OursRun:
    """One run of our actor with its two servers; `threads` = (actor, critic, reward[, actor while the servers
    compute]) torch threads (the last: the actor's num_threads_shared, default its num_threads). `compile_`: every
    model pass and the decode step compiled (policy.compile, policy.generation.compile; the critic and reward
    servers' compile); `compile_decode`: only the decode step (policy.generation.compile); `cuda_graphs`: the decode
    step compiled and replayed as CUDA graphs (policy.generation.cuda_graphs). `device` and
    `precision`: every model of the three (cuda: all on cuda:0)."""
    from bench.trl_models import Assets

    assets = Assets(models)
    work.mkdir(parents=True, exist_ok=True)
    keys = actor_keys(python)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    actor_threads, critic_threads, reward_threads = threads[:3]
    shared_threads = threads[3] if len(threads) > 3 else actor_threads
    ports = {name: (free_port(), free_port()) for name in ("critic", "reward")}
    servers = {
        "critic": [python, "-m", "critic_server", "--port", str(ports["critic"][0]), "--http-port",
                   str(ports["critic"][1]), "--model", str(assets.value), "--checkpoint-dir", str(work / "critic"),
                   "--device", device, f"dtype={precision}", "resume=never", f"num_threads={critic_threads}",
                   f"train.lr={lr}",
                   f"train.global_batch_size={batch}", f"train.micro_batch_size={micro_batch}",
                   f"batching.max_batch_size={max(batch, generation_batch)}", *(["compile=true"] if compile_ else [])],
        "reward": [python, "-m", "reward_server", "--port", str(ports["reward"][0]), "--http-port",
                   str(ports["reward"][1]), "--model", str(assets.reward), "--device", device, f"dtype={precision}",
                   f"num_threads={reward_threads}", f"batching.max_batch_size={max(batch, generation_batch)}",
                   *(["compile=true"] if compile_ else [])],
    }
    overrides = {
        "run_dir": str(work / "run"), "num_threads": actor_threads, "num_threads_shared": shared_threads,
        "critic.address": f"127.0.0.1:{ports['critic'][0]}", "reward.address": f"127.0.0.1:{ports['reward'][0]}",
        "data.train_file": str(assets.prompts), "data.val_file": str(assets.prompts), "data.shuffle": "false",
        "policy.model_name": str(assets.policy), "policy.device": device, "policy.precision": precision,
        "policy.train_global_batch_size": batch, "policy.train_micro_batch_size": micro_batch,
        "policy.generation_batch_size": generation_batch, "policy.logprob_batch_size": logprob_batch,
        "policy.optimizer.kwargs.lr": lr,
        "policy.generation.max_new_tokens": response_length, "policy.generation.temperature": 1.0,
        "ppo.num_prompts_per_step": batch, "ppo.num_generations_per_prompt": 1, "ppo.max_num_steps": steps,
        "ppo.ppo_epochs": epochs, "ppo.seed": seed, "ppo.val_period": 0, "ppo.overlong_filtering": "false",
        "ppo.adv_estimator.name": "gae", "ppo.adv_estimator.gae_gamma": 1.0, "ppo.adv_estimator.gae_lambda": 0.95,
        "ppo.adv_estimator.normalize_advantages": "true",
        "ppo.kl_controller.init_kl_coef": 0.05, "ppo.kl_controller.kl_type": "k1",
        "ppo.kl_controller.use_absolute_kl": "false",
        "loss_fn.ratio_clip_min": 0.2, "loss_fn.ratio_clip_max": 0.2,
        "value_loss_fn.cliprange": 0.2, "value_loss_fn.scale": 0.1,
        "logger.tensorboard_enabled": "false", "logger.num_val_samples_to_print": 0,
        "checkpointing.enabled": "false",
        # the lead's keys: the critic trains every PPO epoch; the policy's rollout log-probs are generation's (as
        # TRL takes them from generate's scores); W1/W2 generate every token, EOS or not (TRL's stop_token=None)
        "critic.ppo_epochs": epochs, "policy.generation.reuse_logprobs": "true",
        "policy.generation.ignore_eos": "false" if stop_eos else "true",
        **({"policy.compile": "true"} if compile_ else {}),
        **({"policy.generation.compile": "true"} if compile_ or compile_decode else {}),
        **({"policy.generation.cuda_graphs": "true"} if cuda_graphs else {}),
    }
    optional = ("critic.ppo_epochs", "policy.generation.reuse_logprobs", "policy.generation.ignore_eos")
    skipped = [k for k in optional if k not in keys]
    if "policy.generation.ignore_eos" in skipped and not stop_eos:
        raise SystemExit("this checkout's actor has no policy.generation.ignore_eos: our side would stop at EOS and "
                         "do less work than TRL with stop_token=None; W1/W2 cannot run")
    actor = [python, "-m", "actor", "--http-port", "0",
             *(f"{k}={v}" for k, v in overrides.items() if k not in skipped)]
    procs: dict[str, Service] = {}
    try:
        for name, argv in servers.items():
            procs[name] = Service(name, argv, work / f"{name}.log", ports[name][1], env)
        for s in procs.values():
            s.wait_ready()
        with open(work / "actor.log", "wb") as log:
            code = subprocess.run(actor, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  check=False).returncode
        if code != 0:
            raise RuntimeError(f"actor exited with {code}:\n{(work / 'actor.log').read_text(errors='replace')[-4000:]}")
    finally:
        for s in procs.values():
            s.stop()
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_out = []
    for r in sorted((r for r in rows if r.get("step", 0) > 0), key=lambda r: r["step"]):
        d = {k.removeprefix("timers/"): float(v) for k, v in r.items() if k.startswith("timers/")}
        d["response_length"] = float(r.get("train_rollouts/response_lengths", response_length))
        d["critic_train_seconds"] = float(r.get("timers/critic_train", 0.0))
        d["critic_optimizer_steps"] = float(r.get("critic/optimizer_steps", 0.0))
        d["decode_steps"] = float(r.get("generation/decode_steps", 0.0))
        d["compiled_decode_steps"] = float(r.get("generation/compiled_steps", 0.0))
        steps_out.append(d)
    return OursRun(steps_out, skipped)
