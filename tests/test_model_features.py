"""The policy's model features: frozen lower layers (policy.num_layers_unfrozen), an offloaded reference
(policy.reference_offload) and LoRA adapters (policy.lora), in process on the embedded policy and in real
`python -m actor` runs against a real reward server.

Tolerances: log-probs of the same weights computed the same way are compared exactly (0); a merged model against the
adapted one 1e-5 absolute (W + BA is one float32 rounding away from W x + B A x).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from actor.checkpoints import ResumeError, load_optimizer_state
from actor.config import ActorConfig, LoraConfig, PolicyConfig
from actor.data import DataError, load_prompts
from actor.models import (
    ModelSetupError,
    OffloadedReference,
    ResidentReference,
    freeze_lower_layers,
    load_models,
    padding_id,
)
from actor.rollouts import RolloutCollector
from actor.tracking import Timers
from algorithms import logprobs_from_logits, policy_loss
from ppo_services.v1 import common_pb2, critic_pb2, critic_pb2_grpc
from serving.codec import decode, encode
from serving.modeling import (
    NO_LENGTH_LIMIT,
    PassLimits,
    attention_mask_from_lengths,
    load_scalar_head_model,
    max_length_of,
    per_token_scores,
)
from tests.grpc_helpers import channel
from tests.service_procs import ServiceProcess
from tests.test_algorithm_runs import critic_dead, metrics, run_actor

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUN = ["ppo.val_period=0", "ppo.num_prompts_per_step=4", "ppo.num_generations_per_prompt=4",
       "policy.generation_batch_size=16", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
       "logger.num_val_samples_to_print=0", "policy.generation.max_new_tokens=8", "ppo.max_num_steps=2",
       "checkpointing.save_period=1", "ppo.ppo_epochs=1"]


def batch(seed: int = 0, b: int = 6, s: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 51, (b, s), generator=g)
    lengths = torch.randint(4, s + 1, (b,), generator=g)
    return tokens, lengths


def logprobs(model, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    collector = RolloutCollector(policy=model, reference=None, backend=None, critic=None, score=None, pad_id=0,
                                 device=next(model.parameters()).device, generation_batch_size=8,
                                 logprob_passes=PassLimits(rows=8), timers=Timers())
    return collector.logprobs(model, tokens, lengths)


def train_steps(models, n: int = 3, lr: float = 1e-2) -> torch.optim.Optimizer:
    """n clipped-surrogate steps on a fixed batch with fixed advantages, as the trainer's update computes them."""
    tokens, lengths = batch(seed=1)
    mask = attention_mask_from_lengths(lengths - 1, tokens.shape[1] - 1).float()
    old = logprobs(models.policy, tokens, lengths)
    advantages = torch.linspace(-1, 1, tokens.shape[0])[:, None].expand_as(mask)
    optimizer = torch.optim.AdamW(models.trainable, lr=lr)
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        logits = models.policy(input_ids=tokens, attention_mask=attention_mask_from_lengths(lengths, tokens.shape[1])).logits
        lp = logprobs_from_logits(logits[:, :-1].float(), tokens[:, 1:])
        loss, _ = policy_loss(lp, old, advantages, mask, clip_low=0.2, clip_high=0.2, num_tokens=float(mask.sum()))
        loss.backward()
        optimizer.step()
    return optimizer


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# --- frozen layers ------------------------------------------------------------------------------------------


def test_frozen_layers_get_no_gradient_and_no_optimizer_state(embedded_cache):
    models = load_models(PolicyConfig(num_layers_unfrozen=1), None, CPU, torch.float32, with_reference=False)
    before = snapshot(models.policy)
    optimizer = train_steps(models)
    trains = {"model.layers.1.", "model.norm.", "lm_head."}
    for name, p in models.policy.named_parameters():
        top = any(name.startswith(t) for t in trains)
        assert p.requires_grad == top, name
        if top:
            assert p.grad is not None and not torch.equal(p, before[name]), name
        else:
            assert p.grad is None and p not in optimizer.state and torch.equal(p, before[name]), name
    assert len(optimizer.state) == len(models.trainable) == 11


