"""Config loading, prompt-file errors and the actor's start-up compatibility checks."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from typing import get_args

import pytest
from transformers import AutoTokenizer

from actor.clients import IncompatibleServer, check_compatible
from actor.config import ActorConfig
from actor.data import (
    DataError,
    Prompt,
    PromptFormat,
    PromptSampler,
    load_prompts,
    require_labels,
    resolve_data_file,
)
from critic_server.config import CriticConfig
from ppo_services.v1 import critic_pb2, reward_pb2
from reward_server.config import RewardConfig
from serving.config import ConfigError, load_config
from serving.modeling import special_affixes, text_ids
from tests.conftest import with_special_tokens
from tests.service_procs import ROOT


def test_yaml_file_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  max_num_steps: 3\n  adv_estimator:\n    gae_gamma: 0.5\n")
    cfg = load_config(ActorConfig, path, ["ppo.adv_estimator.gae_lambda=0.9", "policy.generation.stop_token_ids=[4, 5]",
                                          "policy.reference_model_name=null"])
    est = cfg.ppo.adv_estimator
    assert (cfg.ppo.max_num_steps, est.gae_gamma, est.gae_lambda, cfg.policy.generation.stop_token_ids,
            cfg.policy.reference_model_name) == (3, 0.5, 0.9, [4, 5], None)
    assert load_config(ActorConfig, ROOT / "configs" / "ppo.yaml").rollout_samples == 64


@pytest.mark.parametrize(
    "override, words",
    [
        ("ppo.gama=0.9", ["ppo.gama", "unknown key", "num_prompts_per_step", "adv_estimator"]),
        ("ppo.adv_estimator.gae_gamma=2", ["ppo.adv_estimator.gae_gamma", "less than or equal to 1", "2"]),
        ("ppo.kl_controller.kl_type=k9", ["ppo.kl_controller.kl_type", "'k1'", "'k3'"]),
        ("policy.generation.backend=vllm", ["policy.generation.backend", "'torch'"]),
        ("policy.train_micro_batch_size=5", ["policy.train_global_batch_size", "multiple", "policy.train_micro_batch_size"]),
        ("nonsense", ["KEY=VALUE"]),
        ("policy.lora.rnak=4", ["policy.lora.rnak", "unknown key", "rank", "target_modules"]),  # an optional section
        ("policy.lora.target_modules=[]", ["policy.lora.target_modules", "'all-linear'", "[]"]),
        ("policy.dynamic_batching.enabled=true", ["policy.dynamic_batching.enabled=true", "train_mb_tokens",
                                                  "logprob_mb_tokens", "positive integer"]),
        ("policy.dynamic_batching.logprob_mb_tokens=0", ["policy.dynamic_batching.logprob_mb_tokens", "greater than"]),
        ("policy.device=gpu", ["policy.device", "auto, cpu, cuda or cuda:N", "'gpu'"]),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(ActorConfig, None, [override])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_the_micro_batch_need_not_divide_the_batch_when_tokens_cut_it():
    cfg = load_config(ActorConfig, None, ["policy.train_micro_batch_size=5", "policy.dynamic_batching.enabled=true",
                                          "policy.dynamic_batching.train_mb_tokens=512",
                                          "policy.dynamic_batching.logprob_mb_tokens=1024"])
    assert cfg.policy.train_micro_batch_size == 5 and cfg.policy.dynamic_batching.enabled


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
        ('{"prompt": "river =>"}\n\n{"text": "x", "label": 1}\n', [":3:", "no 'prompt' (data.prompt_key)",
                                                                     "has 'text', 'label'"]),
        ('{"prompt": "' + " ".join(["river"] * 70) + '"}\n', [":1:", "70 tokens", "data.max_input_seq_length=64"]),
        ("", ["no prompts"]),
        ('{"prompt": "river =>"}\n{"prompt": "bad \\ud83d end"}\n', [":2:", "lone surrogate"]),
        ('{"prompt": "river =>"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"), [":2:", "not UTF-8", "0xe9", "column 16"]),
        ('{"prompt": "   "}\n', [":1:", "non-empty string 'prompt'"]),
        ('\ufeff{"prompt": "river =>"}\n{"prompt": "a\tb\x01"}\n'.encode(), [":2:", "not valid JSON", "column"]),
        # what json.dumps writes for a missing value from pandas
        ('{"prompt": "river =>", "label": 3}\n{"prompt": "city =>", "label": NaN}\n', [":2:", "NaN or Infinity",
                                                                                      "data.label_key"]),
        ('{"prompt": "river =>"}\n["river =>"]\n', [":2:", "got list"]),
        # valid JSON Python's parser refuses: an integer past 4300 digits, nesting past the recursion limit
        ('{"prompt": "river =>"}\n{"prompt": "city =>", "label": ' + "9" * 5000 + "}\n", [":2:", "4300 digits"]),
        ('{"prompt": "river =>", "label": ' + "[" * 100_000 + "]" * 100_000 + "}\n", [":1:", "nested too deeply"]),
    ],
    ids=["bad-json", "missing-key", "too-long", "empty", "lone-surrogate", "latin-1", "blank-prompt", "control-char",
         "nan-label", "not-an-object", "huge-integer", "deep-nesting"],
)
def test_prompt_file_errors_name_file_and_line(tmp_path, tokenizer, content, words):
    assert_refused(tmp_path / "prompts.jsonl", content, tokenizer, words)


def assert_refused(path, content: str | bytes, tokenizer, words: list[str]) -> None:
    """A prompt file holding `content` is refused with a DataError naming it and holding every one of `words`."""
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError) as err:
        load_prompts(path, "prompt", tokenizer, 64)
    assert str(path) in str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_a_json_array_prompt_file_loads_as_its_jsonl_twin_with_each_object_s_line(tmp_path, tokenizer):
    """Many published datasets ship as one JSON array (.json): it loads as the same objects written as JSONL, and
    each prompt keeps the line its object starts on (a pretty-printed file spreads an object over lines)."""
    rows = [{"prompt": "river =>", "label": 3}, {"prompt": "castle =>", "label": "b"}, {"prompt": "city =>"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.json").write_text("\ufeff" + json.dumps(rows, indent=2))
    as_lines, as_array = (load_prompts(tmp_path / name, "prompt", tokenizer, 64) for name in ("p.jsonl", "p.json"))
    assert [(p.ids, p.label) for p in as_array] == [(p.ids, p.label) for p in as_lines]
    assert [p.where for p in as_array] == [f"{tmp_path / 'p.json'}:{n}" for n in (2, 6, 10)]


@pytest.mark.parametrize(
    "content, words",
    [
        ('[\n  {"prompt": "river =>"},\n  {"prompt": \n]', [":4:", "not valid JSON"]),
        ('[\n  {"prompt": "river =>"},\n  {"text": "x"}\n]', [":3:", "'prompt'"]),
        ('[{"prompt": "river =>"}\n {"prompt": "city =>"}]', [":2:", "expected ',' or ']'"]),
        ('[{"prompt": "river =>"}]\n[{"prompt": "city =>"}]', [":2:", "text after the array's end"]),
        ('[{"prompt": "river =>"},]', [":1:", "not valid JSON"]),
        ("[]", ["no prompts"]),
        ('[\n{"prompt": "river =>"},\n{"prompt": "caf\xe9"}]'.encode("latin-1"), [":3:", "not UTF-8", "0xe9"]),
        ('[\n{"prompt": "river =>"},\n{"prompt": "city =>", "label": ' + "9" * 5000 + "}]", [":3:", "4300 digits"]),
    ],
    ids=["bad-json", "missing-key", "no-comma", "two-arrays", "trailing-comma", "empty", "latin-1", "huge-integer"],
)
def test_json_array_prompt_file_errors_name_file_and_line(tmp_path, tokenizer, content, words):
    assert_refused(tmp_path / "prompts.json", content, tokenizer, words)


def test_dotted_keys_reach_into_nested_objects_as_verl_lays_out_its_data(tmp_path, tokenizer):
    """verl's rows hold the answer at reward_model.ground_truth; a key the object holds with its dots wins."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "river =>", "reward_model": {"ground_truth": "72", "style": "rule"}}\n'
                    '{"prompt": "city =>", "reward_model": {"style": "rule"}, "reward_model.ground_truth": "5"}\n'
                    '{"prompt": "castle =>", "reward_model": "72"}\n')
    prompts = load_prompts(path, "prompt", tokenizer, 64, label_key="reward_model.ground_truth")
    assert [p.label for p in prompts] == ["72", "5", None]
    with pytest.raises(DataError, match=r":1: no 'extra.question' \(data.prompt_key\)"):
        load_prompts(path, "extra.question", tokenizer, 64)


