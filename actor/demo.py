"""`make demo` (`python -m actor.demo`): the whole system on loopback with the embedded default.

Starts the critic and reward servers as their own processes with the same `python -m` commands the
containers use, runs the actor until it finishes, stops the servers with SIGTERM, and prints what PPO did.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before by this process: the kernel may offer the same port again
    as soon as its probe socket closes, so two calls in a row could otherwise name one port twice."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class NotReady(RuntimeError):
    """A started service that did not come up: the message says why (it exited, with its code, or the time ran out)."""


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, verify: ssl.SSLContext | bool = False) -> None:
    """Poll `url`, the /ready probe of the service `proc` runs, until it answers 200; raises NotReady once `proc` has
    exited or `timeout` seconds have passed. `verify` is httpx's: False (plain HTTP) spares loading the system's CA
    bundle at every poll (about 20 ms of CPU each). The demo, the bench and the tests start services through this."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(f"exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise NotReady(f"not ready after {timeout:.0f} s ({url})")


def summarize(run_dir: Path) -> float:
    """Print the reward trajectory; returns the fraction of the gap to 1.0 that training closed."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("train_rollouts/rewards") is not None]  # not step 0's validation
    first = rows[0]["train_rollouts/rewards"]
    last3 = sum(r["train_rollouts/rewards"] for r in rows[-3:]) / len(rows[-3:])
    closed = (last3 - first) / max(1.0 - first, 1e-9)
    print(f"\nmean reward: step 1 {first:.3f} -> last 3 steps {last3:.3f} "
          f"({closed:.0%} of the gap to 1.0 closed over {len(rows)} steps)")
    return closed


def plan(cfg, ports: dict[str, tuple[int, int]], thread_budget: str,
         cores: int) -> tuple[dict[str, list[str]], list[str]]:
    """The servers' commands by name (a critic only where the algorithm needs one) and the actor's thread overrides
    (`cfg`: the ActorConfig; `ports`: gRPC and HTTP port by server)."""
    servers = {
        # the learned reward model, with the task's ground truth and a second rule as components (GDPO uses both)
        "reward": [sys.executable, "-m", "reward_server", "--port", str(ports["reward"][0]),
                   "--http-port", str(ports["reward"][1]), "components=[positive_fraction,no_negative]"],
    }
    if cfg.needs_critic:
        servers["critic"] = [sys.executable, "-m", "critic_server", "--port", str(ports["critic"][0]),
                             "--http-port", str(ports["critic"][1]),
                             "--checkpoint-dir", str(Path(cfg.run_dir).resolve() / "checkpoints" / "critic")]
    else:
        print(f"ppo.adv_estimator.name={cfg.ppo.adv_estimator.name} needs no critic: no critic server started")
    actor_threads = []
    if thread_budget == "auto":  # processes that oversubscribe the cores run several times slower
        for cmd in servers.values():
            cmd.append("num_threads=1")
        # one thread for the actor on 2 cores even where generation runs alone: the demo's tiny models step faster
        # on one thread (0.20 s against 0.24 s a step with num_threads=2 num_threads_shared=1, measured)
        actor_threads = [f"num_threads={max(1, cores - len(servers))}"]
    return servers, actor_threads


def unless_given(own: list[str], overrides: list[str]) -> list[str]:
    """The demo's own `key=value` settings for the actor but those whose key the user's `overrides` set (the actor
    refuses a key given twice; the user's wins, as in `python -m actor.demo checkpointing.resume=auto`)."""
    from serving.config import canonical_override

    from .config import ActorConfig

    def key(override: str) -> str:
        return canonical_override(ActorConfig, override).partition("=")[0]

    given = {key(o) for o in overrides}
    return [o for o in own if key(o) not in given]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "ppo.yaml"))
    parser.add_argument("--thread-budget", choices=["auto", "none"], default="auto",
                        help="auto: one torch thread per server, the other cores to the actor (they share this "
                             "machine); none: torch's default in every process (each takes every core)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="passed to the actor")
    args = parser.parse_args(argv)

    from serving.config import ConfigError, load_config

    from .config import ActorConfig

    try:
        cfg = load_config(ActorConfig, args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    run_dir = Path(cfg.run_dir)

    print("building the embedded default (cached after the first run) ...", flush=True)
    subprocess.run([sys.executable, "-m", "embedded", "--no-report"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)

    ports = {name: (free_port(), free_port()) for name in ("critic", "reward")}
    servers, actor_threads = plan(cfg, ports, args.thread_budget, len(os.sched_getaffinity(0)))
    procs: dict[str, subprocess.Popen] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for name, cmd in servers.items():
            print(f"starting {name} server: {' '.join(cmd[1:])}", flush=True)
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env)
        for name, proc in procs.items():
            try:
                wait_ready(proc, f"http://127.0.0.1:{ports[name][1]}/ready", timeout=300)
            except NotReady as e:
                raise SystemExit(f"{name} server {e}; see its log above") from None
        own = ["http_port=0", f"critic.address=127.0.0.1:{ports['critic'][0]}",
               f"reward.address=127.0.0.1:{ports['reward'][0]}", *actor_threads,
               "checkpointing.resume=never"]  # each demo trains from scratch
        actor = [sys.executable, "-m", "actor", "--config", str(Path(args.config).resolve()),
                 *unless_given(own, args.overrides), *args.overrides]
        print(f"starting actor: {' '.join(actor[1:])}", flush=True)
        # in the caller's directory, as `python -m actor` there: relative paths and a `module:Class` environment of
        # theirs resolve as they would without the demo
        actor_env = {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])}
        code = subprocess.run(actor, check=False, cwd=os.getcwd(), env=actor_env).returncode
        if code != 0:
            print(f"actor failed with exit code {code}", file=sys.stderr)
            return code
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            print(f"{name} server stopped (exit code {rc})")
    summarize(run_dir)
    print(f"run written to {run_dir}/: metrics.jsonl, tensorboard/, reward_curve.png, checkpoints/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