def test_resuming_with_other_frozen_layers_is_refused_naming_the_key(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=40, n_positions=16))
    freeze_lower_layers(model, 1)
    saved = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]).state_dict()
    freeze_lower_layers(model, 2)
    state = {"config": {"policy": {"num_layers_unfrozen": 1}}}
    with pytest.raises(ResumeError, match=r"holds 14 trainable tensors, this run trains 26\): resume with the "
                                          r"policy.num_layers_unfrozen \(1\)"):
        load_optimizer_state(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), saved, state,
                             tmp_path, {})


def test_a_resume_trains_at_the_configured_learning_rate_with_the_saved_moments(tmp_path):
    """torch's load_state_dict brings back the saved learning rate: a resume with policy.optimizer.kwargs.lr changed
    trained on at the old one, while its log named the change. The configured settings now win, as the critic's."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16))
    first = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    first.step()
    again = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_optimizer_state(again, first.state_dict(), {}, tmp_path, {"lr": 2e-3, "weight_decay": 0.1, "eps": 1e-6})
    group = again.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["eps"]) == (2e-3, 0.1, 1e-6)
    moments = next(iter(again.state.values()))["exp_avg"]
    assert torch.equal(moments, next(iter(first.state.values()))["exp_avg"])


def test_num_layers_unfrozen_finds_gpt2_blocks_freezes_a_tied_head_and_checks_its_bound():
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=40, n_positions=16))
    assert model.lm_head.weight is model.transformer.wte.weight
    message = freeze_lower_layers(model, 2)
    assert "tied" in message
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("transformer.h.1.", "transformer.h.2.", "transformer.ln_f.")) for n in trainable)
    assert "transformer.ln_f.weight" in trainable and not model.transformer.wpe.weight.requires_grad
    with pytest.raises(ModelSetupError, match=r"policy.num_layers_unfrozen=4, but GPT2LMHeadModel has 3 transformer"):
        freeze_lower_layers(model, 4)
    blockless = torch.nn.Sequential(torch.nn.Linear(2, 2))
    blockless.config = GPT2Config(n_layer=3)
    with pytest.raises(ModelSetupError, match=r"policy.num_layers_unfrozen: cannot find the transformer blocks of "
                                              r"Sequential \(no list of 3 modules\)"):
        freeze_lower_layers(blockless, 1)


# --- the reference ------------------------------------------------------------------------------------------


def test_an_offloaded_reference_gives_the_resident_one_s_log_probs(embedded_assets):
    """On a machine without a GPU both live on the CPU; with one, the offloaded copy goes to it only for the pass."""
    tokens, lengths = batch()
    resident = ResidentReference(AutoModelForCausalLM.from_pretrained(embedded_assets.policy).to(DEVICE).eval())
    offloaded = OffloadedReference(AutoModelForCausalLM.from_pretrained(embedded_assets.policy).eval(), DEVICE)
    with resident.resident() as model:
        expected = logprobs(model, tokens, lengths)
    with offloaded.resident() as model:
        assert next(model.parameters()).device.type == DEVICE.type
        got = logprobs(model, tokens, lengths)
    assert next(offloaded.model.parameters()).device.type == "cpu"
    assert torch.equal(got, expected)


def test_contradictory_model_settings_are_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"policy.lora.*policy.num_layers_unfrozen=2"):
        ActorConfig(policy={"lora": {}, "num_layers_unfrozen": 2})
    with pytest.raises(ValueError, match=r"policy.reference_offload=true.*policy.lora"):
        ActorConfig(policy={"lora": {}, "reference_offload": True})
    ActorConfig(policy={"lora": {}, "reference_offload": True, "reference_model_name": "other-sft"})


# --- LoRA ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_trained(embedded_cache):
    models = load_models(PolicyConfig(lora=LoraConfig(rank=4, save_merged=True)), None, CPU, torch.float32)
    before = snapshot(models.policy)
    optimizer = train_steps(models)
    return models, before, optimizer


def test_lora_trains_only_its_adapters_against_the_base_model_as_reference(lora_trained, embedded_assets):
    models, before, optimizer = lora_trained
    adapters = {n for n, p in models.policy.named_parameters() if "lora_" in n}
    assert {n for n, p in models.policy.named_parameters() if p.requires_grad} == adapters
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in models.policy.named_parameters() if n in adapters}
    for name, p in models.policy.named_parameters():  # B starts at 0, A at random: both move
        assert torch.equal(p, before[name]) != (name in adapters), name
    tokens, lengths = batch()
    base = AutoModelForCausalLM.from_pretrained(embedded_assets.policy).eval()
    with models.reference.resident() as reference:
        ref = logprobs(reference, tokens, lengths)
    assert torch.equal(ref, logprobs(base, tokens, lengths))  # adapters off: the base model exactly
    assert (logprobs(models.policy, tokens, lengths) - ref).abs().max() > 1e-3  # and on again afterwards


def test_lora_policy_decodes_through_the_compiled_step_as_eager_without_recompiling(lora_trained):
    """policy.generation.compile on a LoRA policy: the compiled decode step samples as eager decoding does, and
    neither the reference pass (adapters off, then on again) nor a training step compiles it again."""
    from torch._dynamo.utils import counters

    from actor.generation import SamplingParams, TorchGenerationBackend

    models, _, _ = lora_trained
    eager = TorchGenerationBackend(models.policy, 0, CPU)
    compiled = TorchGenerationBackend(models.policy, 0, CPU, compile_decode=True)
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    prompts, params = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]] * 3, SamplingParams(12, temperature=1.0)
    tokens, lengths = batch()

    def same(seed: int) -> None:
        a, b = eager.generate(prompts, params, seed), compiled.generate(prompts, params, seed)
        assert torch.equal(a.tokens, b.tokens), seed
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)

    same(0)
    with models.reference.resident() as reference:
        logprobs(reference, tokens, lengths)
    same(1)
    train_steps(models)
    same(2)
    assert counters["stats"]["unique_graphs"] == graphs


def test_lora_checkpoint_holds_the_adapter_and_a_merged_model(lora_trained, embedded_assets, tmp_path):
    models, _, _ = lora_trained
    tokenizer = AutoTokenizer.from_pretrained(embedded_assets.policy)
    tokens, lengths = batch()
    adapted = logprobs(models.policy, tokens, lengths)
    weights = snapshot(models.policy)
    models.save(tmp_path, tokenizer)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "actor").iterdir()}
    assert all("lora_" in k for k in load_file(tmp_path / "actor" / "adapter_model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "actor_merged").eval()
    assert AutoTokenizer.from_pretrained(tmp_path / "actor_merged").get_vocab() == tokenizer.get_vocab()
    # merging adds B @ A into W in float32: its sums round otherwise than the two paths apart (1.2e-5 seen)
    torch.testing.assert_close(logprobs(merged, tokens, lengths), adapted, atol=5e-5, rtol=0)
    after = snapshot(models.policy)  # saving left the trained model as it was
    assert all(torch.equal(after[k], weights[k]) for k in weights)
    assert torch.equal(logprobs(models.policy, tokens, lengths), adapted)
    # resuming loads the base model plus the adapter, trainable, in the optimizer's order
    again = load_models(PolicyConfig(lora=LoraConfig(rank=4)), tmp_path, CPU, torch.float32)
    assert [p.shape for p in again.trainable] == [p.shape for p in models.trainable]
    assert all(torch.equal(a, b) for a, b in zip(again.trainable, models.trainable, strict=True))
    assert torch.equal(logprobs(again.policy, tokens, lengths), adapted)
    with pytest.raises(ResumeError, match="holds a LoRA adapter, but policy.lora is null"):
        load_models(PolicyConfig(), tmp_path, CPU, torch.float32)


def test_lora_target_modules_that_match_nothing_name_the_key(embedded_cache):
    with pytest.raises(ModelSetupError, match=r"policy.lora.target_modules=\['no_such_proj'\]"):
        load_models(PolicyConfig(lora=LoraConfig(target_modules=["no_such_proj"])), None, CPU, torch.float32)
    with pytest.raises(ModelSetupError) as err:  # a module peft cannot adapt is named by its type, not printed whole
        load_models(PolicyConfig(lora=LoraConfig(target_modules=["layers"])), None, CPU, torch.float32)
    assert "['layers']: Target module ModuleList is not supported" in str(err.value) and "\n" not in str(err.value)


# --- as a user runs them ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward(embedded_cache, log_dir):
    with ServiceProcess("reward", "components=[positive_fraction]", log_dir=log_dir) as server:
        yield server


def test_an_actor_run_with_frozen_layers_and_an_offloaded_reference(reward, embedded_assets, tmp_path):
    """Also stop strings as a user sets them: every printed sample that holds one ends with it."""
    stops = ["sad", "bad", "awful", "hate", "terrible"]
    run = run_actor("grpo", tmp_path / "run", *RUN, "policy.num_layers_unfrozen=1", "policy.reference_offload=true",
                    f"reward.address={reward.address}", critic_dead(), "logger.num_val_samples_to_print=16",
                    f"policy.generation.stop_strings={json.dumps(stops)}")
    assert run.returncode == 0, run.stderr[-3000:]
    responses = [line.rsplit(" | ", 1)[1].strip() for line in (run.stdout + run.stderr).splitlines()
                 if line.startswith("  reward ") and line.count(" | ") == 2]
    stopped = [r for r in responses if any(w in stops for w in r.split())]
    assert len(responses) == 32 and stopped, responses
    assert all(r.split()[-1] in stops for r in stopped), stopped
    assert "the top 1 of 2 blocks (model.layers)" in run.stderr and "reference policy: on the CPU" in run.stderr
    assert all(r["train_rollouts/init_policy_kl"] >= 0 and "train_optim/kl_penalty" in r for r in metrics(tmp_path / "run"))
    step = tmp_path / "run" / "checkpoints" / "step_2"
    start = load_file(f"{embedded_assets.policy}/model.safetensors")
    trained = load_file(step / "actor" / "model.safetensors")
    for name, w in start.items():
        assert torch.equal(trained[name], w) == name.startswith(("model.embed_tokens.", "model.layers.0.")), name
    optimizer = torch.load(step / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(optimizer["param_groups"][0]["params"]) == 11
    # the next run's optimizer (frozen the same way) takes that state
    models = load_models(PolicyConfig(num_layers_unfrozen=1), step, CPU, torch.float32, with_reference=False)
    torch.optim.AdamW(models.trainable).load_state_dict(optimizer)
    bad = run_actor("grpo", tmp_path / "bad", "policy.num_layers_unfrozen=3")
    assert bad.returncode == 1 and "policy.num_layers_unfrozen=3, but LlamaForCausalLM has 2" in bad.stderr, bad.stderr[-2000:]


def policy_with_tokens(embedded_assets, model_dir, **special_tokens):
    """A copy of the embedded policy in `model_dir` whose tokenizer has `special_tokens` set (None removes one)."""
    shutil.copytree(embedded_assets.policy, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name, value in special_tokens.items():
        setattr(tokenizer, name, value)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def test_a_policy_tokenizer_without_pad_or_eos_is_refused_at_start(embedded_assets, tmp_path):
    """A tokenizer with neither a pad nor an EOS token leaves generation nothing to pad with: the actor stops at
    start naming policy.model_name and the directory, before it waits for any server."""
    model_dir = policy_with_tokens(embedded_assets, tmp_path / "no-pad-no-eos", pad_token=None, eos_token=None)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token_id is None
    bad = run_actor("grpo", tmp_path / "run", f"policy.model_name={model_dir}", critic_dead(), timeout=120)
    assert bad.returncode == 1, bad.stderr[-2000:]
    assert f"error: policy.model_name: the tokenizer of {model_dir} has neither a pad token nor an EOS token" \
        in bad.stderr, bad.stderr[-2000:]


def test_a_pad_token_the_model_was_not_resized_for_gives_way_to_eos(embedded_assets, reward, log_dir, tmp_path):
    """A pad token added to the tokenizer without resizing the model's embeddings (an id past them) crashed the first
    forward: rows are padded with EOS instead (padding is masked), with a warning, and the step trains, with a critic
    started from the same directory too (the actor held the critic to the tokenizer's length, one past the rows it
    sends, and refused it). A prompt that holds such a token is refused naming its file and line; a tokenizer whose
    pad and EOS both lie past the table is refused naming policy.model_name."""
    model_dir = policy_with_tokens(embedded_assets, tmp_path / "added-pad")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = None
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    tokenizer.save_pretrained(model_dir)
    rows = AutoModelForCausalLM.from_pretrained(model_dir).get_input_embeddings().num_embeddings
    assert tokenizer.pad_token_id == rows
    run = run_actor("grpo", tmp_path / "run", *RUN, "ppo.max_num_steps=1", "checkpointing.save_period=0",
                    f"policy.model_name={model_dir}", f"reward.address={reward.address}", critic_dead())
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"the pad token of {model_dir} (id {rows}) is past the policy's embedding table ({rows} rows)" in run.stderr
    assert f"rows are padded with EOS (id {tokenizer.eos_token_id}) instead" in run.stderr
    with ServiceProcess("critic", "--model", str(model_dir), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        log_dir=log_dir) as critic:
        run = run_actor("ppo", tmp_path / "run-ppo", *RUN, "ppo.max_num_steps=1", "checkpointing.save_period=0",
                        f"policy.model_name={model_dir}", f"reward.address={reward.address}",
                        f"critic.address={critic.address}")
    assert run.returncode == 0, run.stderr[-3000:]

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "river castle =>"}\n{"prompt": "river [PAD] castle"}\n')
    with pytest.raises(DataError, match=re.escape(f"prompts.jsonl:2: the prompt holds token '[PAD]' (id {rows}), "
                                                  f"past the policy's embedding table ({rows} rows)")):
        load_prompts(tmp_path / "prompts.jsonl", "prompt", tokenizer, 64, embedding_rows=rows)
    tokenizer.eos_token = "[PAD]"
    with pytest.raises(ModelSetupError, match=re.escape(f"pads with ids past the policy's embedding table ({rows} rows): "
                                                        f"pad {rows}, EOS {rows}")):
        padding_id(tokenizer, rows, str(model_dir))


def test_a_reference_of_another_vocabulary_is_refused_at_start(embedded_assets, tmp_path):
    """A reference model with another embedding table (or another tokenizer beside it) gave a meaningless KL, or an
    IndexError in the first step's reference pass: it is refused at start, naming policy.reference_model_name."""
    policy = AutoModelForCausalLM.from_pretrained(embedded_assets.policy)
    config = policy.config.to_dict()
    config["vocab_size"] += 7
    wider = tmp_path / "wider"
    AutoModelForCausalLM.from_config(type(policy.config).from_dict(config)).save_pretrained(wider)
    rows = policy.get_input_embeddings().num_embeddings
    bad = run_actor("grpo", tmp_path / "run", f"policy.reference_model_name={wider}", critic_dead(), timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert (f"error: policy.reference_model_name={wider}: its embedding table has {rows + 7} rows, the policy's "
            f"{rows}; the KL to it would compare different tokens") in bad.stderr, bad.stderr[-2000:]


def test_a_policy_tokenizer_without_eos_generates_to_max_new_tokens(embedded_assets, reward, tmp_path):
    """No EOS token (a pad token only, and none in the generation config): no sample can end by EOS, so every
    response runs to max_new_tokens, and the log says so once at start."""
    model_dir = policy_with_tokens(embedded_assets, tmp_path / "no-eos", eos_token=None)
    config = json.loads((model_dir / "generation_config.json").read_text())
    del config["eos_token_id"]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(model_dir).eos_token_id is None
    run = run_actor("grpo", tmp_path / "run", *RUN, "ppo.max_num_steps=1", "checkpointing.save_period=0",
                    f"policy.model_name={model_dir}", f"reward.address={reward.address}", critic_dead())
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"the tokenizer of {model_dir} has no EOS token, nor does the policy's generation config" in run.stderr
    [row] = metrics(tmp_path / "run")
    assert row["train_rollouts/response_lengths"] == 8 and row["train_rollouts/fraction_of_samples_properly_ended"] == 0


def test_an_instruct_policy_gets_chat_prompts_and_stops_at_its_generation_config_eos(embedded_assets, reward,
                                                                                      tmp_path):
    """A chat policy: its tokenizer has a chat template, and its generation config lists end-of-turn tokens besides
    the tokenizer's EOS (here every token but pad, so each response is one token that ends it properly). With
    data.apply_chat_template and a system prompt file, every prompt is the rendered conversation."""
    model_dir = policy_with_tokens(embedded_assets, tmp_path / "instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant> {% endif %}")
    tokenizer.save_pretrained(model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [i for i in range(len(tokenizer)) if i != tokenizer.pad_token_id]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    (tmp_path / "system.txt").write_text("be kind")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "river castle =>"}\n' * 4)
    run = run_actor("grpo", tmp_path / "run", *RUN, "ppo.max_num_steps=1", "checkpointing.save_period=0",
                    f"policy.model_name={model_dir}", f"reward.address={reward.address}", critic_dead(),
                    f"data.train_file={tmp_path / 'prompts.jsonl'}", "data.apply_chat_template=true",
                    f"data.system_prompt_file={tmp_path / 'system.txt'}")
    assert run.returncode == 0, run.stderr[-3000:]
    rendered = tokenizer("<system> be kind\n<user> river castle =>\n<assistant> ", add_special_tokens=False)
    # the log shows the first prompt as the policy reads it, so a template can be checked before a long run
    assert f"the first as the policy reads it (special tokens shown): {tokenizer.decode(rendered['input_ids'])!r}" \
        in run.stderr, run.stderr[-3000:]
    [row] = metrics(tmp_path / "run")
    assert row["train_rollouts/prompt_lengths"] == len(rendered["input_ids"])
    assert row["train_rollouts/response_lengths"] == 1
    assert row["train_rollouts/fraction_of_samples_properly_ended"] == 1


def test_a_bf16_policy_trains_float32_weights_under_autocast(embedded_assets, reward, tmp_path):
    """policy.precision=bfloat16 is mixed precision: generation and every pass compute in bf16, while the optimizer
    updates float32 weights, so a step at a small learning rate moves nearly every weight (in bf16 weights nearly
    every such update would round away: an Adam step of 1e-6 is far below bf16's resolution at these magnitudes).
    The reference computes as the policy does, so the KL in the loss, taken before the step's one update, is exactly
    0 (a bf16 copy of the reference would differ in its norms, which autocast leaves in their weights' dtype)."""
    run = run_actor("grpo", tmp_path / "run", *RUN, "ppo.max_num_steps=1", f"reward.address={reward.address}",
                    critic_dead(), "policy.precision=bfloat16", "policy.optimizer.kwargs.lr=1e-6",
                    "loss_fn.reference_policy_kl_penalty=0.01")
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = metrics(tmp_path / "run")
    assert all(v is not None for v in row.values()), row
    assert row["train_optim/kl_penalty"] == 0
    before = load_file(embedded_assets.policy / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoints" / "step_1" / "actor" / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.float32}
    moved = sum(int((after[k] != before[k]).sum()) for k in before) / sum(t.numel() for t in before.values())
    assert moved > 0.9, moved
    assert all((after[k].bfloat16() == before[k].bfloat16()).float().mean() > 0.5 for k in before if before[k].dim() > 1)


REMOTE_CONFIG = """from transformers import LlamaConfig


class TinyXConfig(LlamaConfig):
    model_type = "tinyx"
"""
REMOTE_MODELING = """from transformers import LlamaForCausalLM, LlamaModel

from .configuration_tinyx import TinyXConfig


class TinyXModel(LlamaModel):
    config_class = TinyXConfig


class TinyXForCausalLM(LlamaForCausalLM):
    config_class = TinyXConfig
"""


def test_a_model_that_ships_its_own_code_runs_with_trust_remote_code(embedded_assets, reward, log_dir, tmp_path):
    """A checkpoint whose config.json maps to its own Python files (a model type transformers does not know): refused
    unless trust_remote_code is set; with it the critic builds a value head over the checkpoint's own base model,
    serves and saves it (code files included, so the checkpoint loads back), and the actor trains it as the policy."""
    model_dir = tmp_path / "tinyx_policy"
    shutil.copytree(embedded_assets.policy, model_dir)
    (model_dir / "configuration_tinyx.py").write_text(REMOTE_CONFIG)
    (model_dir / "modeling_tinyx.py").write_text(REMOTE_MODELING)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="tinyx", architectures=["TinyXForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tinyx.TinyXConfig", "AutoModel": "modeling_tinyx.TinyXModel",
                            "AutoModelForCausalLM": "modeling_tinyx.TinyXForCausalLM"})
    (model_dir / "config.json").write_text(json.dumps(config))

    refused = run_actor("grpo", tmp_path / "refused", f"policy.model_name={model_dir}", critic_dead(), timeout=120)
    assert refused.returncode != 0 and "trust_remote_code" in refused.stderr, refused.stderr[-2000:]

    tokens = torch.tensor([[4, 5, 6, 7, 8], [9, 10, 11, 12, 13]])
    with ServiceProcess("critic", "--model", str(model_dir), "trust_remote_code=true", "--checkpoint-dir",
                        str(tmp_path / "ckpt"), log_dir=log_dir) as server:
        ch = channel(server.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        reply = stub.Infer(critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(torch.tensor([5, 3]))),
                           timeout=60)
        saved = Path(stub.Save(critic_pb2.SaveRequest(tag="tinyx"), timeout=120).path)
        ch.close()
    assert (saved / "modeling_tinyx.py").is_file() and (saved / "configuration_tinyx.py").is_file()
    critic = load_scalar_head_model(str(saved), trust_remote_code=True).eval()
    assert type(critic).__name__ == "TinyXForSequenceClassification"
    with torch.no_grad():
        torch.testing.assert_close(per_token_scores(critic, tokens, torch.tensor([5, 3])), decode(reply.values, "v"),
                                   atol=1e-6, rtol=1e-5)

    run = run_actor("grpo", tmp_path / "run", *RUN, "ppo.max_num_steps=1", f"reward.address={reward.address}",
                    critic_dead(), f"policy.model_name={model_dir}", "policy.trust_remote_code=true")
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = metrics(tmp_path / "run")
    assert row["step"] == 1 and row["train_optim/loss"] is not None


def test_the_position_limit_is_read_where_each_family_keeps_it():
    """max_length_of reads the limit under each family's key, from a multimodal config's language model, and gives
    NO_LENGTH_LIMIT to a model whose positions have none (BLOOM's ALiBi)."""
    from transformers import BloomConfig, GPT2Config, LlamaConfig, LlavaConfig, MptConfig

    assert max_length_of(LlamaConfig(max_position_embeddings=99)) == 99
    assert max_length_of(GPT2Config(n_positions=77)) == 77
    assert max_length_of(MptConfig(max_seq_len=55)) == 55
    assert max_length_of(LlavaConfig(text_config=LlamaConfig(max_position_embeddings=321).to_dict())) == 321
    assert max_length_of(BloomConfig()) == NO_LENGTH_LIMIT == 2**31 - 1


def test_a_bloom_policy_without_a_position_limit_trains_with_a_critic_started_from_it(embedded_assets, reward,
                                                                                     log_dir, tmp_path):
    """BLOOM's positions are ALiBi biases, so its config declares no length limit. A critic started from such a policy
    reports max_length 2^31 - 1 and values rows longer than any limit of the embedded models, and the actor runs a
    PPO step on the policy against it."""
    from transformers import BloomConfig, BloomForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(embedded_assets.policy)
    model_dir = tmp_path / "bloom"
    torch.manual_seed(0)
    BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=4,
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    tokens = torch.randint(4, len(tokenizer), (2, 300), generator=torch.Generator().manual_seed(0))
    with ServiceProcess("critic", "--model", str(model_dir), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        log_dir=log_dir) as critic:
        ch = channel(critic.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).max_length == 2**31 - 1
        reply = stub.Infer(critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(torch.tensor([300, 250]))),
                           timeout=60)
        ch.close()
        values = decode(reply.values, "values")
        assert values.shape == (2, 300) and values.isfinite().all() and (values[1, 250:] == 0).all()
        run = run_actor("ppo", tmp_path / "run", *RUN, "ppo.max_num_steps=1", "checkpointing.save_period=0",
                        f"policy.model_name={model_dir}", f"critic.address={critic.address}",
                        f"reward.address={reward.address}")
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = metrics(tmp_path / "run")
    assert row["step"] == 1 and row["critic/loss"] > 0 and row["train_optim/grad_norm"] > 0


