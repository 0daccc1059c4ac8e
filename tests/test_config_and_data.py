"""Config loading, prompt-file errors and the actor's start-up compatibility checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from actor.clients import IncompatibleServer, check_compatible
from actor.config import ActorConfig
from actor.data import DataError, PromptSampler, load_prompts
from critic_server.config import CriticConfig
from ppo_services.v1 import critic_pb2, reward_pb2
from serving.config import ConfigError, load_config
from tests.service_procs import ROOT


def test_yaml_file_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 3\nppo:\n  gamma: 0.5\n")
    cfg = load_config(ActorConfig, path, ["ppo.lam=0.9", "generation.stop_token_ids=[4, 5]", "reference=null"])
    assert (cfg.max_steps, cfg.ppo.gamma, cfg.ppo.lam, cfg.generation.stop_token_ids, cfg.reference) == (3, 0.5, 0.9, [4, 5], None)
    assert load_config(ActorConfig, ROOT / "configs" / "demo.yaml").ppo.num_rollout_samples == 64


@pytest.mark.parametrize(
    "override, words",
    [
        ("ppo.gama=0.9", ["ppo.gama", "unknown key", "gamma", "lam"]),
        ("ppo.gamma=2", ["ppo.gamma", "less than or equal to 1", "2"]),
        ("ppo.kl_estimator=k9", ["ppo.kl_estimator", "'k1'", "'k3'"]),
        ("generation.backend=vllm", ["generation.backend", "'torch'"]),
        ("ppo.micro_batch_size=5", ["global_batch_size", "multiple", "micro_batch_size"]),
        ("nonsense", ["KEY=VALUE"]),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(ActorConfig, None, [override])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(CriticConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(CriticConfig, bad)


def test_server_exits_2_on_a_bad_key_without_loading_anything():
    result = subprocess.run([sys.executable, "-m", "critic_server", "train.lrr=1"], check=False, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "train.lrr" in result.stderr and "allowed keys here" in result.stderr and "lr" in result.stderr


@pytest.fixture(scope="module")
def tokenizer(embedded_assets):
    return AutoTokenizer.from_pretrained(embedded_assets.policy)


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"prompt": "river =>"}\n{"prompt": \n', [":2:", "not valid JSON"]),
        ('{"prompt": "river =>"}\n\n{"text": "x"}\n', [":3:", "'prompt'"]),
        ('{"prompt": "' + " ".join(["river"] * 70) + '"}\n', [":1:", "70 tokens", "max_prompt_length=64"]),
        ("", ["no prompts"]),
    ],
    ids=["bad-json", "missing-key", "too-long", "empty"],
)
def test_prompt_file_errors_name_file_and_line(tmp_path, tokenizer, content, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        load_prompts(path, "prompt", tokenizer, 64)
    assert str(path) in str(err.value)
    for w in words:
        assert w in str(err.value)


def test_prompt_sampler_walks_shuffled_epochs():
    sampler = PromptSampler([[i] for i in range(5)], seed=0)
    first, second = sampler.take(5), sampler.take(5)
    assert sorted(first) == sorted(second) == [[i] for i in range(5)]
    assert sampler.epoch == 1 and sampler.consumed == 10
    assert PromptSampler([[i] for i in range(5)], seed=0).take(5) == first


def test_compatibility_checks_say_what_differs():
    ok = critic_pb2.CriticInfo(model="m", vocab_size=51, max_length=64, vocab_sha256="abc")
    check_compatible("critic", ok, "abc", 51, 64, "prompts + responses")
    with pytest.raises(IncompatibleServer, match="different tokenizer vocabulary"):
        check_compatible("critic", ok, "abd", 51, 20, "prompts + responses")
    with pytest.raises(IncompatibleServer, match="accepts at most 64 tokens, but prompts \\+ responses need 80"):
        check_compatible("critic", ok, "abc", 51, 80, "prompts + responses")
    small = reward_pb2.RewardInfo(model="r", vocab_size=40, max_length=64)
    with pytest.raises(IncompatibleServer, match="vocab size 40, smaller than the policy's 51"):
        check_compatible("reward", small, "abc", 51, 20, "x")
