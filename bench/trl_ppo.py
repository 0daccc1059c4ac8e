"""Side by side with TRL's PPO (trl==1.12.0, trl.experimental.ppo.PPOTrainer): samples per second of ours and of
TRL's on the same models, prompts and settings, run back to back, alternating, with the ratio per round.

    make bench-env                                   # once: .venv-bench with torch, this package and trl==1.12.0
    make bench ARGS="--workload W1"                  # = flock /tmp/bench.lock .venv-bench/bin/python -m bench.trl_ppo ...
    .venv-bench/bin/python -m bench.trl_ppo [--workload W1|W2|W3|all] [--rounds 2] [--steps 4] [--tiny]
        [--device cpu|cuda] [--precision float32|bfloat16]

Workloads (batch 64, 16-token prompts, fp32, 2 threads in all; bench/trl_models.py builds the models):
    W1  training-heavy     64-token responses, 4 PPO epochs, the critic trained every epoch; EOS ignored
    W2  generation-heavy   256-token responses, 1 epoch; EOS ignored (TRL stop_token=None, ours ignore_eos)
    W3  realistic lengths  as W2, both stop at EOS (TRL stop_token="eos"): responses ~80 tokens on average

Each round runs TRL (bench/trl_side.py, in .venv-bench) and ours (bench/ours_side.py: both servers and the actor as
processes) for --steps steps each, the side that goes first alternating from round to round; a run's first step
is warm-up and is dropped. A side's samples/s in a round = batch / its median step time; the ratio is ours / TRL
in the same round. Per workload it prints the per-round table, the median ratio against the target, where each
side's step time goes, and each side's training efficiency: model FLOPs (6 * matmul parameters * trained tokens
per epoch * epochs, policy and value, attention's own FLOPs not counted) / training time / the machine's fp32
matmul peak at 2 threads (the best of a 2048^3 torch.mm, measured in the same run, before and after the
workload). Nothing is downloaded: the models are built locally and cached in .cache/bench/.

On a GPU (`--device cuda --precision bfloat16`): both sides run bf16 mixed precision on the one GPU (ours: the actor,
the critic server and the reward server all on cuda:0; TRL with use_cpu off and its bf16=True): the trained policy
and value model keep float32 weights and compute in bf16 under autocast, the reward model is held in bf16, and the
reference is bf16 on TRL's side and float32 under the policy's autocast on ours (bf16 matmuls either way), so both do
the same work in the same precision; the peak is then the bf16 torch.mm peak of that GPU. Its figures on one H100
are in docs/PERFORMANCE.md; the suite runs the bf16 path on the CPU at --tiny size.

Choices, with what was measured on the 2-core machine this was written on (medians of 3 steps):
- thread budgets of ours (--threads actor,critic,reward), default 1,1,1. W2: 1,1,1 21.3 s/step; 2,1,1 24.9 s;
  2,2,2 29.7 s. W1: 1,1,1 11.4 s; 2,1,1 17.0 s. Generation alone is faster with the actor on 2 threads (W2: 5.3
  against 7.1 s), but the critic trains beside the policy and the reference, value and reward passes run at once,
  and oversubscribed cores lose more than the second thread gains (W2 training: 12.3 s at 2,1,1, 8.1 s at 1,1,1).
- micro-batch 8 on both sides: a policy forward+backward at 1 thread reaches 75% of the matmul peak at 8 x 80
  tokens and 77% at 16 x 80 (65-66% at 8 or 16 x 272), so a larger one would not change the comparison.
- ours: generation_batch_size = the batch (16 rows at a time made W3 slower: 13.7 against 11.4 s/step),
  logprob_batch_size 16 (64: 21.0 against 21.3 s/step in W2, no difference; later, with prepacked weights, 8, the
  actor's default: 16.28 against 16.71 s/step in W2 eager, with TRL's step 5% faster in the same run too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    response_length: int
    epochs: int
    stop_eos: bool
    target: float  # ours / TRL, samples per second


WORKLOADS = {
    "W1": Workload("W1", "training-heavy", 64, 4, False, 1.3),
    "W2": Workload("W2", "generation-heavy", 256, 1, False, 1.4),
    "W3": Workload("W3", "realistic lengths (EOS)", 256, 1, True, 2.0),
}
TINY_LENGTHS = {"W1": 8, "W2": 16, "W3": 16}
PROMPT_TOKENS = 16


def peak_size(args: argparse.Namespace) -> int:
    """The matmul peak's matrix size: --tiny only checks the harness runs, so a quick peak will do; a GPU needs a
    larger product to be busy."""
    return 512 if args.tiny else 8192 if args.device == "cuda" else 2048


def matmul_peak(threads: int, size: int, reps: int = 8, device: str = "cpu", precision: str = "float32") -> float:
    """Best torch.mm throughput (FLOP/s) over `reps` runs of a size^3 product in `precision` on `device`, at
    `threads` threads (the CPU's)."""
    import torch

    dtype = getattr(torch, precision)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        for _ in range(2):
            a @ b
        sync()
        best = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            sync()
            best = max(best, 2 * size**3 / (time.perf_counter() - t))
        return best
    finally:
        torch.set_num_threads(before)


def imports_trl(python: Path | str) -> bool:
    if not Path(python).exists():
        return False
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    probe = subprocess.run([str(python), "-c", "import trl.experimental.ppo"], capture_output=True, env=env, check=False)
    return probe.returncode == 0


def find_trl_python(explicit: str | None) -> str | None:
    candidates = [explicit] if explicit else [sys.executable, str(BENCH_PYTHON)]
    return next((c for c in candidates if imports_trl(c)), None)


class CpuWatch:
    """CPU time the rest of the machine used while a run went on: the busy time of all cores (/proc/stat) minus
    this process's and its finished children's (every service and the TRL process are waited for). A share of the
    cores above DISTURBED_SHARE means other work competed with the run and its times are not to be trusted."""

    def __init__(self) -> None:
        self.start = (self._busy(), self._ours(), time.monotonic())

    @staticmethod
    def _busy() -> float | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime

    def others_share(self) -> float | None:
        """Fraction of the cores' time others used since __init__ (None where /proc/stat cannot be read)."""
        busy0, ours0, t0 = self.start
        busy = self._busy()
        if busy is None or busy0 is None:
            return None
        others = (busy - busy0) - (self._ours() - ours0)
        return max(others, 0.0) / ((time.monotonic() - t0) * len(os.sched_getaffinity(0)))


DISTURBED_SHARE = 0.10  # others' share of the cores during a run above which the run is flagged
DISTURBED_SPREAD = 1.25  # slowest / fastest measured step of a run above which the run is flagged


def wait_quiet(max_s: float, probe_s: float = 3.0) -> float | None:
    """Wait up to max_s for a probe_s window in which other processes use under DISTURBED_SHARE of the cores;
    returns the last window's share (None where it cannot be measured)."""
    deadline = time.monotonic() + max_s
    while True:
        watch = CpuWatch()
        time.sleep(probe_s)
        share = watch.others_share()
        if share is None or share < DISTURBED_SHARE or time.monotonic() >= deadline:
            return share
        print(f"    waiting for a quiet machine: other processes use {share:.0%} of the cores", flush=True)


def disturbed(steps: list[dict], others: float | None) -> list[str]:
    """Why a run's times are not to be trusted (empty: they are): other work on the cores, or steps so uneven that
    one median says little (seen on a GPU with the cores idle)."""
    why = []
    if others is not None and others > DISTURBED_SHARE:
        why.append(f"others used {others:.0%} of the cores")
    times = [s["step_time"] for s in steps[1:]]
    if times and max(times) / min(times) > DISTURBED_SPREAD:
        why.append(f"measured steps range {min(times):.1f}-{max(times):.1f} s")
    return why


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_trl(python: str, models: Path, w: Workload, args: argparse.Namespace, length: int, work: Path) -> dict:
    out = work / "trl.json"
    cmd = [python, "-m", "bench.trl_side", "--models", str(models), "--batch", str(args.batch),
           "--micro-batch", str(args.micro_batch), "--response-length", str(length), "--epochs", str(w.epochs),
           "--steps", str(args.steps), "--threads", str(args.total_threads), "--device", args.device,
           "--precision", args.precision, "--out", str(out)]
    if args.trl_rollout_batch:
        cmd += ["--rollout-batch", str(args.trl_rollout_batch)]
    if w.stop_eos:
        cmd.append("--stop-eos")
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(args.total_threads)}
    with open(work / "trl.log", "wb") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"TRL side exited with {code}:\n{(work / 'trl.log').read_text(errors='replace')[-4000:]}")
    return json.loads(out.read_text())


