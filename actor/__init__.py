"""The PPO actor: rollouts, remote critic and reward calls, advantages, policy updates (NeMo-Aligner's PPOTrainer.fit, split)."""
