"""`python -m embedded [--cache-dir DIR]`: build (or reuse) the embedded default and report on it.

Prints the asset paths, then (unless --no-report) the SFT policy's mean ground-truth reward over
sampled responses (temperature 1) and the reward model's mean absolute error against the ground truth.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from embedded import ensure_built

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embedded", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $PPO_SERVICES_CACHE, else ~/.cache/ppo-services)",
    )
    parser.add_argument("--samples", type=int, default=256, help="policy samples for the reward check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-report", action="store_true", help="only build (or reuse) and print the paths")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    log = logging.getLogger("embedded")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    start = time.monotonic()
    assets = ensure_built(args.cache_dir)
    log.info("assets ready in %.1fs", time.monotonic() - start)
    for field in ("root", "tokenizer", "policy", "reward_model", "prompts_train", "prompts_eval"):
        print(f"{field}: {getattr(assets, field)}")
    if args.no_report:
        return 0

    from embedded.evaluate import policy_mean_reward, reward_model_report

    log.info("sampling %d responses from the SFT policy", args.samples)
    reward = policy_mean_reward(assets.policy, n=args.samples, seed=args.seed)
    print(f"sft_policy_mean_reward: {reward:.4f}  ({args.samples} samples, temperature 1)")
    log.info("evaluating the reward model on held-out responses")
    report = reward_model_report(assets.reward_model, seed=args.seed)
    per_set = ", ".join(f"{name} {mae:.4f}" for name, mae in report.items() if name != "all")
    print(f"reward_model_mae: {report['all']:.4f}  ({per_set})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