def flops_per_step(policy_params: int, value_params: int, tokens_per_epoch: float, policy_epochs: int,
                   value_epochs: int) -> float:
    return 6 * tokens_per_epoch * (policy_params * policy_epochs + value_params * value_epochs)


def compiled_what(args: argparse.Namespace) -> str:
    """How our side ran its model passes and its decode step, for the phase line."""
    if args.compile:
        return "model passes and the decode step compiled" + (", replayed as CUDA graphs" if args.cuda_graphs else "")
    if args.cuda_graphs:
        return "model passes eager, the decode step compiled and replayed as CUDA graphs"
    if args.compile_decode:
        return "model passes eager, the decode step compiled"
    return "model passes and the decode step eager"


def fmt_phases(phases: dict[str, float]) -> str:
    return " | ".join(f"{k} {v:.2f}" for k, v in phases.items())


def run_workload(w: Workload, args: argparse.Namespace, models: Path, trl_python: str | None,
                 params: tuple[int, int], work_root: Path) -> dict:
    from bench.ours_side import run_ours

    length = TINY_LENGTHS[w.name] if args.tiny else w.response_length
    threads = tuple(int(x) for x in args.threads.split(","))
    print(f"\n=== {w.name} {w.title}: batch {args.batch}, {PROMPT_TOKENS}-token prompts, {length}-token responses, "
          f"{w.epochs} PPO epoch(s), micro-batch {args.micro_batch}, "
          f"{'stop at EOS' if w.stop_eos else 'EOS ignored'}; {args.rounds} round(s) of {args.steps} steps per side "
          f"(step 1 dropped)", flush=True)
    peaks = [matmul_peak(args.total_threads, peak_size(args), device=args.device, precision=args.precision)]
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = ["trl", "ours"] if r % 2 == 0 else ["ours", "trl"]
        if trl_python is None:
            order = ["ours"]
        res: dict = {"round": r + 1, "first": order[0], "load_before": loadavg()}
        for side in order:
            work = work_root / f"{w.name}-r{r + 1}-{side}"
            work.mkdir(parents=True, exist_ok=True)
            if args.wait_quiet > 0:
                wait_quiet(args.wait_quiet)
            started, watch = time.monotonic(), CpuWatch()
            if side == "trl":
                out = run_trl(trl_python, models, w, args, length, work)
                res["trl"] = out["steps"]
                res["trl_mean_length"] = out["mean_response_length"]
                res["trl_versions"] = out["versions"]
                res["trl_generated"] = out["generated"]
                res["trl_weights"] = out["weights"]
            else:
                run = run_ours(python=args.ours_python or sys.executable, models=models, work=work / "ours",
                               batch=args.batch, micro_batch=args.micro_batch, response_length=length,
                               epochs=w.epochs, steps=args.steps, stop_eos=w.stop_eos, threads=threads,
                               generation_batch=args.generation_batch, logprob_batch=args.logprob_batch,
                               compile_=args.compile, compile_decode=args.compile_decode, device=args.device,
                               precision=args.precision, cuda_graphs=args.cuda_graphs)
                res["ours"], res["ours_skipped_keys"] = run.steps, run.skipped_keys
            res[f"{side}_wall"] = time.monotonic() - started
            others = watch.others_share()
            res[f"{side}_others_share"] = others
            res[f"{side}_disturbed"] = disturbed(res[side], others)
            shown = "n/a" if others is None else f"{others:.0%}"
            print(f"  round {r + 1} {side:4s}: {res[f'{side}_wall']:.0f} s wall, step times "
                  + ", ".join(f"{s['step_time']:.2f}" for s in res[side])
                  + f" (other processes' share of the cores {shown}; load {loadavg()})"
                  + (f"  DISTURBED: {'; '.join(res[f'{side}_disturbed'])}" if res[f"{side}_disturbed"] else ""),
                  flush=True)
        rounds.append(res)
    peaks.append(matmul_peak(args.total_threads, peak_size(args), device=args.device, precision=args.precision))
    return report(w, args, length, rounds, max(peaks), peaks, params, threads)


