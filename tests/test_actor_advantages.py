"""The actor's choice of estimator and reward pipeline from the config: every name maps to its pure function,
and the pipeline applies scaling, then shaping, with hand-computed results."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from actor.advantages import ESTIMATORS, AdvantageInputs, RewardPipeline, build_advantages
from actor.config import ActorConfig, AdvEstimatorConfig, AdvEstimatorName
from algorithms import gae_advantages, grpo_advantages, masked_whiten, token_level_rewards
from serving.config import load_config


def test_every_estimator_name_of_the_config_has_an_estimator():
    assert set(ESTIMATORS) == set(get_args(AdvEstimatorName))


def inputs(**overrides) -> AdvantageInputs:
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]])
    base = {
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.25]),
        "components": {"reward/a": torch.tensor([1.0, 0.0, 1.0, 0.0]), "reward/b": torch.tensor([0.0, 1.0, 1.0, 1.0])},
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "mask": mask,
        "values": torch.tensor([[0.0, 0.1, 0.2, 0.0], [0, 0.3, 0.1, 0.2], [0, 0.5, 0, 0], [0, 0.2, 0.2, 0]]),
        "kl_penalty": torch.full((4, 4), 0.01) * mask,
    }
    return AdvantageInputs(**{**base, **overrides})


def test_gae_estimator_is_gae_advantages_with_the_kl_in_the_token_rewards_then_whitening():
    cfg = AdvEstimatorConfig(name="gae", gae_gamma=0.9, gae_lambda=0.8, gae_lambda_value=1.0)
    estimator, finish = build_advantages(cfg)
    x = inputs()
    advantages, returns = estimator(x)
    rewards = token_level_rewards(x.rewards, x.kl_penalty, x.mask, 1.0)
    want_a, want_r = gae_advantages(rewards, x.values, x.mask, 0.9, 1.0, 0.8)
    torch.testing.assert_close(advantages, want_a)
    torch.testing.assert_close(returns, want_r)
    torch.testing.assert_close(finish(advantages, x.mask), masked_whiten(want_a, x.mask))


def test_grpo_estimator_needs_no_values_and_returns_no_critic_targets():
    estimator, finish = build_advantages(AdvEstimatorConfig(name="grpo", use_leave_one_out_baseline=False))
    x = inputs(values=None)
    advantages, returns = estimator(x)
    assert returns is None
    torch.testing.assert_close(advantages, grpo_advantages(x.rewards, x.group_ids, x.mask, leave_one_out=False))
    torch.testing.assert_close(finish(advantages, x.mask), advantages)  # normalised inside the estimator


def test_gdpo_estimator_names_what_it_lacks():
    estimator, _ = build_advantages(AdvEstimatorConfig(name="gdpo", reward_components=["reward/a", "reward/c"]))
    with pytest.raises(ValueError, match="reward/c"):
        estimator(inputs())
    estimator, _ = build_advantages(AdvEstimatorConfig(name="gdpo"))
    advantages, returns = estimator(inputs())
    assert returns is None and advantages.shape == (4, 4)


def test_advantage_clip_after_normalisation():
    _, finish = build_advantages(AdvEstimatorConfig(name="raw_reward", normalize_advantages=False,
                                                    advantage_clip_low=-0.2, advantage_clip_high=0.3))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(finish(torch.tensor([[-1.0, 1.0, 5.0]]), mask), torch.tensor([[-0.2, 0.3, 0.0]]))


def test_reward_pipeline_scales_then_applies_dapo_s_overlong_penalty():
    cfg = load_config(ActorConfig, None, [
        "ppo.reward_scaling.enabled=true", "ppo.reward_scaling.target_min=-1", "ppo.reward_scaling.target_max=1",
        "ppo.reward_shaping.enabled=true", "ppo.reward_shaping.overlong_buffer_length=4",
        "ppo.reward_shaping.overlong_buffer_penalty=1", "policy.generation.max_new_tokens=12"])
    pipeline = RewardPipeline(cfg)
    rewards = torch.tensor([0.5, 1.5, 0.0, 1.0])
    lengths = torch.tensor([8, 10, 12, 12])
    ended = torch.tensor([True, True, False, True])
    # scaled to [-1, 1]: 0.5 -> 0, 1.5 clamps to 1 -> 1, 0 -> -1, 1 -> 1
    # overlong: max 12, buffer 4: the ramp starts after 8 tokens; 8 -> 0, 10 -> -2/4 = -0.5, 12 -> -1
    torch.testing.assert_close(pipeline(rewards, lengths, ended), torch.tensor([0.0, 0.5, -2.0, 0.0]))


def test_the_stop_properly_penalty_replaces_the_overlong_one_and_nothing_shapes_unless_enabled():
    """NeMo-RL's reward shaping: with stop_properly_penalty_coef, truncated samples' rewards times it and no DAPO
    penalty; `enabled: false` shapes nothing."""
    cfg = load_config(ActorConfig, None, ["ppo.reward_shaping.enabled=true",
                                          "ppo.reward_shaping.stop_properly_penalty_coef=0.5",
                                          "policy.generation.max_new_tokens=12"])
    rewards, lengths = torch.tensor([0.5, -2.0, 1.0]), torch.tensor([12, 12, 3])
    ended = torch.tensor([True, False, False])
    torch.testing.assert_close(RewardPipeline(cfg)(rewards, lengths, ended), torch.tensor([0.5, -1.0, 0.5]))
    off = load_config(ActorConfig, None, ["ppo.reward_shaping.overlong_buffer_length=4",
                                          "ppo.reward_shaping.overlong_buffer_penalty=1"])  # as NeMo-RL's GRPO config
    torch.testing.assert_close(RewardPipeline(off)(rewards, lengths, ended), rewards)


def test_reward_pipeline_is_the_identity_by_default():
    pipeline = RewardPipeline(ActorConfig())
    rewards = torch.tensor([0.3, -2.0])
    torch.testing.assert_close(pipeline(rewards, torch.tensor([3, 16]), torch.tensor([True, False])), rewards)