def test_an_actor_run_with_lora_checkpoints_and_resumes_exactly(reward, tmp_path):
    """Two steps, a checkpoint after each; the second is deleted and the same command resumes from the first: its
    step 2 equals the uninterrupted run's."""
    run_dir = tmp_path / "run"
    args = ("grpo", run_dir, *RUN, "policy.lora.rank=4", "policy.lora.save_merged=true",
            f"reward.address={reward.address}", critic_dead())
    run = run_actor(*args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LoRA adapters (rank 4, alpha 16.0) train" in run.stderr
    assert "the policy with its LoRA adapters disabled" in run.stderr
    first = metrics(run_dir)
    for step in (1, 2):
        ck = run_dir / "checkpoints" / f"step_{step}"
        assert (ck / "actor" / "adapter_model.safetensors").is_file() and (ck / "actor_merged" / "config.json").is_file()
    shutil.rmtree(run_dir / "checkpoints" / "step_2")
    again = run_actor(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after step 1" in again.stderr
    second = metrics(run_dir)
    assert [r["step"] for r in second] == [1, 2]
    timeless = [{k: v for k, v in r.items() if not k.startswith("timers/")} for r in (first[1], second[1])]
    assert timeless[1].keys() == timeless[0].keys()
    for key, value in timeless[0].items():
        assert timeless[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert json.loads((run_dir / "checkpoints" / "step_2" / "checkpoint.json").read_text())["step"] == 2


def test_a_gpt2_policy_trains_through_packed_conv1d_passes_with_a_critic_started_from_it(embedded_assets, reward,
                                                                                         log_dir, tmp_path):
    """GPT-2's projections are transformers `Conv1D`s (weight [in, out]) and its LM head is tied to the token
    embeddings. `python -m actor` with such a policy, beside a critic server started from it: its generation and
    log-prob passes run on prepacked weights, a PPO step trains both models, and the checkpoint loads back as a GPT-2
    whose head is still the (trained) embedding matrix."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_assets.policy)
    model_dir = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with ServiceProcess("critic", "--model", str(model_dir), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        log_dir=log_dir) as critic:
        run = run_actor("ppo", tmp_path / "run", *RUN, f"policy.model_name={model_dir}",
                        f"critic.address={critic.address}", f"reward.address={reward.address}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "policy.generation.prepack_weights=true" in run.stderr
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["critic/loss"] > 0 and r["train_optim/grad_norm"] > 0 and r["generation/decode_steps"] > 0
    # step 1's one optimizer step sees the policy the packed passes scored: the training forward (plain weights)
    # gives their log-probs back, and the reference (packed too) equals the policy
    assert rows[0]["train_optim/ppo_ratio_min"] == pytest.approx(1, abs=1e-4)
    assert rows[0]["train_optim/ppo_ratio_max"] == pytest.approx(1, abs=1e-4)
    assert rows[0]["train_rollouts/init_policy_kl"] == pytest.approx(0, abs=1e-6)
    start = GPT2LMHeadModel.from_pretrained(model_dir)
    trained = GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoints" / "step_2" / "actor")
    assert trained.lm_head.weight is trained.transformer.wte.weight
    assert not torch.equal(trained.transformer.wte.weight, start.transformer.wte.weight)
    assert not torch.equal(trained.transformer.h[0].attn.c_attn.weight, start.transformer.h[0].attn.c_attn.weight)