def report(w: Workload, args: argparse.Namespace, length: int, rounds: list[dict], peak: float,
           peaks: list[float], params: tuple[int, int], threads: tuple[int, ...]) -> dict:
    policy_params, value_params = params
    have_trl = all("trl" in r for r in rounds)
    skipped = rounds[0].get("ours_skipped_keys", [])
    critic_epochs = 1 if "critic.ppo_epochs" in skipped else w.epochs
    print(f"\n{w.name} {w.title}: samples/s = {args.batch} / median step time (step 1 of each run dropped)")
    print(f"  {'round':>5}  {'first':>5}  {'TRL s/step':>10}  {'ours s/step':>11}  {'TRL samples/s':>13}  "
          f"{'ours samples/s':>14}  {'ours/TRL':>8}")
    ratios = []
    for r in rounds:
        ours = median([s["step_time"] for s in r["ours"][1:]])
        trl = median([s["step_time"] for s in r["trl"][1:]]) if have_trl else float("nan")
        r["ours_median_step"], r["trl_median_step"] = ours, trl
        ratio = trl / ours if have_trl else float("nan")
        r["ratio"] = ratio
        ratios.append(ratio)
        flag = "  (disturbed)" if r.get("ours_disturbed") or r.get("trl_disturbed") else ""
        print(f"  {r['round']:>5}  {r['first']:>5}  {trl:>10.2f}  {ours:>11.2f}  {args.batch / trl:>13.2f}  "
              f"{args.batch / ours:>14.2f}  {ratio:>7.2f}x{flag}")
    med_ratio = median(ratios) if have_trl else float("nan")
    if have_trl:
        verdict = "meets" if med_ratio >= w.target else "misses"
        print(f"  median ours/TRL: {med_ratio:.2f}x (per round: {', '.join(f'{x:.2f}x' for x in ratios)}); "
              f"target >= {w.target}x: {verdict}")
        if any(r.get("ours_disturbed") or r.get("trl_disturbed") for r in rounds):
            print(f"  WARNING: a round is flagged above (other processes above {DISTURBED_SHARE:.0%} of the cores, or "
                  f"measured steps spread over {DISTURBED_SPREAD:.2f}x, as launch-bound GPU steps can be with the "
                  "cores idle): rerun before quoting")
    else:
        print("  ours/TRL: n/a (TRL side skipped)")

    ours_steps = [s for r in rounds for s in r["ours"][1:]]
    extra = ("response_length", "critic_train", "critic_train_seconds", "critic_optimizer_steps", "decode_steps",
             "compiled_decode_steps", "rollout_time", "step_time")
    keys = [k for k in ours_steps[0] if k not in extra] + ["rollout_time", "step_time"]
    ours_phases = {k: median([s.get(k, 0.0) for s in ours_steps]) for k in keys}
    ours_phases["critic train (server, overlaps train_time)"] = median([s["critic_train_seconds"] for s in ours_steps])
    print(f"  ours, median seconds per step by timer (actor {threads[0]} ({threads[-1]} while a server computes), "
          f"critic {threads[1]}, reward {threads[2]} threads; "
          f"{compiled_what(args)}; rollout_time holds generate, transfer, the log-prob passes and critic_wait):\n"
          f"    {fmt_phases(ours_phases)}")
    print(f"  per PPO step: optimizer steps of the policy {w.epochs} (one per epoch over the batch), of the critic "
          f"{median([s['critic_optimizer_steps'] for s in ours_steps]):.0f} (as the critic server reports them); "
          f"decode forwards {median([s['decode_steps'] for s in ours_steps]):.0f}, "
          f"{median([s['compiled_decode_steps'] for s in ours_steps]):.0f} of them compiled")
    if skipped:
        print(f"  NOTE: this checkout's actor lacks {', '.join(skipped)}: left at their defaults")
    if have_trl:
        trl_steps = [s for r in rounds for s in r["trl"][1:]]
        trl_phases = {k: median([s[k] for s in trl_steps]) for k in ("generation", "rollout_other", "train_time",
                                                                         "step_time")}
        print(f"  TRL, median seconds per step ({args.total_threads} threads, weights {rounds[0]['trl_weights']}; rollout_other = reference, value and "
              f"reward passes + advantages):\n    {fmt_phases(trl_phases)}")
        gen = [r["trl_generated"] for r in rounds]
        print(f"  TRL generated responses {max(g['width'] for g in gen)} tokens wide; "
              f"{sum(g['rows_with_pad'] for g in gen)} of {sum(g['rows'] for g in gen)} rows stopped early (EOS)")

    # training efficiency: model FLOPs of the trained tokens / training wall time / matmul peak
    where = f"{args.total_threads} threads" if args.device == "cpu" else args.device
    print(f"  training efficiency vs the {args.precision} matmul peak ({where}): {peak / 1e9:.0f} GFLOP/s "
          f"({peak_size(args)}^3 torch.mm, best of the measurements before/after: "
          f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)})")
    ours_len = median([s["response_length"] for s in ours_steps])
    ours_tokens = args.batch * (PROMPT_TOKENS + ours_len)
    ours_train = median([s.get("train_time", 0.0) + s.get("critic_train_wait", 0.0) for s in ours_steps])
    ours_flops = flops_per_step(policy_params, value_params, ours_tokens, w.epochs, critic_epochs)
    ours_eff = ours_flops / ours_train / peak
    print(f"    ours: {ours_flops / 1e9:.0f} GFLOP/step ({ours_tokens:.0f} tokens/epoch, mean response {ours_len:.1f}; "
          f"policy {w.epochs} + critic {critic_epochs} epochs) in {ours_train:.2f} s (train_time + critic_train_wait) "
          f"= {ours_flops / ours_train / 1e9:.0f} GFLOP/s = {ours_eff:.0%} of peak")
    out = {"disturbed": any(r.get("ours_disturbed") or r.get("trl_disturbed") for r in rounds), "workload": w.name, "response_length": length, "epochs": w.epochs, "rounds": rounds, "peak_flops": peak,
           "peaks": peaks, "median_ratio": med_ratio, "target": w.target, "ours_phases": ours_phases,
           "ours_efficiency": ours_eff, "threads": threads,
           "compile": args.compile, "compile_decode": args.compile_decode,
           "cuda_graphs": args.cuda_graphs, "device": args.device, "precision": args.precision}
    if have_trl:
        trl_len = median([r["trl_mean_length"] for r in rounds])
        trl_tokens = args.batch * (PROMPT_TOKENS + length)  # TRL trains on the whole padded width every time
        trl_flops = flops_per_step(policy_params, value_params, trl_tokens, w.epochs, w.epochs)
        trl_eff = trl_flops / trl_phases["train_time"] / peak
        line = (f"    TRL:  {trl_flops / 1e9:.0f} GFLOP/step ({trl_tokens:.0f} tokens/epoch: it trains on the full "
                f"padded width) in {trl_phases['train_time']:.2f} s = {trl_flops / trl_phases['train_time'] / 1e9:.0f} "
                f"GFLOP/s = {trl_eff:.0%} of peak")
        if w.stop_eos:
            useful = flops_per_step(policy_params, value_params, args.batch * (PROMPT_TOKENS + trl_len), w.epochs,
                                    w.epochs)
            line += (f"; counting only tokens up to EOS (mean response {trl_len:.1f}): "
                     f"{useful / trl_phases['train_time'] / peak:.0%}")
        print(line)
        out.update(trl_phases=trl_phases, trl_efficiency=trl_eff)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per workload (default 2; --tiny 1)")
    parser.add_argument("--steps", type=int, default=None, help="PPO steps per run, the first dropped (default 4; --tiny 2)")
    parser.add_argument("--tiny", action="store_true", help="tiny models and sizes (batch 8, micro-batch 4, 8-16 "
                        "token responses): a quick check that everything runs, not a measurement")
    parser.add_argument("--micro-batch", type=int, default=None, help="both sides' training micro-batch (TRL "
                        "per_device_train_batch_size; ours policy.train_micro_batch_size and the critic's "
                        "train.micro_batch_size); default 8 (--tiny 4)")
    parser.add_argument("--threads", default="2,1,1,1", help="torch threads of our actor, critic and reward server, "
                        "and of the actor while the servers compute (num_threads_shared); default 2,1,1,1: the actor "
                        "generates on both cores and keeps to one while a server computes beside it")
    parser.add_argument("--total-threads", type=int, default=None, help="TRL's threads and the peak measurement's "
                        "(default 2, the machine's budget; --tiny 1: tiny ops on 2 threads of a busy machine crawl)")
    parser.add_argument("--generation-batch", type=int, default=None, help="ours: policy.generation_batch_size "
                        "(default: the batch)")
    parser.add_argument("--logprob-batch", type=int, default=16, help="ours: policy.logprob_batch_size")
    parser.add_argument("--trl-rollout-batch", type=int, default=None, help="TRL local_rollout_forward_batch_size "
                        "(default: the batch, as TRL's own default 64)")
    parser.add_argument("--trl-python", default=None, help="python with trl==1.12.0 (default: this one if it has "
                        "trl, else .venv-bench/bin/python)")
    parser.add_argument("--ours-python", default=None, help="python for our services (default: this one)")
    parser.add_argument("--skip-trl", action="store_true", help="run our side only (no ratios)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS", help="before each run, wait "
                        "up to this long for other processes to leave the cores alone (shared machines)")
    parser.add_argument("--compile", action="store_true", help="ours: torch.compile every model pass and the decode step "
                        "(policy.compile, policy.generation.compile; the critic and reward servers' compile); the first step, which compiles, is "
                        "dropped like every warm-up step. TRL's side runs as it ships (eager)")
    parser.add_argument("--compile-decode", action="store_true", help="ours: torch.compile the decode step only "
                        "(policy.generation.compile), every other pass eager; implied by --compile")
    parser.add_argument("--cuda-graphs", action="store_true", help="ours: the decode step compiled and replayed as "
                        "CUDA graphs on the static-shape cache (policy.generation.cuda_graphs; --device cuda only)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides run (cuda: every "
                        "model of both on the one GPU, cuda:0)")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32", help="both sides' compute "
                        "precision (bfloat16: mixed precision on both sides, float32 trained weights under bf16 autocast)")
    parser.add_argument("--json", default=None, help="also write every measurement to this file")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.tiny else 2)
    args.steps = args.steps or (2 if args.tiny else 4)
    args.batch = 8 if args.tiny else 64
    args.micro_batch = args.micro_batch or (4 if args.tiny else 8)
    args.generation_batch = args.generation_batch or args.batch
    args.total_threads = args.total_threads or (1 if args.tiny else 2)
    if args.tiny and args.threads == parser.get_default("threads"):
        args.threads = "1,1,1,1"  # see --total-threads
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step of every run is dropped as warm-up")
    if args.batch % args.micro_batch:
        parser.error(f"--micro-batch must divide the batch ({args.batch})")
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")

    trl_python = None
    if not args.skip_trl:
        trl_python = find_trl_python(args.trl_python)
        if trl_python is None:
            raise SystemExit("no python with trl==1.12.0 found (tried "
                             f"{args.trl_python or f'{sys.executable} and {BENCH_PYTHON}'}): run `make bench-env`, "
                             "or pass --skip-trl to run our side only")

    from transformers import AutoConfig

    from bench.trl_models import ensure_built, matmul_params

    shape = "tiny" if args.tiny else "full"
    assets = ensure_built(shape)
    cfg = AutoConfig.from_pretrained(assets.policy)
    params = (matmul_params(cfg, cfg.vocab_size), matmul_params(cfg, 1))
    import torch

    print(f"bench.trl_ppo: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, "
          f"python {platform.python_version()}; models {assets.root} ({shape}: hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, MLP {cfg.intermediate_size}, vocab "
          f"{cfg.vocab_size}; matmul parameters policy {params[0] / 1e6:.2f}M, value {params[1] / 1e6:.2f}M); "
          f"TRL: {trl_python or 'skipped'}; load average {loadavg()}", flush=True)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        for name in names:
            started = time.monotonic()
            results.append(run_workload(WORKLOADS[name], args, assets.root, trl_python, params, Path(tmp)))
            results[-1]["wall_s"] = time.monotonic() - started
            print(f"  {name} took {results[-1]['wall_s']:.0f} s in all", flush=True)
    if trl_python is not None:
        print("\nsummary (ours / TRL, samples per second, median of rounds):")
        for r in results:
            print(f"  {r['workload']}: {r['median_ratio']:.2f}x (target >= {r['target']}x); training efficiency ours "
                  f"{r['ours_efficiency']:.0%}, TRL {r['trl_efficiency']:.0%} of the matmul peak"
                  + ("  (a round was disturbed: rerun)" if r["disturbed"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