def test_prompt_files_and_template_files_take_a_home_relative_path_and_a_byte_order_mark(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_data_file("~/prompts.jsonl") == tmp_path / "prompts.jsonl"
    (tmp_path / "template.txt").write_text("\ufeffQuestion: {}", encoding="utf-8")
    (tmp_path / "system.txt").write_text("\ufeffbe kind", encoding="utf-8")
    fmt = PromptFormat.from_files("~/template.txt", True, "~/system.txt")
    assert (fmt.template, fmt.system) == ("Question: {}", "be kind")


@pytest.mark.parametrize("overrides, refused", [
    ([], True), (["ppo.val_period=0"], False), (["ppo.val_period=0", "ppo.val_at_end=true"], True),
    (["data.val_file=my_val.jsonl"], False),
])
def test_own_training_prompts_with_the_embedded_validation_prompts_are_refused(overrides, refused):
    """Validating a user's policy on the embedded toy prompts scores nothing the user asked for (and fails with a
    labelling scorer, naming a file the user never gave): with validation on, data.val_file must be set too."""
    args = ["data.train_file=my_train.jsonl", "ppo.val_period=5", *overrides]
    if not refused:
        load_config(ActorConfig, None, args)
        return
    with pytest.raises(ConfigError, match="data.val_file is still the embedded toy prompts"):
        load_config(ActorConfig, None, args)


# A minimal ChatML-style template (the embedded tokenizer has none): each message on its own line, then the
# generation prompt; it refuses a conversation that does not end with the user, as many real templates do.
CHAT_TEMPLATE = (
    "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the user') }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}")


@pytest.fixture()
def chat_tokenizer(embedded_assets):
    tok = AutoTokenizer.from_pretrained(embedded_assets.policy)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_prompts_become_chat_messages_through_the_tokenizer_s_template(tmp_path, chat_tokenizer):
    """A string prompt goes into data.prompt_file's {} and, with apply_chat_template, becomes the user message after
    the system one; a list of messages (TRL's conversational format) always goes through the template; the rendered
    text is tokenized without adding special tokens, and the label still travels with it."""
    (tmp_path / "template.txt").write_text("{} =>")
    (tmp_path / "system.txt").write_text("be kind")
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "river castle", "label": 1}\n'
                    '{"prompt": [{"role": "user", "content": "river"}]}\n'
                    '{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "city"}]}\n')
    fmt = PromptFormat.from_files(None, True, str(tmp_path / "system.txt"))
    prompts = load_prompts(path, "prompt", chat_tokenizer, 64, fmt=fmt)
    texts = ["<system> be kind\n<user> river castle\n<assistant> ",
             "<system> be kind\n<user> river\n<assistant> ",
             "<system> be brief\n<user> city\n<assistant> "]
    assert [p.ids for p in prompts] == [chat_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert [p.label for p in prompts] == [1, None, None]
    plain = load_prompts(path, "prompt", chat_tokenizer, 64, fmt=PromptFormat())
    assert plain[1].ids == chat_tokenizer("<user> river\n<assistant> ", add_special_tokens=False)["input_ids"]
    path.write_text('{"prompt": "river castle", "label": 1}\n')
    with_template = PromptFormat.from_files(str(tmp_path / "template.txt"), True, str(tmp_path / "system.txt"))
    assert load_prompts(path, "prompt", chat_tokenizer, 64, fmt=with_template)[0].ids == chat_tokenizer(
        "<system> be kind\n<user> river castle =>\n<assistant> ", add_special_tokens=False)["input_ids"]
    plain = load_prompts(path, "prompt", chat_tokenizer, 64, fmt=PromptFormat.from_files(str(tmp_path / "template.txt"),
                                                                                         False, None))
    assert plain[0].ids == chat_tokenizer("river castle =>", add_special_tokens=False)["input_ids"]


def test_texts_encode_as_the_tokenizer_encodes_a_text_on_its_own(embedded_assets):
    """text_ids adds the special tokens a tokenizer puts around a text (here BOS, and EOS after it), once even when
    the text carries them already; a prompt (ending=False) gets none after it; a tokenizer that adds none (the
    embedded one) encodes as before."""
    bos = with_special_tokens(AutoTokenizer.from_pretrained(embedded_assets.policy), eos=True)
    plain = bos("river castle", add_special_tokens=False)["input_ids"]
    b, e = bos.bos_token_id, bos.eos_token_id
    assert special_affixes(bos) == ([b], [e])
    assert text_ids(bos, ["river castle", "<bos> river castle", "<bos> river castle <eos>"], ending=True) == \
        [[b, *plain, e]] * 3
    assert text_ids(bos, ["river castle", "<bos> river castle"], ending=False) == [[b, *plain]] * 2
    embedded = AutoTokenizer.from_pretrained(embedded_assets.policy)
    assert special_affixes(embedded) == ([], [])
    assert text_ids(embedded, ["river castle"], ending=True) == [plain]


def test_string_prompts_begin_as_the_tokenizer_begins_a_text_and_chat_prompts_as_the_template_writes(
        tmp_path, embedded_assets):
    """A policy whose tokenizer begins a text with BOS (Llama, Mistral, Gemma) was trained on text so begun: a string
    prompt gets that BOS once, and no EOS after it (the response continues it); a chat prompt is the template's
    rendering alone, since templates write their own BOS."""
    tok = with_special_tokens(AutoTokenizer.from_pretrained(embedded_assets.policy), eos=True)
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "river castle"}\n{"prompt": "<bos> river castle"}\n'
                    '{"prompt": [{"role": "user", "content": "river"}]}\n')
    prompts = load_prompts(path, "prompt", tok, 64)
    plain = tok("river castle", add_special_tokens=False)["input_ids"]
    assert [p.ids for p in prompts[:2]] == [[tok.bos_token_id, *plain]] * 2
    assert prompts[2].ids == tok("<bos><user> river\n<assistant> ", add_special_tokens=False)["input_ids"]
    assert prompts[2].ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize(
    "line, chat, words",
    [
        ('{"prompt": [{"role": "user"}]}', False, [":2:", "list of {\"role\": str, \"content\": str}"]),
        ('{"prompt": [{"role": "system", "content": "be kind"}, {"role": "user", "content": 7}]}', False,
         [":2:", 'message 1: expected {"role": str, "content": str}', '"content": 7']),
        ('{"prompt": 7}', False, [":2:", "non-empty string"]),
        ('{"prompt": []}', True, [":2:", "non-empty list"]),
        ('{"prompt": [{"role": "system", "content": "hi"}, {"role": "user", "content": " "}]}', True,
         [":2:", "no message but the system's has any text"]),
        ('{"prompt": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]}', True,
         [":2:", "chat template refused", "the last message must be the user"]),
        # SFT-style data whose messages hold the answer: rendered as is, the answer would sit inside the prompt
        ('{"prompt": [{"role": "user", "content": "river"}, {"role": "assistant", "content": "good"}]}', False,
         [":2:", "ends with an assistant message", "it can be the label"]),
    ],
    ids=["message-without-content", "content-not-a-string", "number", "no-messages", "no-text", "template-refuses",
         "ends-with-the-answer"],
)
def test_chat_prompt_errors_name_file_and_line(tmp_path, chat_tokenizer, line, chat, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "river"}\n' + line + "\n")
    with pytest.raises(DataError) as err:
        load_prompts(path, "prompt", chat_tokenizer, 64, fmt=PromptFormat(chat=chat))
    for w in [str(path), *words]:
        assert w in str(err.value)


