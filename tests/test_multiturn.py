"""Multi-turn episodes with an environment: the masks and the reward placement of a hand-built episode, the
collector's turn loop with a scripted environment (termination, stop strings, summed rewards, max turns), the
config's refusals, the reward server as an environment's scorer, and `configs/multiturn.yaml` learning against
real server processes."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actor.advantages import AdvantageInputs, build_advantages
from actor.clients import RewardClient
from actor.config import ActorConfig, AdvEstimatorConfig, RewardConfig
from actor.data import Prompt
from actor.environments import (
    BadEnvironment,
    EnvironmentContext,
    EnvironmentOptions,
    EnvironmentStep,
    Message,
    build_environment,
)
from actor.generation import SamplingParams, TorchGenerationBackend
from actor.models import ResidentReference
from actor.multiturn import (
    EnvironmentThread,
    Episode,
    MultiTurnCollector,
    count_turns,
    episodes_to_rollout,
    multi_turn_collector,
)
from actor.tracking import Timers
from algorithms import compute_gae, kl_penalty, token_level_rewards
from embedded.task import positive_fraction
from serving.config import ConfigError, load_config
from serving.modeling import PassLimits
from tests.service_procs import ServiceProcess
from tests.test_algorithm_runs import metrics, run_actor


@pytest.fixture(scope="module")
def tok(embedded_assets):
    return AutoTokenizer.from_pretrained(embedded_assets.policy)


@pytest.fixture(scope="module")
def policy(embedded_assets):
    return AutoModelForCausalLM.from_pretrained(embedded_assets.policy)


# --- a hand-built two-turn episode ------------------------------------------------------------------------


def test_observation_tokens_are_out_of_the_masks_and_the_reward_is_on_the_last_assistant_token():
    # prompt [5, 6] | turn 1 [10, 11, 3] | observation [7, 8] | turn 2 [12, 3]   (3 is EOS)
    e = Episode.start([5, 6], "p", None)
    e.add_turn([10, 11, 3], [-0.1, -0.2, -0.3], True, "a")
    e.add_observation([7, 8], "o")
    e.add_turn([12, 3], [-0.4, -0.5], True, "b")
    e.reward = 0.2 + 0.5  # two turns' rewards, summed
    short = Episode.start([5], "q", None)
    short.add_turn([13], [-0.6], False, "c")
    short.reward = 1.0
    r = episodes_to_rollout([e, short], pad_id=0)

    assert r.tokens[0].tolist() == [5, 6, 10, 11, 3, 7, 8, 12, 3] and r.lengths.tolist() == [9, 2]
    mask = r.action_mask()  # action t produced token t + 1
    assert mask[0].tolist() == [0, 1, 1, 1, 0, 0, 1, 1]
    assert mask[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert r.logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5])
    assert r.rewards.tolist() == pytest.approx([0.7, 1.0]) and r.ended.tolist() == [True, False]
    assert count_turns(mask).tolist() == [2, 1]

    # the KL is masked out of the observation actions exactly as the trainer does it
    lp, ref = torch.randn(2, 8), torch.randn(2, 8)
    kl = kl_penalty(lp, ref, "k1", absolute=True) * mask
    assert kl[0, 4:6].abs().sum() == 0 and kl[0, 6:].abs().sum() > 0
    # the reward lands on the last assistant action (the second EOS), nothing on observations
    rewards = token_level_rewards(r.rewards, 0.1 * kl, mask, 1.0)
    assert rewards[0, 7] == pytest.approx(0.7 - 0.1 * float(kl[0, 7]))
    assert rewards[0, 4:6].tolist() == [0.0, 0.0] and rewards[1, 0] == pytest.approx(1.0 - 0.1 * float(kl[1, 0]))

    # GAE runs over the whole span and passes over the observation: equal to GAE on the assistant actions alone
    values = torch.randn(2, 8)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert adv[0, 4:6].tolist() == [0.0, 0.0] and ret[0, 4:6].tolist() == [0.0, 0.0]
    keep = mask[0].bool()
    a_alone, r_alone = compute_gae(rewards[:1, keep], values[:1, keep], torch.ones(1, int(keep.sum())), 0.9, 0.8)
    assert torch.allclose(adv[0, keep], a_alone[0]) and torch.allclose(ret[0, keep], r_alone[0])

    # the critic-free estimators broadcast to the assistant actions only
    for name in ("grpo", "reinforce_plus_plus", "raw_reward"):
        estimate, finish = build_advantages(AdvEstimatorConfig(name=name))
        a, _ = estimate(AdvantageInputs(rewards=r.rewards, components={}, group_ids=torch.tensor([0, 0]), mask=mask,
                                        values=None, kl_penalty=torch.zeros_like(mask)))
        a = finish(a, mask)
        assert a[0, 4:6].tolist() == [0.0, 0.0] and a[0, 0] == 0.0 and a[0, 7] != 0.0, name


# --- the collector's turn loop ----------------------------------------------------------------------------


class ScriptOptions(EnvironmentOptions):
    stop: str = "a"  # the first word with an "a" ends a turn
    end_after: int = 2  # the samples of the prompt labelled 0 terminate after this many turns; the others never do


class ScriptedEnvironment:
    """Reward 1 per turn, plus 10 on the terminating turn; asks every sample to stop its next turn at `stop`."""

    Options = ScriptOptions

    def __init__(self, options: ScriptOptions, context: EnvironmentContext):
        self.options, self.calls = options, []

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentStep:
        self.calls.append(([log[-1] for log in message_logs], [dict(m) for m in metadata]))
        turns = [sum(m.role == "assistant" for m in log) for log in message_logs]
        terminated = [m["label"] == 0 and t >= self.options.end_after for m, t in zip(metadata, turns, strict=True)]
        return EnvironmentStep(
            observations=["really bad =>"] * len(message_logs),
            rewards=torch.tensor([1.0 + 10 * d for d in terminated]),
            terminated=torch.tensor(terminated),
            next_stop_strings=[[self.options.stop]] * len(message_logs),
            metadata=[{**m, "seen": m.get("seen", 0) + 1} for m in metadata],
        )


def collector(policy, tok, env, max_turns: int, max_length: int = 64, env_thread: EnvironmentThread | None = None,
              step_timeout_s: float | None = None) -> MultiTurnCollector:
    return MultiTurnCollector(
        environment=env, env_thread=env_thread or EnvironmentThread("test"), step_timeout_s=step_timeout_s, tokenizer=tok, max_turns=max_turns, max_length=max_length, policy=policy, reference=ResidentReference(policy),
        backend=TorchGenerationBackend(policy, tok.pad_token_id, torch.device("cpu"), tokenizer=tok), critic=None,
        score=None, pad_id=tok.pad_token_id, device=torch.device("cpu"), generation_batch_size=8,
        logprob_passes=PassLimits(rows=8), timers=Timers())


def test_episodes_alternate_generation_and_the_environment(policy, tok):
    env = build_environment("tests.test_multiturn:ScriptedEnvironment", {"end_after": 2}, EnvironmentContext(tok))
    prompts = [Prompt(tok(p, add_special_tokens=False)["input_ids"], label=i)
               for i, p in enumerate(["river castle =>", "garden ocean winter =>", "city =>"])]
    c = collector(policy, tok, env, max_turns=3)
    env.calls.clear()
    batch = c.generate(prompts, SamplingParams(10, 1.0, 0, 1.0, (tok.eos_token_id,)), seed=5, generations=2)
    r, obs = batch.rollout, tok("really bad =>", add_special_tokens=False)["input_ids"]

    # the first step sees every sample with the prompt's label; later steps only the running ones, metadata kept
    assert [m["label"] for m in env.calls[0][1]] == [0, 0, 1, 1, 2, 2]
    assert all(m["seen"] == 1 for m in env.calls[1][1])
    # rows 0 and 1 (the generations of prompt 0) terminate after 2 turns; the rest run to max_rollout_turns
    turns = count_turns(batch.mask).tolist()
    assert turns == [2, 2, 3, 3, 3, 3] and [len(calls) for calls, _ in env.calls] == [6, 6, 4]
    assert batch.rewards.tolist() == [12.0, 12.0, 3.0, 3.0, 3.0, 3.0]
    for i in range(6):
        row = r.tokens[i, :r.lengths[i]].tolist()
        m = batch.mask[i].tolist()
        sampled = [row[t + 1] for t in range(len(m)) if m[t]]
        hidden = [row[t + 1] for t in range(r.prompt_lengths[i] - 1, len(m)) if not m[t] and t + 1 < len(row)]
        assert hidden == obs * (turns[i] - 1)  # every non-sampled response token is an observation's
        assert len(sampled) + len(hidden) == int(r.response_lengths[i])
    # the environment's stop string ends every turn after the first right after its first occurrence
    later = [msg.text.split() for calls, _ in env.calls[1:] for msg in calls]
    assert all("a" not in " ".join(words[:-1]) for words in later)
    assert any(words and "a" in words[-1] for words in later)
    # the policy's log-probs of the sampled tokens equal generation's: the mask lines up with the tokens
    assert torch.allclose(batch.logprobs * batch.mask, r.logprobs * batch.mask, atol=1e-4)
    assert batch.ref_logprobs is not None and batch.values is None


def test_the_context_limit_ends_an_episode_and_bad_environments_are_named(policy, tok, caplog):
    env = build_environment("tests.test_multiturn:ScriptedEnvironment", {"end_after": 99}, EnvironmentContext(tok))
    prompt = Prompt(tok("river castle =>", add_special_tokens=False)["input_ids"])
    c = collector(policy, tok, env, max_turns=5, max_length=3 + 6 + 3 + 6)  # room for two turns of 6 tokens
    batch = c.generate([prompt], SamplingParams(6, 1.0, 0, 1.0, ()), seed=1, generations=2)
    assert count_turns(batch.mask).tolist() == [2, 2] and int(batch.rollout.lengths.max()) <= 18
    assert "2 of 2 episodes ended before ppo.max_rollout_turns: ScriptedEnvironment's observation" in caplog.text

    class Short(ScriptedEnvironment):
        def step(self, message_logs, metadata):
            out = super().step(message_logs, metadata)
            out.rewards = out.rewards[:1]
            return out

    c = collector(policy, tok, Short(ScriptOptions(), EnvironmentContext(tok)), max_turns=2)
    with pytest.raises(BadEnvironment, match=re.escape("Short.step was given 2 samples but answered {'rewards': 1}")):
        c.generate([prompt], SamplingParams(4), seed=1, generations=2)
    with pytest.raises(BadEnvironment, match="env.feedback='river zebra =>'.*zebra"):
        build_environment("retry_with_feedback", {"feedback": "river zebra =>"}, EnvironmentContext(tok))

    class Raising(ScriptedEnvironment):
        def step(self, message_logs, metadata):
            raise KeyError("score")

    c = collector(policy, tok, Raising(ScriptOptions(), EnvironmentContext(tok)), max_turns=2)
    with pytest.raises(BadEnvironment, match=re.escape("Raising.step raised KeyError: 'score'")):  # the run keeps its
        c.generate([prompt], SamplingParams(4), seed=1, generations=2)  # last step (PPOTrainer.fit) and exits 1

    class Exiting(ScriptedEnvironment):  # sys.exit in the user's code ended the run with exit 0, nothing saved
        def step(self, message_logs, metadata):
            raise SystemExit(0)

    c = collector(policy, tok, Exiting(ScriptOptions(), EnvironmentContext(tok)), max_turns=2)
    with pytest.raises(BadEnvironment, match=re.escape("Exiting.step raised SystemExit: 0")):
        c.generate([prompt], SamplingParams(4), seed=1, generations=2)


class Stalling(ScriptedEnvironment):
    """Records the threads it runs on; a step waits for `release` (a sandbox that stopped answering)."""

    release = threading.Event()

    def __init__(self, options, context):
        super().__init__(options, context)
        self.threads = {threading.get_ident()}

    def step(self, message_logs, metadata):
        self.threads.add(threading.get_ident())
        if self.options.end_after == 77:
            self.release.wait(60)
        return super().step(message_logs, metadata)


def test_a_step_that_does_not_return_in_time_stops_the_run_naming_the_environment(policy, tok):
    """env.step_timeout_s: a step that hangs stops the run (BadEnvironment: the trainer keeps its last finished step
    and exits 1) instead of hanging with it; the constructor and every step run on the environment's own thread."""
    cfg = load_config(ActorConfig, None, ["env.name=tests.test_multiturn:Stalling", "env.end_after=77",
                                          "env.step_timeout_s=0.5", "ppo.max_rollout_turns=2"])
    assert cfg.env.options == {"end_after": 77} and cfg.env.step_timeout_s == 0.5
    make = multi_turn_collector(cfg, tok, None, max_length=64)
    env, thread = make.keywords["environment"], make.keywords["env_thread"]
    prompt = Prompt(tok("river castle =>", add_special_tokens=False)["input_ids"])
    c = collector(policy, tok, env, max_turns=2, env_thread=thread, step_timeout_s=cfg.env.step_timeout_s)
    started = time.monotonic()
    try:
        with pytest.raises(BadEnvironment, match=re.escape(
                "Stalling.step did not return within env.step_timeout_s=0.5 s (2 samples, turn 1): the environment "
                "hangs or is too slow; raise env.step_timeout_s (null waits as long as it takes)")):
            c.generate([prompt], SamplingParams(4), seed=1, generations=2)
        assert time.monotonic() - started < 30
    finally:
        Stalling.release.set()
    assert len(env.threads) == 1 and threading.get_ident() not in env.threads
    assert load_config(ActorConfig, None, []).env.step_timeout_s == 600
    assert load_config(ActorConfig, None, ["env.step_timeout_s=null"]).env.step_timeout_s is None
    with pytest.raises(ConfigError, match="env.step_timeout_s"):
        load_config(ActorConfig, None, ["env.step_timeout_s=0"])


