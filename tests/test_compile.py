"""torch.compile of the model passes as a user turns it on: `policy.compile=true` and
`policy.generation.compile=true` on the actor and `compile=true` on the critic and reward servers give the same run as
eager ones, and a machine that cannot compile is refused at start with the key named.

Compiling costs tens of seconds per process on a CPU, so one run covers the compiled passes of each kind: the
actor's training (forward and backward), its reference log-prob pass and its decode step, the critic's Infer and
Train, the reward server's Score. The servers compile at load, before ready; the run asserts they compile nothing
after. The no-grad passes (log-probs, Infer, Score) compute through prepacked weights (`prepack_weights`, on by
default) compiled as eager, so both runs cover that too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from actor.clients import CriticClient
from actor.config import RemoteConfig
from actor.demo import wait_ready
from tests.service_procs import ServiceProcess
from tests.test_algorithm_runs import SMALL, metrics, run_actor

# Compiled kernels sum in another order than eager ones: float32 results agree to about 1e-6 relative per pass;
# over two PPO steps (two optimizer updates of policy and critic) the metrics stay within this.
RTOL = 1e-4
COMPARED = ("train_rollouts/rewards", "train_rollouts/values_mean", "train_rollouts/kl_penalty", "train_optim/loss",
            "train_optim/ppo_ratio", "train_optim/grad_norm", "critic/loss", "critic/grad_norm",
            "critic/explained_variance")


def run_ppo(tmp_path, name: str, log_dir, compile_: bool) -> list[dict]:
    flag = f"compile={str(compile_).lower()}"
    servers = [ServiceProcess("critic", "--checkpoint-dir", str(tmp_path / f"{name}-critic"), "resume=never", flag,
                              log_dir=log_dir, env={"TORCH_LOGS": "recompiles"}),
               ServiceProcess("reward", flag, log_dir=log_dir, env={"TORCH_LOGS": "recompiles"})]
    try:
        # The reward server starts once the critic is ready: its compiled Score pass is the critic's Infer pass on
        # the same model, so it finds most of its kernels in inductor's on-disk cache (about half its compile
        # time). The actor starts at once and compiles meanwhile; it waits for both servers.
        critic, reward = servers[0].start(wait=False), servers[1]
        with ThreadPoolExecutor(1) as pool:
            # the policy's log-probs are generation's: its no-grad pass is the reference's, compiled once
            # generation on 2 threads, the passes beside the servers' on 1: compiled kernels are built for a thread
            # count, so the actor's start-up compile must use each pass's own
            running = pool.submit(
                run_actor, "ppo", tmp_path / name, *SMALL, "ppo.max_num_steps=2", "ppo.ppo_epochs=2", "num_threads=2",
                "num_threads_shared=1", "policy.generation.reuse_logprobs=true",
                f"policy.generation.compile={str(compile_).lower()}", f"policy.compile={str(compile_).lower()}",
                f"critic.address={critic.address}", f"reward.address={reward.address}", timeout=600,
                env={"TORCH_LOGS": "recompiles"})
            wait_ready(critic.proc, f"{critic.http}/ready", 600, False)
            reward.start(wait=False)
            run = running.result()
        assert run.returncode == 0, run.stderr[-3000:]
        assert ("decode step compiled in" in run.stderr) == compile_, run.stderr[-3000:]
        # the actor compiles its training and log-prob passes at start, too: its steps compile nothing more
        assert ("training and log-prob passes compiled in" in run.stderr) == compile_, run.stderr[-3000:]
        # the no-grad passes compute through prepacked weights, compiled as eager (prepack_weights, on by default)
        assert "prepack_weights=true: the log-prob passes compute through linear weights prepacked" in run.stderr
        if compile_:
            started = run.stderr.index("training and log-prob passes compiled in")
            assert "Recompiling" not in run.stderr[started:], run.stderr[started:][-3000:]
        for row in metrics(tmp_path / name):  # every decode step of 2 rows or more ran compiled
            assert (row["generation/compiled_steps"] > 0) == compile_, row
        if compile_:  # a lone row and a one-token row, which dynamo would compile apart, run on the same graph
            client = CriticClient(RemoteConfig(address=critic.address))
            for width in (1, 5):
                values, _ = client.infer(torch.arange(width)[None, :], torch.tensor([width])).result()
                assert values.shape == (1, width)
            client.close()
        # compiled at load, before ready: the run's Infer, Train and Score calls compiled nothing more
        for server, passes in ((critic, "Infer and Train passes"), (reward, "Score pass")) if compile_ else ():
            log = server.log()
            ready = log.index(f"{server.name} ready")
            assert f"{passes} compiled in" in log[:ready], log[-3000:]
            assert "prepack_weights=true: " in log[:ready], log[-3000:]
            assert "Recompiling" not in log[ready:], log[ready:][-3000:]
    finally:
        for s in servers:
            s.stop()
    return metrics(tmp_path / name)


def test_compiled_services_train_as_eager_ones(embedded_cache, log_dir, tmp_path):
    eager = run_ppo(tmp_path, "eager", log_dir, False)
    compiled = run_ppo(tmp_path, "compiled", log_dir, True)
    assert [r["step"] for r in compiled] == [1, 2]
    for e, c in zip(eager, compiled, strict=True):
        keys = [k for k in COMPARED if k in e]
        assert len(keys) >= 7, sorted(e)  # the run reports what is compared
        for k in keys:
            assert c[k] == pytest.approx(e[k], rel=RTOL, abs=1e-6), (c["step"], k, c[k], e[k])


def test_no_cxx_compiler_is_refused_at_start(embedded_cache, log_dir, tmp_path):
    """On the CPU inductor builds C++ kernels: without a compiler the actor and a server stop at start, naming the
    key, instead of failing at the first pass. The actor is asked for the compiled decode step
    (policy.generation.compile); policy.compile goes through the same check (serving.modeling.require_compiler)."""
    env = {"CXX": str(tmp_path / "no-such-compiler")}
    run_dir = tmp_path / "run"
    run = run_actor("ppo", run_dir, "policy.generation.compile=true", "policy.device=cpu", env=env)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "policy.generation.compile=true" in run.stderr and "C++ compiler" in run.stderr, run.stderr[-2000:]
    reward = ServiceProcess("reward", "compile=true", "device=cpu", log_dir=log_dir, env=env)
    with pytest.raises(RuntimeError, match=r"exited with 1"):
        reward.start()
    assert "compile=true" in reward.log() and "C++ compiler" in reward.log(), reward.log()[-2000:]


def test_cuda_graphs_on_a_cpu_policy_are_refused_at_start(embedded_cache, tmp_path):
    """policy.generation.cuda_graphs on a policy that is not on a CUDA device: the actor stops at start naming the key
    and the device, before it waits for any server."""
    run = run_actor("ppo", tmp_path / "run", "policy.generation.cuda_graphs=true", "policy.device=cpu")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "error: policy.generation.cuda_graphs=true: CUDA graphs need a CUDA device" in run.stderr, run.stderr[-2000:]


def test_a_compiled_pass_with_one_output_per_row_keeps_its_rows():
    """An encoder reward model's pass (`sequence_scores`) gives one score per row, not one per position: compiled, a
    lone row and a one-token batch (run padded, as dynamo compiles size 1 apart) come back with their own rows."""
    from serving.modeling import compiled

    def per_row(model, tokens, lengths):  # reads the valid positions only, as a masked pass does
        valid = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
        return (tokens * valid).float().sum(1) + lengths

    fn = compiled(per_row, True, "compile", torch.device("cpu"))
    for tokens in (torch.tensor([[1, 2, 3]]), torch.tensor([[4], [5], [6]]), torch.tensor([[1, 2], [3, 4], [5, 6]])):
        lengths = torch.full((tokens.shape[0],), tokens.shape[1])
        torch.testing.assert_close(fn(None, tokens, lengths), per_row(None, tokens, lengths))