def test_a_prompt_template_with_message_prompts_is_refused_naming_the_line(tmp_path, chat_tokenizer):
    """data.prompt_file's {} takes a string prompt; a line whose prompt is a list of messages left it out silently,
    so the template's instructions never reached the policy."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "river"}\n{"prompt": [{"role": "user", "content": "river"}]}\n')
    fmt = PromptFormat(template="Answer briefly: {}", chat=True)
    with pytest.raises(DataError) as err:
        load_prompts(path, "prompt", chat_tokenizer, 64, fmt=fmt)
    for w in [f"{path}:2:", "data.prompt_file formats string prompts", "data.system_prompt_file"]:
        assert w in str(err.value), str(err.value)
    path.write_text('{"prompt": "river"}\n')
    assert load_prompts(path, "prompt", chat_tokenizer, 64, fmt=fmt)[0].messages[-1]["content"] == "Answer briefly: river"


def test_chat_prompts_without_a_chat_template_and_bad_prompt_files_are_refused(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "river"}\n')
    with pytest.raises(DataError) as err:
        load_prompts(path, "prompt", tokenizer, 64, fmt=PromptFormat(chat=True))
    assert f"{path}:1:" in str(err.value) and "has none" in str(err.value)
    assert "data.apply_chat_template=false" in str(err.value)
    for text, words in (("no slot", "has no {}"), ("{} and {}", "2 fields"), ("\\boxed{} {}", "other braces doubled"),
                        ("{0} and {0}", "2 fields"), ("{0[0]} =>", "got {0[0]}"), ("{:.4} =>", "got {:.4}"),
                        ("{0.attr}", "got {0.attr}"), ("{!r}", "got {!r}"), ("{name}", "got {name}")):
        (tmp_path / "t.txt").write_text(text)
        with pytest.raises(DataError) as err:
            PromptFormat.from_files(str(tmp_path / "t.txt"), False, None)
        assert "data.prompt_file" in str(err.value) and words in str(err.value)
    with pytest.raises(DataError, match=r"data.system_prompt_file\): cannot be read"):
        PromptFormat.from_files(None, True, str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="data.system_prompt_file needs data.apply_chat_template=true"):
        load_config(ActorConfig, None, ["data.system_prompt_file=x.txt"])


def test_prompt_sampler_walks_shuffled_epochs():
    prompts = [Prompt([i]) for i in range(5)]
    sampler = PromptSampler(prompts, seed=0)
    first = sampler.take(5)
    assert sampler.finished_epochs == 1
    second = sampler.take(5)
    assert sorted(p.ids for p in first) == sorted(p.ids for p in second) == [[i] for i in range(5)]
    assert sampler.epoch == 1 and sampler.consumed == 10 and sampler.finished_epochs == 2
    assert PromptSampler(prompts, seed=0).take(5) == first


def test_labels_travel_with_prompts_and_missing_ones_name_the_line(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "river =>", "answer": 42}\n{"prompt": "castle =>", "answer": {"a": [1]}}\n'
                    '{"prompt": "city =>"}\n')
    prompts = load_prompts(path, "prompt", tokenizer, 64, label_key="answer")
    assert [p.label for p in prompts] == [42, {"a": [1]}, None]
    require_labels(prompts[:2], "answer", "the scorer needs them")
    with pytest.raises(DataError) as err:
        require_labels(prompts, "answer", "the scorer needs them")
    assert f"{path}:3" in str(err.value) and "'answer'" in str(err.value) and "data.label_key" in str(err.value)


def test_a_config_file_that_is_no_utf_8_or_no_mapping_is_refused_naming_it(tmp_path):
    for content, words in ((b"run_dir: caf\xe9\n", "not UTF-8 text (byte 12"), (b"false\n", "expected a mapping"),
                           (b"[]\n", "expected a mapping")):
        (tmp_path / "c.yaml").write_bytes(content)
        with pytest.raises(ConfigError, match=re.escape(words)) as err:
            load_config(ActorConfig, tmp_path / "c.yaml")
        assert str(tmp_path / "c.yaml") in str(err.value)
    (tmp_path / "c.yaml").write_bytes(b"")
    assert load_config(ActorConfig, tmp_path / "c.yaml") == ActorConfig()


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["ppo.kl_controller.init_kl_coef=0.1", "loss_fn.reference_policy_kl_penalty=0.1"],
         ["ppo.kl_controller.init_kl_coef", "loss_fn.reference_policy_kl_penalty"]),
        (["ppo.skip_reference_policy_logprobs_calculation=true", "loss_fn.reference_policy_kl_penalty=0.1"],
         ["ppo.skip_reference_policy_logprobs_calculation", "loss_fn.reference_policy_kl_penalty"]),
        (["ppo.skip_reference_policy_logprobs_calculation=true", "ppo.kl_controller.init_kl_coef=0.1"],
         ["ppo.skip_reference_policy_logprobs_calculation", "ppo.kl_controller.init_kl_coef"]),
        (["ppo.adv_estimator.name=grpo", "ppo.num_generations_per_prompt=1"],
         ["ppo.adv_estimator.name=grpo", "ppo.num_generations_per_prompt"]),
        (["ppo.adv_estimator.name=reinforce_plus_plus"], ["reinforce_plus_plus", "ppo.num_generations_per_prompt"]),
        (["ppo.use_dynamic_sampling=true"], ["ppo.use_dynamic_sampling", "ppo.adv_estimator.name=gae"]),
        (["ppo.use_dynamic_sampling=true", "ppo.adv_estimator.name=reinforce_plus_plus",
          "ppo.adv_estimator.minus_baseline=false", "ppo.num_generations_per_prompt=4"],
         ["ppo.use_dynamic_sampling", "minus_baseline=false"]),
        (["ppo.adv_estimator.name=grpo", "ppo.num_generations_per_prompt=4", "ppo.kl_controller.init_kl_coef=0.1"],
         ["ppo.adv_estimator.name=grpo", "ppo.kl_controller.init_kl_coef"]),
        (["reward.source=openrlhf"], ["reward.source=openrlhf", "reward.url"]),
        (["loss_fn.truncated_importance_sampling_type=tis"],
         ["loss_fn.truncated_importance_sampling_type", "loss_fn.use_importance_sampling_correction"]),
        (["loss_fn.truncated_importance_sampling_ratio_min=3", "loss_fn.truncated_importance_sampling_ratio=2"],
         ["loss_fn.truncated_importance_sampling_ratio_min (3.0)", "loss_fn.truncated_importance_sampling_ratio (2.0)"]),
        (["ppo.adv_estimator.advantage_clip_low=1", "ppo.adv_estimator.advantage_clip_high=-1"],
         ["ppo.adv_estimator.advantage_clip_low (1.0)", "ppo.adv_estimator.advantage_clip_high (-1.0)"]),
        (["ppo.reward_shaping.enabled=true", "ppo.reward_shaping.overlong_buffer_length=100",
          "ppo.reward_shaping.overlong_buffer_penalty=1", "policy.generation.max_new_tokens=16"],
         ["ppo.reward_shaping.overlong_buffer_length (100)", "policy.generation.max_new_tokens"]),
        (["ppo.batch_multiplier=3"], ["ppo.batch_multiplier (3.0)", "ppo.use_dynamic_sampling=true"]),
        # values that are no numbers, or numbers out of every range, named before anything runs
        (["policy.optimizer.kwargs.lr=true"], ["policy.optimizer.kwargs.lr: expected a number, got true"]),
        (["ppo.max_num_steps=false"], ["ppo.max_num_steps: expected a number, got false"]),
        (["policy.optimizer.kwargs.betas=[true, 0.9]"], ["policy.optimizer.kwargs.betas: expected a number"]),
        (["policy.optimizer.kwargs.eps=inf"], ["policy.optimizer.kwargs.eps", "finite"]),
        (["ppo.reward_scaling.source_min=nan"], ["ppo.reward_scaling.source_min", "finite"]),
        (["policy.optimizer.kwargs.betas=[1.5, 0.9]"], ["policy.optimizer.kwargs.betas.0", "less than 1"]),
        (["ppo.seed=99999999999999999999999"], ["ppo.seed", "less than"]),
        (["checkpointing.checkpoint_must_save_by=5400"], ["checkpointing.checkpoint_must_save_by",
                                                          "expected HH:MM:SS or DD:HH:MM:SS, got '5400'"]),
        (["checkpointing.checkpoint_must_save_by=99:99:99"], ["checkpointing.checkpoint_must_save_by", "'99:99:99'",
                                                              "from 00 to 59"]),
        (["checkpointing.checkpoint_must_save_by=01:24:00:00"], ["checkpointing.checkpoint_must_save_by",
                                                                 "hours from 00 to 23"]),
        (["data.prompt_key=@x"], ["data.prompt_key=@x", "not valid YAML", "quote"]),
        # YAML's comment would cut the value silently ("Answer #1 first" read as "Answer")
        (["data.prompt_key=Answer #1 first"], ["data.prompt_key=Answer #1 first", "cut to 'Answer'",
                                               "data.prompt_key='\"Answer #1 first\"'"]),
        (["policy.generation.stop_strings=[a, b] # c"], ["policy.generation.stop_strings", "cut to ['a', 'b']"]),
        # NeMo-RL's reward shaping: nothing unless enabled, one penalty at a time, DAPO's with both of its keys
        (["ppo.reward_shaping.stop_properly_penalty_coef=0"],
         ["ppo.reward_shaping.stop_properly_penalty_coef (0.0)", "ppo.reward_shaping.enabled=true"]),
        (["ppo.reward_shaping.enabled=true", "ppo.reward_shaping.stop_properly_penalty_coef=0.5",
          "ppo.reward_shaping.overlong_buffer_length=4"],
         ["ppo.reward_shaping.stop_properly_penalty_coef (0.5)", "ppo.reward_shaping.overlong_buffer_length"]),
        (["ppo.reward_shaping.enabled=true", "ppo.reward_shaping.overlong_buffer_length=4"],
         ["ppo.reward_shaping.enabled=true", "ppo.reward_shaping.overlong_buffer_penalty"]),
        (["policy.optimizer.kwargs.lr=inf"], ["policy.optimizer.kwargs.lr", "finite"]),
    ],
)
def test_contradictory_settings_are_refused_naming_both_keys(overrides, keys):
    with pytest.raises(ConfigError) as err:
        load_config(ActorConfig, None, overrides)
    for key in keys:
        assert key in str(err.value), (key, str(err.value))


def test_an_adaptive_kl_horizon_that_could_turn_beta_negative_is_refused():
    """beta *= 1 + err * samples / horizon with err down to -0.2: a horizon of samples / 5 or less can make the
    factor 0 or negative (horizon 10, someone thinking in steps, with 64 samples per step turned beta to -0.014
    and kept it there). Refused at start naming the key, the samples per step it was checked against and the
    allowed range."""
    adaptive = ["ppo.kl_controller.type=adaptive", "ppo.num_prompts_per_step=16",
                "ppo.num_generations_per_prompt=4"]
    for horizon in (10, 12):  # 64 samples: the horizon must be above 12.8
        with pytest.raises(ConfigError) as err:
            load_config(ActorConfig, None, [*adaptive, f"ppo.kl_controller.horizon={horizon}"])
        for words in (f"ppo.kl_controller.horizon={horizon}", "64 samples per step", "above 12.8"):
            assert words in str(err.value), (words, str(err.value))
    assert load_config(ActorConfig, None, [*adaptive, "ppo.kl_controller.horizon=13"]).ppo.kl_controller.horizon \
        == 13
    # the fixed controller never moves beta: any horizon is fine
    assert load_config(ActorConfig, None, ["ppo.kl_controller.horizon=1"]).ppo.kl_controller.horizon == 1


def test_a_hash_inside_quotes_or_a_word_is_kept():
    cfg = load_config(ActorConfig, None, ['data.prompt_key="Answer #1 first"', "data.label_key=C#",
                                          "policy.generation.stop_strings=['#', ' #x']"])
    assert (cfg.data.prompt_key, cfg.data.label_key) == ("Answer #1 first", "C#")
    assert cfg.policy.generation.stop_strings == ["#", " #x"]


@pytest.mark.parametrize("name", ["ppo", "grpo", "gdpo", "reinforce_pp", "dapo"])
def test_every_example_config_loads(name):
    cfg = load_config(ActorConfig, ROOT / "configs" / f"{name}.yaml")
    assert cfg.needs_critic == (name == "ppo")


def test_compatibility_checks_say_what_differs():
    ok = critic_pb2.CriticInfo(model="m", vocab_size=51, max_length=64, vocab_sha256="abc")
    check_compatible("critic", ok, "abc", 51, 64, "prompts + responses")
    with pytest.raises(IncompatibleServer, match="different tokenizer vocabulary.*critic must share the policy's tokenizer"):
        check_compatible("critic", ok, "abd", 51, 20, "prompts + responses")
    with pytest.raises(IncompatibleServer, match="reward server.*reward.input=text"):
        check_compatible("reward", ok, "abd", 51, 20, "prompts + responses")
    with pytest.raises(IncompatibleServer, match="reward server.*`tokenizer` key"):
        check_compatible("rule", ok, "abd", 51, 20, "prompts + responses")
    with pytest.raises(IncompatibleServer, match="accepts at most 64 tokens, but prompts \\+ responses need 80"):
        check_compatible("critic", ok, "abc", 51, 80, "prompts + responses")
    small = reward_pb2.RewardInfo(model="r", vocab_size=40, max_length=64)
    with pytest.raises(IncompatibleServer, match="vocab size 40, smaller than the policy's 51"):
        check_compatible("reward", small, "abc", 51, 20, "x")


@pytest.mark.parametrize("overrides, words", [
    (["reward.input=chat", "reward.source=openrlhf", "reward.url=http://h:8002/get_reward"],
     ["reward.input=chat", "reward.source=openrlhf", "unset reward.input"]),
    (["reward.input=chat", "env.name=retry_with_feedback", "ppo.max_rollout_turns=2"],
     ["reward.input=chat", "env.name=retry_with_feedback"]),
    (["reward.input=speech"], ["reward.input", "'chat'", "'text'"]),
])
def test_chat_reward_input_is_refused_where_nothing_would_send_conversations(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(ActorConfig, None, overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_writable_directory_passes_the_start_check_and_nothing_is_left_behind(tmp_path):
    from serving.config import unwritable_dir

    assert unwritable_dir(str(tmp_path / "runs" / "new"), "run_dir") is None
    assert unwritable_dir(str(tmp_path), "run_dir") is None
    assert list(tmp_path.iterdir()) == []  # neither the directory nor the probe is created
    (tmp_path / "f").write_text("")
    assert (unwritable_dir(str(tmp_path / "f"), "run_dir")
            == f"run_dir={tmp_path / 'f'}: {tmp_path / 'f'} is a file, not a directory")


def test_a_leading_tilde_in_a_directory_key_is_the_home_directory(tmp_path, monkeypatch):
    """`run_dir=~/runs` from a command line (where the shell leaves `~` after `=` alone) or from YAML writes under the
    home directory, not into a directory named `~` beside the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("run_dir: ~/runs/ppo\n")
    assert load_config(ActorConfig, path).run_dir == str(tmp_path / "runs" / "ppo")
    assert load_config(CriticConfig, None, ["checkpoint_dir=~/ckpt"]).checkpoint_dir == str(tmp_path / "ckpt")
    assert load_config(ActorConfig).run_dir == "runs/ppo"  # a relative path stays relative to the working directory