class FailsToStart(ScriptedEnvironment):
    def __init__(self, options, context):
        raise RuntimeError("no such dataset")


def test_an_environment_that_fails_to_start_or_import_is_named(tmp_path, monkeypatch):
    with pytest.raises(BadEnvironment, match=re.escape("env.name=tests.test_multiturn:FailsToStart: its constructor "
                                                       "raised RuntimeError: no such dataset")):
        build_environment("tests.test_multiturn:FailsToStart", {}, EnvironmentContext(None))
    (tmp_path / "broken_env.py").write_text("import nothing_here_either as x\n1/0\n")
    (tmp_path / "typo_env.py").write_text("def step(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="env.name=broken_env:Env: cannot import it: No module named"):
        load_config(ActorConfig, None, ["env.name=broken_env:Env"])
    with pytest.raises(ConfigError, match="env.name=typo_env:Env: importing typo_env raised SyntaxError"):
        load_config(ActorConfig, None, ["env.name=typo_env:Env"])


def test_config_refuses_what_does_not_fit_together():
    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(ActorConfig, None, list(overrides))
        return str(e.value)

    assert "set env.name" in error("ppo.max_rollout_turns=3")
    assert "reward.source=critic" in error("env.name=retry_with_feedback", "reward.source=critic")
    assert "env.scorer" in error("env.name=retry_with_feedback", "env.scorer=llm")
    assert "env.threshhold" in error("env.name=retry_with_feedback", "env.threshhold=0.4")
    assert "unknown environment 'chess'" in error("env.name=chess")
    assert "not an environment" in error("env.name=tests.test_multiturn:collector")
    assert "gdpo" in error("env.name=retry_with_feedback", "ppo.adv_estimator.name=gdpo",
                           "ppo.num_generations_per_prompt=2")
    assert "policy.generation.stop_strings" in error('policy.generation.stop_strings=["a", ""]')
    cfg = load_config(ActorConfig, None, ["env.name=retry_with_feedback", "env.scorer=reward_server"])
    assert cfg.env.options == {"scorer": "reward_server"} and cfg.env.uses_reward_server


# --- against real servers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rule_reward(embedded_cache, log_dir):
    """A reward server scoring with the embedded task's rule, so its scores can be compared exactly."""
    with ServiceProcess("reward", "--scorer", "positive_fraction", log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def critic(embedded_cache, log_dir, tmp_path_factory):
    with ServiceProcess("critic", "--checkpoint-dir", str(tmp_path_factory.mktemp("ckpt")), log_dir=log_dir) as server:
        yield server


def test_the_reward_server_as_the_environments_scorer(rule_reward, tok):
    """The same answers scored by the environment's local rule and by a reward server over gRPC: equal rewards,
    terminations and feedback."""
    client = RewardClient(RewardConfig(address=rule_reward.address))
    try:
        remote = build_environment("retry_with_feedback", {"scorer": "reward_server"}, EnvironmentContext(tok, client))
        local = build_environment("retry_with_feedback", {}, EnvironmentContext(tok))
        prompt = tok("river castle =>", add_special_tokens=False)["input_ids"]
        logs = []
        for answer in ("good great bad <eos>", "sad dull", "happy", "the a"):
            ids = tok(answer, add_special_tokens=False)["input_ids"]
            logs.append([Message("user", "river castle =>", tuple(prompt)),
                         Message("assistant", tok.decode(ids, skip_special_tokens=True), tuple(ids))])
        meta = [{"label": None}, {"label": None, "score": 0.5}, {"label": None}, {"label": None}]
        a, b = remote.step(logs, meta), local.step(logs, meta)
        truth = torch.tensor([positive_fraction(m[-1].text) for m in logs])
        assert torch.allclose(a.rewards, truth - torch.tensor([0, 0.5, 0, 0])) and torch.allclose(a.rewards, b.rewards)
        assert a.terminated.tolist() == b.terminated.tolist() == [True, False, True, False]
        assert a.observations == ["", " really bad =>", "", " really bad =>"]  # a word of its own after the answer
        assert [m["score"] for m in a.metadata] == pytest.approx(truth.tolist())
    finally:
        client.close()


def test_multiturn_config_raises_the_reward_against_real_servers(rule_reward, critic, tmp_path):
    """`configs/multiturn.yaml` (GAE with the critic server, the environment scoring through the reward server)
    in a short run: episodes take several turns at first, observations stay out of the loss, and the reward rises."""
    run = run_actor("multiturn", tmp_path / "run", "ppo.max_num_steps=6", "ppo.num_prompts_per_step=32",
                    "ppo.val_period=0", "ppo.val_at_end=true", "ppo.max_val_samples=16", "checkpointing.enabled=false",
                    "logger.num_val_samples_to_print=2", f"reward.address={rule_reward.address}",
                    f"critic.address={critic.address}", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7))
    first = rows[0]
    assert first["train_rollouts/turns"] > 1.5  # the SFT policy scores ~0.25: most samples get feedback
    assert first["train_rollouts/assistant_tokens"] < first["train_rollouts/response_lengths"]
    assert rows[-1]["timers/environment"] > 0 and "critic/loss" in rows[-1] and "val/rewards" in rows[-1]
    rewards = [r["train_rollouts/rewards"] for r in rows]
    assert sum(rewards[-2:]) / 2 - rewards[0] >= 0.15, rewards
    assert "really bad =>" in run.stdout + run.stderr  # the printed samples show the conversation


def test_retry_feedback_stays_a_word_of_its_own_with_a_byte_level_tokenizer():
    """Byte-level BPE marks a word start with its space: the observation must carry one, or its first word is glued
    to the answer's last ("awfulreally") in the sequence the policy continues."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from embedded.task import VOCAB

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([" ".join(VOCAB)] * 4, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    env = build_environment("retry_with_feedback", {}, EnvironmentContext(tok))
    prompt, answer = tok("river castle =>")["input_ids"], tok(" awful")["input_ids"]
    step = env.step([[Message("user", "river castle =>", tuple(prompt)),
                      Message("assistant", " awful", tuple(answer))]], [{"label": None}])
    observation = tok(step.observations[0], add_special_tokens=False)["input_ids"]
    assert tok.decode(prompt + answer + observation) == "river castle => awful really bad =>"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rewards", [1.0, 0.0], "rewards must be a 1-D tensor"),
    ("rewards", torch.zeros(2, 1), r"rewards must be a 1-D tensor \[N\], got a tensor of shape \[2, 1\]"),
    ("terminated", [True, False], "terminated must be a 1-D tensor"),
    ("observations", [None, "so =>"], "every observation must be a str"),
    ("next_stop_strings", ["</a>", None], "next_stop_strings holds, per sample, None or a list"),
    ("metadata", None, "metadata must be a list"),
    # a float read as a truth value ended every episode at once
    ("terminated", torch.tensor([0.3, 0.0]), "terminated must be a bool tensor, got torch.float32"),
])
def test_an_environment_answering_with_wrong_types_is_named(field, value, message):
    answer = {"observations": ["", "so =>"], "rewards": torch.zeros(2), "terminated": torch.tensor([True, False]),
              "next_stop_strings": [None, ["</a>"]], "metadata": [{}, {}]}
    EnvironmentStep(**answer).check(2, "Mine")
    with pytest.raises(BadEnvironment, match=f"Mine.step: {message}"):
        EnvironmentStep(**{**answer, field: value}).check(2, "Mine")


def test_the_seeds_derived_for_batches_and_turns_stay_within_what_torch_takes():
    """A turn's seed is ppo.seed + step, times the scales of a dynamic-sampling batch, a generation batch and a turn:
    past a ppo.seed of about 1.8e5 that product passed 2**64 and torch refused it (RuntimeError: Overflow when
    unpacking long) at the first generation. Seeds are now taken modulo 2**63, the same as before below it."""
    from actor.rollouts import SEED_SPACE, derived_seed

    assert derived_seed(7, 1_009, 2) == 7 * 1_009 + 2 and derived_seed(7, 100_003, 64) == 7 * 100_003 + 64
    seed = 2**32 - 1 + 10**6  # the largest ppo.seed, a million steps on
    for scale, offset in ((1_009, 9), (100_003, 4096), (1_000_003, 7_919 * 7), (1, 3)):
        seed = derived_seed(seed, scale, offset)
        assert 0 <= seed < SEED_SPACE
        torch.Generator().manual_seed(seed)
