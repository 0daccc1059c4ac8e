"""The TRL side of `bench.trl_ppo`: one run of trl.experimental.ppo.PPOTrainer (trl==1.12.0) on the bench models,
timed step by step. Runs in the bench's own environment (`make bench-env`), as a process of its own:

    .venv-bench/bin/python -m bench.trl_side --models DIR --response-length 64 --epochs 4 --steps 3 --out FILE

How TRL is set up (every choice made so that one TRL step is the same work as one of ours):
- one step = `batch` samples: per_device_train_batch_size = micro_batch, gradient_accumulation_steps = batch /
  micro_batch, num_mini_batches = 1, so each PPO epoch is one optimizer step over the whole batch (ours:
  train_global_batch_size = batch), micro-batched alike; num_ppo_epochs = epochs; total_episodes = steps * batch.
- fp32 on the CPU by default (use_cpu, bf16 and fp16 off: PPOConfig's default is bf16), torch threads = --threads;
  with --device cuda use_cpu is off, and with --precision bfloat16 TRL's own mixed precision is on (bf16=True:
  the policy and value model keep float32 weights and their prepared forward runs under accelerate's bf16
  autocast; TRL generates through the unwrapped policy, outside it, as it ships) and the reference and reward
  models, never trained, are loaded in bf16; ours runs policy.precision=bfloat16 and the servers' dtype=bfloat16.
- gradient_checkpointing off (PPOConfig's default is on): it recomputes the forward pass to save memory, which
  this machine does not need; left on it would cost TRL about a third more training time.
- local_rollout_forward_batch_size = --rollout-batch (default: the whole batch, TRL's own default of 64), so
  generation and the no-grad scoring passes each run once over all 64 rows: the largest, most efficient matmuls.
- temperature 1 (top_k 0, top_p 1), as ours; kl_coef TRL's default 0.05 (k1), missing_eos_penalty None;
  stop_token None (W1, W2) or "eos" (W3); no eval, no sample generations, no saves, no reporting.
- the same policy directory is loaded twice (policy and reference), value and reward from their directories.

Timing: a TrainerCallback stamps on_train_begin and every on_step_end (TRL calls it once per PPO step, after the
update), so step i's time is the gap between stamps; the trainer's module-level `batch_generation` (generation)
and `forward` (its first call with gradients on in a step starts the training phase) are wrapped to split each
step into generation / rest of the rollout (reference, value and reward passes, advantages) / training. The
result is written as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="a bench.trl_models build directory")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rollout-batch", type=int, default=None, help="local_rollout_forward_batch_size (default: batch)")
    parser.add_argument("--response-length", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stop-eos", action="store_true", help='stop_token="eos" (default: None)')
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    from bench.trl_models import Assets

    assets = Assets(Path(args.models))
    dtype = getattr(torch, args.precision)
    tokenizer = AutoTokenizer.from_pretrained(assets.policy)
    prompts = assets.read_prompts()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[: max(args.batch * args.steps, args.batch)]]
    dataset = Dataset.from_dict({"input_ids": ids})

    def load_lm(trained: bool):
        return AutoModelForCausalLM.from_pretrained(assets.policy, dtype=torch.float32 if trained else dtype)

    def load_scalar(path, trained: bool):
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1,
                                                                  dtype=torch.float32 if trained else dtype)

    marks: dict[str, list[float]] = {"step_end": [], "gen_start": [], "gen_end": [], "train_start": []}
    in_step = {"training": False}

    real_generation, real_forward = trl_ppo.batch_generation, trl_ppo.forward

    generated = {"rows": 0, "rows_with_pad": 0}  # <pad> in a generated response: HF generate stopped that row early

    def batch_generation(model, queries, *a, **k):
        marks["gen_start"].append(time.perf_counter())
        try:
            query_responses, logits = real_generation(model, queries, *a, **k)
        finally:
            marks["gen_end"].append(time.perf_counter())
        responses = query_responses[:, queries.shape[1]:]
        generated["rows"] += responses.shape[0]
        generated["rows_with_pad"] += int((responses == tokenizer.pad_token_id).any(1).sum())
        generated["width"] = responses.shape[1]
        return query_responses, logits

    def forward(*a, **k):
        if torch.is_grad_enabled() and not in_step["training"]:
            in_step["training"] = True
            marks["train_start"].append(time.perf_counter())
        return real_forward(*a, **k)

    real_truncate = trl_ppo.truncate_response
    lengths: list[float] = []  # mean response length (tokens up to and including EOS) of each rollout chunk

    def truncate_response(stop_token_id, pad_token_id, responses):
        hit = responses == stop_token_id
        n = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full_like(hit[:, 0], hit.shape[1], dtype=torch.long))
        lengths.append(float(n.float().mean()))
        return real_truncate(stop_token_id, pad_token_id, responses)

    trl_ppo.batch_generation, trl_ppo.forward, trl_ppo.truncate_response = batch_generation, forward, truncate_response

    class Stamps(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks["train_begin"] = [time.perf_counter()]

        def on_step_end(self, *a, **k):
            marks["step_end"].append(time.perf_counter())
            in_step["training"] = False

    with tempfile.TemporaryDirectory(prefix="trl-ppo-") as out_dir:
        config = PPOConfig(
            output_dir=out_dir, per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.batch // args.micro_batch, num_mini_batches=1,
            num_ppo_epochs=args.epochs, total_episodes=args.steps * args.batch,
            local_rollout_forward_batch_size=args.rollout_batch or args.batch, response_length=args.response_length,
            stop_token="eos" if args.stop_eos else None, missing_eos_penalty=None, temperature=1.0,
            learning_rate=args.lr, seed=args.seed, use_cpu=args.device == "cpu", bf16=args.precision == "bfloat16",
            fp16=False,
            gradient_checkpointing=False, num_sample_generations=0, report_to=[], save_strategy="no",
            eval_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = PPOTrainer(
            args=config, processing_class=tokenizer, model=load_lm(trained=True), ref_model=load_lm(trained=False),
            reward_model=load_scalar(assets.reward, trained=False), value_model=load_scalar(assets.value, trained=True),
            train_dataset=dataset, eval_dataset=dataset.select(range(args.batch)), callbacks=[Stamps()],
        )
        trainer.train()
        weights = next(trainer.model.parameters())
        weights = (f"{str(weights.dtype).removeprefix('torch.')} on {weights.device}"
                   f"{', bf16 mixed precision' if config.bf16 else ''}")

    ends = [marks["train_begin"][0], *marks["step_end"]]
    steps = []
    for i in range(len(marks["step_end"])):
        start, end = ends[i], ends[i + 1]
        gen = sum(e - s for s, e in zip(marks["gen_start"], marks["gen_end"], strict=True) if start <= s < end)
        train = next((end - t for t in marks["train_start"] if start <= t < end), 0.0)
        steps.append({"step_time": end - start, "generation": gen, "train_time": train,
                      "rollout_other": end - start - gen - train})
    result = {"generated": generated, "steps": steps, "mean_response_length": (sum(lengths) / len(lengths) if lengths else args.response_length), "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                           "torch": torch.__version__}, "threads": torch.get_num_threads(), "weights": weights}
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