def test_a_grpo_section_takes_ppo_overrides_and_a_ppo_section_grpo_ones(tmp_path):
    """NeMo-RL's GRPO files call the section `grpo`; the README's overrides say `ppo.*`. Either spelling of an
    override lands in the file's section, and wins over it, whichever the file uses."""
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("grpo:\n  max_num_steps: 30\n  num_generations_per_prompt: 4\n")
    cfg = load_config(ActorConfig, grpo, ["ppo.max_num_steps=1"])
    assert (cfg.ppo.max_num_steps, cfg.ppo.num_generations_per_prompt) == (1, 4)
    ppo = tmp_path / "ppo.yaml"
    ppo.write_text("ppo:\n  max_num_steps: 30\n")
    assert load_config(ActorConfig, ppo, ["grpo.max_num_steps=2"]).ppo.max_num_steps == 2
    both = tmp_path / "both.yaml"
    both.write_text("ppo:\n  max_num_steps: 30\ngrpo:\n  max_num_steps: 3\n")
    with pytest.raises(ConfigError, match="ppo and grpo name the same section"):
        load_config(ActorConfig, both)


def test_a_key_given_twice_in_a_config_file_is_refused_with_its_line(tmp_path):
    """YAML would keep the second silently; the user meant one of them."""
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  max_num_steps: 3\n  max_num_steps: 4\n")
    with pytest.raises(ConfigError, match="key 'max_num_steps' is given twice in this mapping") as err:
        load_config(ActorConfig, path)
    assert "line 3" in str(err.value) and str(path) in str(err.value)
    import yaml

    from serving.config import _UniqueKeyLoader

    # a merge key's mapping may be overridden by the mapping's own keys, as YAML intends
    merged = yaml.load("a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n", Loader=_UniqueKeyLoader)
    assert merged == {"a": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}


