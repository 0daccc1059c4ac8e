"""Every algorithm as a user runs it: `python -m actor --config configs/<algo>.yaml` against real servers.

Rewards with labels, a reward model with its own tokenizer, OpenRLHF's protocol, dynamic sampling, runs with no
critic anywhere, and each example config raising the embedded task's reward.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from actor.clients import RewardClient
from actor.config import RewardConfig
from actor.data import Prompt
from actor.generation import Rollout
from actor.rollouts import chat_scorer, text_scorer, token_scorer
from tests.service_procs import ROOT, ServiceProcess, actor_command, free_port
from tests.test_generation import padded_output

SMALL = ["checkpointing.enabled=false", "ppo.val_period=0", "ppo.num_prompts_per_step=8",
         "ppo.num_generations_per_prompt=4", "policy.generation_batch_size=16", "policy.train_global_batch_size=16",
         "policy.train_micro_batch_size=16", "logger.num_val_samples_to_print=0", "policy.generation.max_new_tokens=8"]


def run_actor(config: str, run_dir, *overrides: str, timeout: float = 300,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m actor` run to its end; `env`: variables set on top of this process's environment."""
    return subprocess.run(actor_command(config, run_dir, *overrides), check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reward(embedded_cache, log_dir):
    """The demo's reward server: the learned RM with two rule components."""
    with ServiceProcess("reward", "components=[positive_fraction,no_negative]", log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def critic(embedded_cache, log_dir, tmp_path_factory):
    with ServiceProcess("critic", "--checkpoint-dir", str(tmp_path_factory.mktemp("ckpt")), log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def exact_match(embedded_cache, log_dir):
    """A rule-based reward server that pays a response equal to its prompt's label: one component."""
    with ServiceProcess("reward", "--scorer", "exact_match", log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def labelled_prompts(embedded_assets, tmp_path_factory):
    """Embedded prompts with a label each: a positive word, so exact_match pays responses that are just it."""
    path = tmp_path_factory.mktemp("data") / "labelled.jsonl"
    lines = embedded_assets.prompts_train.read_text().splitlines()[:64]
    path.write_text("".join(json.dumps({**json.loads(line), "label": "good"}) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def permuted_reward_model(embedded_assets, tmp_path_factory):
    """The embedded reward model with a different tokenizer: the ids of 'good' and 'bad' swapped, and its
    embedding rows swapped with them, so it scores every text exactly as the original does."""
    out = tmp_path_factory.mktemp("permuted-rm")
    tok = AutoTokenizer.from_pretrained(embedded_assets.reward_model)
    vocab = tok.get_vocab()
    a, b = vocab["good"], vocab["bad"]
    vocab["good"], vocab["bad"] = b, a
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tok.unk_token))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=tok.pad_token, unk_token=tok.unk_token,
                            bos_token=tok.bos_token, eos_token=tok.eos_token,
                            model_max_length=tok.model_max_length).save_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(embedded_assets.reward_model)
    emb = model.get_input_embeddings().weight.data
    emb[[a, b]] = emb[[b, a]]
    model.save_pretrained(out)
    return out


# --- rewards ------------------------------------------------------------------------------------------------


def test_labels_reach_the_scorer_as_tokens_and_as_text(embedded_assets, exact_match):
    tok = AutoTokenizer.from_pretrained(embedded_assets.policy)
    prompt, good, bad = tok("river =>")["input_ids"], tok("good")["input_ids"], tok("bad")["input_ids"]
    rows = [prompt + good, prompt + bad, prompt + good]
    tokens = torch.tensor(rows)
    rollout = Rollout(tokens, torch.tensor([len(r) for r in rows]), torch.tensor([len(prompt)] * 3),
                      torch.ones(3, dtype=torch.bool))
    client = RewardClient(RewardConfig(address=exact_match.address))
    try:
        prompts = [Prompt(prompt, messages=[{"role": "user", "content": "river =>"}])] * 3
        rewards, _ = token_scorer(client)(rollout, prompts, ["good", "good", "bad"]).result()
        assert rewards.tolist() == [1.0, 0.0, 0.0]
        rewards, _ = text_scorer(client, tok)(rollout, prompts, ["good", "bad", {"not": "good"}]).result()
        assert rewards.tolist() == [1.0, 1.0, 0.0]
        rewards, _ = chat_scorer(client, tok)(rollout, prompts, ["good", "good", "bad"]).result()
        assert rewards.tolist() == [1.0, 0.0, 0.0]
        # special tokens inside a response (a chat template's markup between turns) reach the scorer in its text only
        # with reward.skip_special_tokens=false; the EOS a response ends with, a rule scorer never reads (OpenRLHF's
        # queries all end with it, and no label does)
        eos = tok.eos_token_id
        ended = [prompt + good + [eos] + good + [eos]]
        ended = Rollout(torch.tensor(ended), torch.tensor([len(ended[0])]), torch.tensor([len(prompt)]),
                        torch.ones(1, dtype=torch.bool))
        labels = ["good good", f"good {tok.eos_token} good", f"good {tok.eos_token} good {tok.eos_token}"]
        assert [text_scorer(client, tok)(ended, prompts[:1], [x]).result()[0].item()
                for x in labels] == [1.0, 0.0, 0.0]
        assert [text_scorer(client, tok, skip_special_tokens=False)(ended, prompts[:1], [x]).result()[0].item()
                for x in labels] == [0.0, 1.0, 0.0]
        # a conversation's response never carries the policy's special tokens
        assert [chat_scorer(client, tok)(ended, prompts[:1], [x]).result()[0].item()
                for x in labels] == [1.0, 0.0, 0.0]
    finally:
        client.close()


def test_grpo_with_exact_match_on_labelled_prompts(exact_match, labelled_prompts, tmp_path):
    run = run_actor("grpo", tmp_path / "run", *SMALL, "ppo.max_num_steps=2", f"reward.address={exact_match.address}",
                    f"data.train_file={labelled_prompts}", critic_dead(), "logger.num_val_samples_to_print=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| label 'good'" in run.stdout + run.stderr  # the printed samples show what they were scored against
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("train_rollouts/reward/exact_match" in r for r in rows)
    # without labels the scorer cannot work: a start-up error naming the line and the key
    run = run_actor("grpo", tmp_path / "run2", *SMALL, f"reward.address={exact_match.address}", critic_dead())
    assert run.returncode == 1
    assert "prompts_train.jsonl:1" in run.stderr and "data.label_key" in run.stderr, run.stderr[-2000:]


def test_a_reward_model_with_its_own_tokenizer_gets_texts(embedded_cache, permuted_reward_model, log_dir, tmp_path):
    with ServiceProcess("reward", "--model", str(permuted_reward_model), log_dir=log_dir) as server:
        run = run_actor("grpo", tmp_path / "run", *SMALL, "ppo.max_num_steps=1", f"reward.address={server.address}",
                        critic_dead())
        assert run.returncode == 0, run.stderr[-3000:]
        assert "gets decoded texts: its tokenizer differs from the policy's" in run.stderr
        assert 0.0 <= metrics(tmp_path / "run")[0]["train_rollouts/rewards"] <= 1.1
        run = run_actor("grpo", tmp_path / "run2", *SMALL, "reward.input=tokens", f"reward.address={server.address}",
                        critic_dead())
        assert run.returncode == 1 and "reward.input=text" in run.stderr, run.stderr[-2000:]
        run = run_actor("grpo", tmp_path / "run3", *SMALL, "reward.input=chat", f"reward.address={server.address}",
                        critic_dead())
        assert run.returncode == 1 and "has no chat template to render conversations with" in run.stderr, \
            run.stderr[-2000:]


def test_a_chat_reward_model_gets_conversations_rendered_by_its_own_template(permuted_reward_model, log_dir,
                                                                            tmp_path):
    """A reward model whose tokenizer differs from the policy's and has a chat template: `auto` sends each prompt's
    messages and the response, which the server renders with that template. The template here renders them as the
    plain text the model was trained on, so the same run sending texts gets the same rewards."""
    import shutil

    shutil.copytree(permuted_reward_model, tmp_path / "chat-rm")
    tok = AutoTokenizer.from_pretrained(tmp_path / "chat-rm")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
    tok.save_pretrained(tmp_path / "chat-rm")
    with ServiceProcess("reward", "--model", str(tmp_path / "chat-rm"), "components=[positive_fraction]",
                        log_dir=log_dir) as server:
        run = run_actor("grpo", tmp_path / "run", *SMALL, "ppo.max_num_steps=1", f"reward.address={server.address}",
                        critic_dead())
        texts = run_actor("grpo", tmp_path / "texts", *SMALL, "ppo.max_num_steps=1", "reward.input=text",
                          f"reward.address={server.address}", critic_dead())
    assert run.returncode == 0 and texts.returncode == 0, (run.stderr + texts.stderr)[-3000:]
    assert "gets conversations, rendered with its own chat template: its tokenizer differs" in run.stderr
    row, text_row = metrics(tmp_path / "run")[0], metrics(tmp_path / "texts")[0]
    assert 0.0 <= row["train_rollouts/rewards"] <= 1.1 and "train_rollouts/reward/positive_fraction" in row
    for key in ("train_rollouts/rewards", "train_rollouts/reward/positive_fraction"):
        assert row[key] == pytest.approx(text_row[key], abs=1e-6), key


def test_a_rule_scorer_with_another_tokenizer_names_its_tokenizer_key(embedded_cache, permuted_reward_model,
                                                                      log_dir, tmp_path):
    with ServiceProcess("reward", "--scorer", "positive_fraction", f"tokenizer={permuted_reward_model}",
                        log_dir=log_dir) as server:
        run = run_actor("grpo", tmp_path / "run", *SMALL, "reward.input=tokens", f"reward.address={server.address}",
                        critic_dead())
        assert run.returncode == 1 and "`tokenizer` key" in run.stderr, run.stderr[-2000:]


def test_openrlhf_reward_source(reward, tmp_path):
    url = f"{reward.http}/get_reward"
    run = run_actor("grpo", tmp_path / "run", *SMALL, "ppo.max_num_steps=1", "reward.source=openrlhf",
                    f"reward.url={url}", critic_dead())
    assert run.returncode == 0, run.stderr[-3000:]
    row = metrics(tmp_path / "run")[0]
    assert "train_rollouts/reward/positive_fraction" in row and "train_rollouts/reward/no_negative" in row
    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    run = run_actor("grpo", tmp_path / "run2", *SMALL, "reward.source=openrlhf", f"reward.url={dead}",
                    "reward.retries=1", critic_dead())
    assert run.returncode == 1 and dead in run.stderr and "cannot connect after 2 tries" in run.stderr


def test_a_policy_padded_past_its_tokenizer_samples_only_ids_the_reward_server_reads(reward, embedded_assets, tmp_path):
    """A policy whose output has more rows than its tokenizer has ids (as Qwen's and Pythia's are padded): the
    reward server, sharing the tokenizer, gets token ids and takes only ids in its vocabulary."""
    padded = tmp_path / "padded"
    padded_output(AutoModelForCausalLM.from_pretrained(embedded_assets.policy), 16, 3.0).save_pretrained(padded)
    AutoTokenizer.from_pretrained(embedded_assets.policy).save_pretrained(padded)
    run = run_actor("grpo", tmp_path / "run", *SMALL, "ppo.max_num_steps=1", f"policy.model_name={padded}",
                    f"reward.address={reward.address}", "reward.input=tokens", critic_dead())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the ids past the tokenizer's are never sampled" in run.stderr


# --- estimators and sampling ------------------------------------------------------------------------------


def critic_dead() -> str:
    """A critic address where nothing listens: runs that need no critic must never try it."""
    return f"critic.address=127.0.0.1:{free_port()}"


def test_grpo_runs_without_any_critic_server(reward, tmp_path):
    run = run_actor("grpo", tmp_path / "run", *SMALL, "ppo.max_num_steps=2", f"reward.address={reward.address}",
                    critic_dead(), "critic.connect_timeout_s=1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "needs no critic values: no critic server is used" in run.stderr
    rows = metrics(tmp_path / "run")
    assert not any(k.startswith("critic/") for r in rows for k in r)
    assert all(r["train_rollouts/rollout_size"] == 32 and r["train_rollouts/num_groups"] == 8 for r in rows)
    # overlong_filtering (on by default): responses cut off at max_new_tokens get no policy gradient
    for r in rows:
        ended = r["train_rollouts/fraction_of_samples_properly_ended"]
        assert (r["train_rollouts/loss_tokens_fraction"] < 1.0) == (ended < 1.0), r


def test_dynamic_sampling_keeps_whole_groups(reward, tmp_path):
    run = run_actor("dapo", tmp_path / "run", *SMALL, "ppo.max_num_steps=2", f"reward.address={reward.address}",
                    critic_dead())
    assert run.returncode == 0, run.stderr[-3000:]
    for r in metrics(tmp_path / "run"):
        assert r["train_rollouts/rollout_size"] == 32 and r["train_rollouts/num_groups"] == 8
        assert r["train_rollouts/dynamic_sampling_gen_batches"] >= 1
        assert r["train_rollouts/loss_tokens_fraction"] == 1.0  # dapo.yaml: overlong_filtering false


def test_dynamic_sampling_fails_clearly_at_its_limit(exact_match, labelled_prompts, tmp_path):
    # exact_match against a label no response can equal: every group's rewards are all 0
    path = tmp_path / "never.jsonl"
    path.write_text(labelled_prompts.read_text().replace('"label": "good"', '"label": "no such answer"'))
    run = run_actor("dapo", tmp_path / "run", *SMALL, "ppo.dynamic_sampling_max_gen_batches=2",
                    f"reward.address={exact_match.address}", f"data.train_file={path}", critic_dead())
    assert run.returncode == 1
    assert "dynamic sampling kept 0 of the 8 prompt groups" in run.stderr, run.stderr[-2000:]
    assert "ppo.dynamic_sampling_max_gen_batches" in run.stderr
    # on a line of its own, not after the progress bar's (where `grep '^error:'` missed it)
    assert re.search(r"^error: dynamic sampling kept 0", run.stderr, re.MULTILINE), run.stderr[-2000:]


def test_gdpo_refuses_a_reward_source_with_one_component(exact_match, labelled_prompts, tmp_path):
    run = run_actor("gdpo", tmp_path / "run", *SMALL, f"reward.address={exact_match.address}",
                    f"data.train_file={labelled_prompts}", critic_dead())
    assert run.returncode == 1 and "gdpo needs at least two reward components" in run.stderr, run.stderr[-2000:]


# --- learning ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ppo", "grpo", "gdpo", "reinforce_pp", "dapo"])
def test_every_example_config_raises_the_reward(config, reward, critic, tmp_path):
    """A short run of each example config on the embedded task; loose bound: the ground-truth reward (the
    positive fraction) of the last two steps beats the first step's by 0.1."""
    run = run_actor(config, tmp_path / "run", "ppo.max_num_steps=8", "ppo.val_period=0", "checkpointing.enabled=false",
                    "logger.num_val_samples_to_print=0", f"reward.address={reward.address}",
                    f"critic.address={critic.address}", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    truth = [r["train_rollouts/reward/positive_fraction"] for r in rows]
    assert sum(truth[-2:]) / 2 - truth[0] >= 0.1, truth


def test_warmup_validation_adaptive_kl_and_importance_sampling_in_one_run(reward, critic, tmp_path):
    """The critic trains from step 1 and the policy after policy_training_start_step steps of warm-up; validation before the
    first step and after the last; the adaptive controller moves beta; TIS reports its weights."""
    run = run_actor("ppo", tmp_path / "run", "ppo.max_num_steps=2", "ppo.num_prompts_per_step=16",
                    "policy.generation_batch_size=8", "policy.train_global_batch_size=8",
                    "policy.train_micro_batch_size=4", "checkpointing.enabled=false", "logger.num_val_samples_to_print=0",
                    "ppo.policy_training_start_step=1", "ppo.val_period=0", "ppo.val_at_start=true",
                    "ppo.val_at_end=true", "ppo.max_val_samples=8", "ppo.val_batch_size=4",
                    "ppo.kl_controller.type=adaptive", "ppo.kl_controller.horizon=100",
                    "loss_fn.token_level_loss=false", "loss_fn.ratio_clip_c=3",
                    "loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
                    f"reward.address={reward.address}", f"critic.address={critic.address}")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["step"]: r for r in metrics(tmp_path / "run")}
    assert sorted(rows) == [0, 1, 2]
    assert "val/rewards" in rows[0] and "train_rollouts/rewards" not in rows[0]
    assert "val/rewards" not in rows[1] and "val/rewards" in rows[2]
    assert "train_optim/loss" not in rows[1] and "train_optim/loss" in rows[2]
    assert rows[2]["critic/train_step"] > rows[1]["critic/train_step"] > 0
    assert rows[1]["train_rollouts/kl_coef"] == 0.01 and rows[2]["train_rollouts/kl_coef"] != 0.01
    # the torch backend generates with the trained policy itself: its weights are 1 up to float error
    assert abs(rows[2]["train_optim/is_weight_mean"] - 1.0) < 1e-3


def test_reused_log_probs_critic_epochs_and_ignored_eos_with_the_step_breakdown(reward, critic, tmp_path):
    """The performance options a user sets: no policy log-prob pass (generation's are reused; the first epoch's
    ratio stays 1 up to their error), the critic trained every PPO epoch, every response max_new_tokens long, the
    reference pass and the training micro-batches cut by tokens (NeMo-RL's policy.dynamic_batching), truncated
    responses trained on (ppo.overlong_filtering=false, as in the bench); each step prints where its time went."""
    run = run_actor("ppo", tmp_path / "run", *SMALL, "ppo.max_num_steps=2", "ppo.ppo_epochs=2", "critic.ppo_epochs=2",
                    "policy.generation.reuse_logprobs=true", "policy.generation.ignore_eos=true",
                    "policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=64",
                    "policy.dynamic_batching.logprob_mb_tokens=48", "policy.dynamic_batching.sequence_length_round=4",
                    "ppo.overlong_filtering=false",
                    f"reward.address={reward.address}", f"critic.address={critic.address}")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "timers/logprobs" not in r and r["timers/generate"] > 0 and r["timers/init_logprobs"] > 0
        assert r["train_rollouts/response_lengths"] == 8 and r["train_rollouts/fraction_of_samples_properly_ended"] == 0
        assert r["critic/optimizer_steps"] == 2 and r["timers/critic_train"] > 0
        assert r["timers/other"] >= 0
    assert all(r["train_rollouts/loss_tokens_fraction"] == 1 and r["train_optim/ppo_ratio"] > 0 for r in rows)
    assert rows[1]["critic/train_step"] - rows[0]["critic/train_step"] == 2
    breakdown = [line for line in run.stderr.splitlines() + run.stdout.splitlines() if line.startswith("step 2 time")]
    assert breakdown and "generation" in breakdown[0] and "actor train" in breakdown[0], run.stderr[-2000:]


def test_reusing_log_probs_with_importance_sampling_is_refused(tmp_path):
    run = run_actor("ppo", tmp_path / "run", "policy.generation.reuse_logprobs=true",
                    "loss_fn.use_importance_sampling_correction=true")
    assert run.returncode == 2
    assert "policy.generation.reuse_logprobs" in run.stderr and "use_importance_sampling_correction" in run.stderr