def test_flags_and_overrides_mix_in_any_order_and_a_key_given_twice_is_refused(tmp_path, capsys):
    """`--config f run_dir=X --http-port 0 ppo.max_num_steps=3` was 'unrecognized arguments: ppo.max_num_steps=3'
    (argparse took the overrides only before the first flag after them); a flag and its key both given let the flag
    win silently."""
    from actor.__main__ import FLAGS
    from serving.config import parse_cli

    cfg = parse_cli(ActorConfig, ["--config", str(ROOT / "configs" / "ppo.yaml"), f"run_dir={tmp_path / 'a'}",
                                  "--http-port", "0", "ppo.max_num_steps=3"], "test", FLAGS, writes=("run_dir",))
    assert (cfg.run_dir, cfg.http_port, cfg.ppo.max_num_steps) == (str(tmp_path / "a"), 0, 3)
    with pytest.raises(SystemExit) as e:
        parse_cli(ActorConfig, ["--run-dir", str(tmp_path / "a"), f"run_dir={tmp_path / 'b'}"], "test", FLAGS)
    assert e.value.code == 2
    assert "--run-dir and run_dir=... both set config key run_dir: give it once" in capsys.readouterr().err


def test_what_a_reward_server_serves_includes_its_normalisation():
    """The actor compares a restarted reward server's description with the run's: the normalisation is part of it
    (a server restarted with normalize_reward flipped changed the rewards' scale unnoticed), and without one the
    words are those older checkpoints recorded, so their resumes still match."""
    from actor.servers import _serves

    plain = reward_pb2.RewardInfo(model="m", vocab_sha256="abcdef0123456789", components=["c"])
    assert _serves(plain) == "'m' (vocabulary abcdef012345, components ['c'], labels not needed)"
    normalised = reward_pb2.RewardInfo(model="m", vocab_sha256="abcdef0123456789", components=["c"],
                                       reward_normalization="(score - 0.25) / 2")
    assert _serves(normalised) != _serves(plain) and "scores normalised (score - 0.25) / 2" in _serves(normalised)


# --- what an outside probe of the config found (notes s44): values pydantic accepted and the runtime could not use

def _refusal(model, overrides: list[str], path=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(model, path, overrides)
    return str(err.value)


@pytest.mark.parametrize("model, override, words", [
    # reached torch or gRPC as a C int or long and failed with a traceback (F1)
    (ActorConfig, "num_threads=10000000000000000000000000000", "num_threads: Input should be less than or equal to 4096"),
    (ActorConfig, "num_threads_shared=100000", "num_threads_shared: Input should be less than or equal to 4096"),
    (ActorConfig, "ppo.async_grpo.num_threads=100000", "ppo.async_grpo.num_threads: Input should be less than or"),
    (CriticConfig, "num_threads=100000", "num_threads: Input should be less than or equal to 4096"),
    (RewardConfig, "max_message_mb=10000000000000000000000000000", "max_message_mb: Input should be less than or "),
    (ActorConfig, "reward.max_message_mb=2048", "reward.max_message_mb: Input should be less than or equal to 2047"),
    (ActorConfig, "critic.keepalive_s=1e30", "critic.keepalive_s: Input should be less than or equal to 2147483"),
    (ActorConfig, "reward.keepalive_timeout_s=1e30", "reward.keepalive_timeout_s: Input should be less than or equal"),
    (RewardConfig, "min_ping_interval_s=1e30", "min_ping_interval_s: Input should be less than or equal to 2147483"),
    (CriticConfig, "http_read_timeout_s=1e300", "http_read_timeout_s: Input should be less than or equal to 2147483"),
    (ActorConfig, "policy.lora.rank=10000000000000000000000000000", "policy.lora.rank: Input should be less than or "),
    (CriticConfig, "seed=10000000000000000000000000000", "seed: Input should be less than 4294967296"),
    (RewardConfig, "seed=-1", "seed: Input should be greater than or equal to 0"),
    (ActorConfig, "ppo.seed=4294967296", "ppo.seed: Input should be less than 4294967296"),
    # a deadline past what the clocks take expired at once, or overflowed mid-run (F2)
    (ActorConfig, "reward.timeout_s=1e300", "reward.timeout_s: Input should be less than or equal to 2592000"),
    (ActorConfig, "critic.connect_timeout_s=1e300", "critic.connect_timeout_s: Input should be less than or equal"),
    (ActorConfig, "critic.outage_timeout_s=1e300", "critic.outage_timeout_s: Input should be less than or equal"),
    (ActorConfig, "ppo.async_grpo.generation_timeout_s=1e300", "generation_timeout_s: Input should be less than or "),
    (ActorConfig, "env.step_timeout_s=1e300", "env.step_timeout_s: Input should be less than or equal to 2592000"),
    (RewardConfig, "math_verify.batch_timeout_s=1e300", "math_verify.batch_timeout_s: Input should be less than or"),
    (CriticConfig, "grace_period_s=1e300", "grace_period_s: Input should be less than or equal to 2592000"),
    (RewardConfig, "batching.max_queue_delay_ms=1e300", "max_queue_delay_ms: Input should be less than or equal to "),
])
def test_numbers_past_what_the_runtime_takes_are_refused_naming_the_key_and_the_bound(model, override, words):
    """10**30 threads, a 1e300 s deadline, a seed past 2**64 passed validation and then failed in torch or gRPC with
    a traceback, or (a deadline) expired at once; now the config names the key and its bound."""
    message = _refusal(model, [override])
    assert words in message, message
    assert re.search(r"(less than|greater than)( or equal to)? -?\d+", message), message


def test_every_setting_that_reaches_c_or_the_clock_has_an_upper_bound():
    """Thread counts, message sizes, seeds, ranks and every duration: a key added later without a bound would pass
    10**30 again."""
    from pydantic import BaseModel

    def leaves(model, prefix=""):
        for name, field in model.model_fields.items():
            ann = field.annotation
            sub = next((a for a in (ann, *get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
            if sub is not None:
                yield from leaves(sub, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field

    bounded = re.compile(r"(^|\.)(\w*num_threads\w*|max_message_mb|seed|rank|\w+_s|\w+_ms)$")
    checked = []
    for model in (ActorConfig, CriticConfig, RewardConfig):
        for key, field in leaves(model):
            if bounded.search(key):
                checked.append(key)
                assert any(getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None
                           for m in field.metadata), f"{model.__name__}: {key} has no upper bound"
    assert {"reward.timeout_s", "env.step_timeout_s", "batching.max_queue_delay_ms", "seed"} <= set(checked)
    # the bounds themselves are usable values
    cfg = load_config(ActorConfig, None, ["reward.timeout_s=2592000", "critic.keepalive_s=2147483",
                                          "reward.max_message_mb=2047", "ppo.seed=4294967295"])
    assert (cfg.reward.timeout_s, cfg.critic.keepalive_s, cfg.ppo.seed) == (2592000, 2147483, 2**32 - 1)


def test_an_empty_directory_is_refused_naming_the_key_and_nothing_lands_in_the_working_directory(tmp_path,
                                                                                               monkeypatch, capsys):
    """`--checkpoint-dir ''` and `run_dir=` skipped the writability check and wrote checkpoints, .lock and run_id
    into the directory the service was started from (F3)."""
    from actor.__main__ import FLAGS as ACTOR_FLAGS
    from critic_server.__main__ import FLAGS as CRITIC_FLAGS
    from serving.config import parse_cli

    monkeypatch.chdir(tmp_path)
    for model, argv, flags, key in ((CriticConfig, ["--checkpoint-dir", ""], CRITIC_FLAGS, "checkpoint_dir"),
                                    (ActorConfig, ["run_dir="], ACTOR_FLAGS, "run_dir"),
                                    (ActorConfig, ["--run-dir", " "], ACTOR_FLAGS, "run_dir")):
        with pytest.raises(SystemExit) as e:
            parse_cli(model, argv, "test", flags, writes=(key,))
        assert e.value.code == 2
        assert f"{key}: must not be empty; expected a directory (. for the working directory)" in \
            capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    for key in ("data.train_file", "data.prompt_file", "auth_token_file", "reward.tls_ca_file", "checkpointing.resume"):
        assert f"{key}: must not be empty" in _refusal(ActorConfig, [f"{key}="])
    for key in ("auth_token_file", "tls_cert_file", "tls_client_ca_file"):  # an empty one read as unset: no token, no TLS
        assert f"{key}: must not be empty; expected the path of a file" in _refusal(RewardConfig, [f"{key}="])


@pytest.mark.parametrize("override, words", [
    ("http_port=010", "http_port: YAML 1.1 reads 010 as the octal number 8; write 10 without the leading zero"),
    ("ppo.seed=0123", "ppo.seed: YAML 1.1 reads 0123 as the octal number 83; write 123"),
    ("ppo.max_num_steps=1:30", "ppo.max_num_steps: YAML 1.1 reads 1:30 as the base-60 number 90"),
    ("policy.optimizer.kwargs.lr=1:30.5", "policy.optimizer.kwargs.lr: YAML 1.1 reads 1:30.5 as the base-60 number"),
    ("policy.generation.stop_token_ids=[5, 010]", "policy.generation.stop_token_ids: YAML 1.1 reads 010 as the octal"),
])
def test_yaml_1_1_numbers_that_read_otherwise_than_written_are_refused_naming_the_key(override, words, tmp_path):
    """`--port 077777` listened on 32767, `ppo.seed=0123` seeded 83, `1:30` steps ran 90 (F4): in a file, an override
    and a flag alike the key is named, with how to write it."""
    assert words in _refusal(ActorConfig, [override])
    key, _, value = override.partition("=")
    *sections, leaf = key.split(".")
    text = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections)) + f"{'  ' * len(sections)}{leaf}: {value}\n"
    (tmp_path / "c.yaml").write_text(text)
    assert words in _refusal(ActorConfig, [], tmp_path / "c.yaml")


def test_a_yaml_1_1_number_on_a_flag_is_refused_and_plain_or_explicit_forms_pass(capsys):
    from reward_server.__main__ import FLAGS
    from serving.config import parse_cli

    with pytest.raises(SystemExit) as e:
        parse_cli(RewardConfig, ["--port", "077777"], "test", FLAGS)
    assert e.value.code == 2
    assert "port: YAML 1.1 reads 077777 as the octal number 32767; write 77777" in capsys.readouterr().err
    # a leading zero that changes nothing, hex, digit groups: what they say
    cfg = load_config(ActorConfig, None, ["ppo.seed=07", "ppo.max_num_steps=0x1F", "ppo.val_period=1_000"])
    assert (cfg.ppo.seed, cfg.ppo.max_num_steps, cfg.ppo.val_period) == (7, 31, 1000)
    # a key that holds text takes it as written
    cfg = load_config(ActorConfig, None, ["critic.address=10:20", "checkpointing.checkpoint_must_save_by=1:30:00"])
    assert (cfg.critic.address, cfg.checkpointing.must_save_by_s) == ("10:20", 5400)


@pytest.mark.parametrize("address, words", [
    ("abc", "no :port"),
    ("127.0.0.1:99999", "the port '99999' is no number from 1 to 65535"),
    ("127.0.0.1:0", "the port '0' is no number from 1 to 65535"),
    ("http://127.0.0.1:5556", "a gRPC address takes no URL scheme"),
    (":5556", "no host before the :port"),
    ("::1:5556", "an IPv6 address goes in brackets, as in [::1]:5555"),
    ("'[fe80::zz]:5556'", "'fe80::zz' in brackets is no IPv6 address"),
    ("ipv4:10.0.0.1:5555,host:5555", "'host' is no ipv4 address"),
    ("unix:", "no socket path after unix:"),
])
def test_a_malformed_server_address_is_refused_when_the_config_is_read(address, words):
    """A bad reward.address cost connect_timeout_s (120 s) after the models loaded, then a misleading reason: `abc`
    and `http://...` 'do not resolve', port 99999 'nothing listens' (F5)."""
    for key in ("reward.address", "critic.address"):
        message = _refusal(ActorConfig, [f"{key}={address}"])
        assert f"{key}: " in message and "is no gRPC address" in message and words in message, message
        assert "expected host:port" in message


def test_every_address_form_grpc_dials_passes_and_reward_urls_are_checked():
    for address in ("gpu-1:5555", "'[::1]:5555'", "dns:///rm:5556", "dns://8.8.8.8/rm:5556", "unix:/run/critic.sock",
                    "unix-abstract:critic", "ipv4:127.0.0.1:5555,192.0.2.2:5555", "'ipv6:[::1]:5555,[::2]:5555'"):
        assert load_config(ActorConfig, None, [f"reward.address={address}"]).reward.address == address.strip("'")
    for url, words in (("notaurl", "its scheme is not http:// or https://"), ("ftp://h/x", "its scheme is not"),
                       ("http:///get_reward", "it names no host"), ("http://h:99999/x", "its port is no number")):
        message = _refusal(ActorConfig, ["reward.source=openrlhf", f"reward.url={url}"])
        assert f"reward.url: {url!r} is no URL the reward client can POST to: {words}" in message, message
    assert load_config(ActorConfig, None, ["reward.url=https://rm:8002/get_reward"]).reward.url


def test_a_server_with_one_port_for_both_or_an_empty_host_is_refused():
    """`--port 5 --http-port 5` failed to bind with 'is the port taken?'; an empty host passed and was treated as a
    public one (F6)."""
    assert "port and http_port are both 32105: the gRPC and the REST server need a port each" in \
        _refusal(RewardConfig, ["port=32105", "http_port=32105"])
    assert load_config(CriticConfig, None, ["port=0", "http_port=0"]).port == 0  # two ephemeral ports
    assert "host: must not be empty; expected a host name or address" in _refusal(CriticConfig, ["host="])
    assert "host: must not be empty" in _refusal(ActorConfig, ["host="])


def test_bind_failures_say_whether_the_host_or_the_port_is_at_fault():
    from serving.rest import bind_failure

    assert "host 'no-such-host.invalid' does not resolve" in bind_failure("no-such-host.invalid", 5555, "gRPC", "port")
    assert "192.0.2.1 is no address of this machine" in bind_failure("192.0.2.1", 5555, "gRPC", "port")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert bind_failure("127.0.0.1", port, "HTTP", "http_port") == \
            (f"cannot listen on 127.0.0.1:{port} (HTTP): the port is taken (another process listens on it); set "
             "http_port to a free port")


def test_a_config_nested_too_deeply_is_refused_naming_the_file(tmp_path):
    """5000 nested lists were a RecursionError traceback (F7)."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert f"config file {deep}: nested too deeply to read" in _refusal(RewardConfig, [], deep)
    assert "override components=...: the value is nested too deeply" in \
        _refusal(RewardConfig, ["components=" + "[" * 5000 + "]" * 5000])


def test_a_config_from_a_pipe_or_dev_null_is_read_and_an_empty_path_is_named(tmp_path):
    """`--config <(envsubst < c.yaml)` and /dev/null were 'does not exist'; `--config ''` was '. is a directory'
    (F8)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("seed: 7\n"), daemon=True)  # blocks until read
    writer.start()
    assert load_config(RewardConfig, fifo).seed == 7
    writer.join()
    assert load_config(RewardConfig, "/dev/null") == RewardConfig()
    assert _refusal(RewardConfig, [], "") == ("config file: the path is empty; name a YAML file, or leave --config "
                                              "out for the defaults")
    assert "is a directory" in _refusal(RewardConfig, [], tmp_path)


@pytest.mark.parametrize("model, key", [(ActorConfig, "policy.model_name"), (ActorConfig, "policy.reference_model_name"),
                                        (CriticConfig, "model"), (CriticConfig, "reward_model"),
                                        (RewardConfig, "model"), (RewardConfig, "tokenizer")])
def test_an_empty_model_name_is_refused_naming_the_key(model, key):
    """`policy.model_name=` failed in transformers about sentencepiece; `--model ''` with 'Unrecognized model' (F9)."""
    assert (f"{key}: must not be empty; expected a model directory, a hub id or embedded:<name>"
            in _refusal(model, [f"{key}="]))


def test_a_key_given_twice_on_the_command_line(capsys, caplog):
    """Two spellings of one key (`grpo.seed` and `ppo.seed`), a flag twice and --config twice are refused naming it;
    one key repeated is applied in order with a warning (commands built from a base list and one run's settings
    repeat keys) (F10)."""
    from actor.__main__ import FLAGS
    from serving.config import parse_cli

    assert _refusal(ActorConfig, ["grpo.seed=1", "ppo.seed=2"]) == \
        "ppo.seed is given twice on the command line, as 'grpo.seed=1' and 'ppo.seed=2': give it once"
    with caplog.at_level("WARNING", logger="serving.config"):
        assert load_config(ActorConfig, None, ["ppo.seed=1", "ppo.seed=2"]).ppo.seed == 2
    assert caplog.messages == [("ppo.seed is given twice on the command line (ppo.seed=1, then ppo.seed=2): the last "
                                "one applies")]
    for argv, flag in ((["--run-dir", "a", "--run-dir", "b"], "--run-dir"),
                       (["--config", "configs/ppo.yaml", "--config", "configs/grpo.yaml"], "--config")):
        with pytest.raises(SystemExit) as e:
            parse_cli(ActorConfig, argv, "test", FLAGS)
        assert e.value.code == 2 and f"error: {flag} is given twice: give it once" in capsys.readouterr().err


def test_the_demo_leaves_its_own_actor_settings_to_the_user_s_overrides():
    """`python -m actor.demo checkpointing.resume=auto` (README) and the bench's `num_threads=2` set keys the demo
    sets too: its own are left out, so the actor sees each key once and the user's value."""
    from actor.demo import unless_given

    own = ["http_port=0", "num_threads=1", "checkpointing.resume=never", "ppo.seed=1"]
    assert unless_given(own, ["checkpointing.resume=auto", "num_threads=2", "grpo.seed=3"]) == ["http_port=0"]
    assert unless_given(own, []) == own


def test_messages_name_what_was_written(tmp_path, monkeypatch):
    """A null section, an environment option without an environment, a text key YAML read as something else and a
    typo in a file's grpo section were reported misleadingly (F11)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("policy:\n  # model_name: x\n")  # every key commented out: the section's defaults
    assert load_config(ActorConfig, path, ["policy.model_name=embedded:policy"]).policy == ActorConfig().policy
    assert load_config(ActorConfig, path).policy == ActorConfig().policy
    assert load_config(ActorConfig, None, ["policy.lora.rank=4"]).policy.lora.rank == 4
    assert "env.bogus set without env.name: name the environment" in _refusal(ActorConfig, ["env.bogus=1"])
    cfg = load_config(ActorConfig, None, ["host=::", "run_dir=~", "critic.address=10:20", "data.prompt_key=yes"])
    assert (cfg.host, cfg.run_dir, cfg.critic.address, cfg.data.prompt_key) == ("::", str(tmp_path), "10:20", "yes")
    path.write_text("data:\n  prompt_key: yes\n")
    assert "data.prompt_key: expected text, got True: YAML read the value as bool; quote it to keep it as written" in \
        _refusal(ActorConfig, [], path)
    path.write_text("grpo:\n  max_num_step: 3\n")
    message = _refusal(ActorConfig, [], path)
    assert "grpo.max_num_step: unknown key" in message and "ppo.max_num_step" not in message


def test_a_critic_keeping_autosaves_it_never_makes_is_refused():
    """autosave_keep=3 with autosave_every=0 started with no word about it (F13)."""
    assert "autosave_keep=3 keeps autosaves, but autosave_every=0 makes none" in _refusal(CriticConfig,
                                                                                         ["autosave_keep=3"])
    assert load_config(CriticConfig, None, ["autosave_keep=3", "autosave_every=1"]).autosave_keep == 3
    assert "policy.generation.stop_token_ids.0: Input should be greater than or equal to 0" in \
        _refusal(ActorConfig, ["policy.generation.stop_token_ids=[-1]"])
