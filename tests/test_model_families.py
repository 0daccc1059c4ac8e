"""Model families beyond the embedded Llama, each a tiny random model built locally from transformers' own config
class (no download): the actor's generation (batched, left-padded, on the pre-allocated KV cache where the family's
layers allow it, through prepacked weights, finished rows leaving the batch; and on the static-shape cache that CUDA
graphs decode on) gives transformers' greedy generate() of each prompt alone; the policy's log-prob passes over length buckets give each row's own forward; and the critic
loads its scalar head from the causal LM's checkpoint and values every row as alone. A few families with unusual
attention (soft-capping, sinks, mixture-of-experts, parallel blocks) also decode through the compiled step.

Tolerances: log-probs and values 1e-5 absolute (float32 sums in another order); tokens exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actor.generation import SamplingParams, TorchGenerationBackend
from actor.rollouts import RolloutCollector
from actor.tracking import Timers
from serving.modeling import PassLimits, load_scalar_head_model, per_token_scores

from .test_generation import assert_same_samples, generate_alone, responses, tiny_prompts

# vocab 32 (pad 0, bos 1, eos 2), 2 layers, 4 query heads on 2 key-value heads, hidden 32
COMMON = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2}
GPT_STYLE = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128}  # families that name the sizes GPT-2's way

# model type -> (config overrides, the KV cache generation runs on)
FAMILIES = {
    "qwen2": ({}, "preallocated"),
    "qwen3": ({"head_dim": 8}, "preallocated"),
    "qwen2_moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}, "preallocated"),
    "qwen3_moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8},
                  "preallocated"),
    "mixtral": ({"num_local_experts": 4}, "preallocated"),
    "gemma": ({"head_dim": 8}, "preallocated"),
    # soft-capped attention and logits; a window longer than prompt + response never slides
    "gemma2": ({"head_dim": 8, "sliding_window": 256, "query_pre_attn_scalar": 8}, "preallocated"),
    # a window that slides within the response: transformers' own cache
    "gemma3_text": ({"head_dim": 8, "sliding_window": 4, "query_pre_attn_scalar": 8}, "dynamic"),
    "gpt_oss": ({"num_local_experts": 4, "head_dim": 8, "sliding_window": 256}, "preallocated"),  # attention sinks
    "phi": ({}, "preallocated"),  # partial rotary, parallel attention and MLP
    "phi3": ({}, "preallocated"),  # fused qkv and gate-up projections
    "gpt_neox": ({}, "preallocated"),
    "stablelm": ({}, "preallocated"),
    "olmo2": ({}, "preallocated"),
    "cohere": ({}, "preallocated"),
    "starcoder2": ({"sliding_window": None}, "preallocated"),
    "smollm3": ({}, "preallocated"),
    "falcon": ({"new_decoder_architecture": True, "num_kv_heads": 2}, "preallocated"),
    "opt": ({"ffn_dim": 64, "word_embed_proj_dim": 32}, "preallocated"),
    "gptj": ({**GPT_STYLE, "rotary_dim": 4}, "preallocated"),
    "gpt_bigcode": (GPT_STYLE, "preallocated"),
    "exaone4": ({}, "preallocated"),
    "glm": ({}, "preallocated"),
}
COMPILED = ["gemma2", "gpt_oss", "qwen3_moe", "phi"]


def family_model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type][0]})
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generation_gives_transformers_greedy_output_of_each_prompt_alone(model_type):
    model, prompts = family_model(model_type), tiny_prompts()
    backend = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=0.75)
    r = backend.generate(prompts, SamplingParams(12, temperature=0.0, stop_token_ids=(2,)), seed=0)
    assert backend.prepack and backend.last_stats.cache == FAMILIES[model_type][1]
    # the static-shape cache (policy.generation.cuda_graphs decodes on it) where the family's layers allow the
    # pre-allocated one, else the same fallback
    static = TorchGenerationBackend(model, 0, torch.device("cpu"), kv_cache="static")
    s = static.generate(prompts, SamplingParams(12, temperature=0.0, stop_token_ids=(2,)), seed=0)
    assert static.last_stats.cache == {"preallocated": "static"}.get(FAMILIES[model_type][1], "dynamic")
    for i, p in enumerate(prompts):
        assert responses(r)[i] == responses(s)[i] == generate_alone(model, p, 12), i
    assert not any("forward" in m.__dict__ for m in model.modules())  # the packed layers are given back


@pytest.fixture
def fresh_graphs():
    """Each family compiles its own graph, and leaves none behind for the tests after it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("model_type", COMPILED)
def test_the_compiled_decode_step_samples_as_the_eager_one(model_type, fresh_graphs):
    model, prompts = family_model(model_type), tiny_prompts()
    eager = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0)
    compiled = TorchGenerationBackend(model, 0, torch.device("cpu"), compact_below=1.0, compile_decode=True)
    params = SamplingParams(12, temperature=1.0, top_k=10, stop_token_ids=(2,))
    a, b = eager.generate(prompts, params, seed=3), compiled.generate(prompts, params, seed=3)
    assert_same_samples(a, b)
    assert compiled.last_stats.compiled_steps > 0


def ragged(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of scattered lengths (one of a single token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([14, 5, 9, 1, 12, 7])
    tokens = torch.randint(3, 32, (len(lengths), 14), generator=g)
    tokens[torch.arange(14)[None, :] >= lengths[:, None]] = 0
    return tokens, lengths


@pytest.mark.parametrize("model_type", FAMILIES)
def test_log_probs_and_critic_values_over_length_buckets_equal_each_row_alone(model_type, tmp_path):
    model = family_model(model_type)
    tokens, lengths = ragged()
    collector = RolloutCollector(policy=model, reference=None, backend=None, critic=None, score=None, pad_id=0,
                                 device=torch.device("cpu"), generation_batch_size=4,
                                 logprob_passes=PassLimits(rows=2), timers=Timers(), prepack=True)
    logprobs = collector.logprobs(model, tokens, lengths)
    model.save_pretrained(tmp_path)
    critic = load_scalar_head_model(str(tmp_path)).eval()
    with torch.no_grad():
        values = per_token_scores(critic, tokens, lengths)
        for i, n in enumerate(lengths.tolist()):
            row = tokens[i:i + 1, :n]
            alone = torch.log_softmax(model(input_ids=row).logits[0, :-1].float(), -1).gather(1, row[0, 1:, None])
            torch.testing.assert_close(logprobs[i, :n - 1], alone[:, 0], atol=1e-5, rtol=0)
            assert (logprobs[i, n - 1:] == 0).all()
            torch.testing.assert_close(values[i, :n], per_token_scores(critic, row, torch.tensor([n]))[0],
                                       atol=1e-5, rtol=0)
            assert (values[i, n:] == 0).all()


# families transformers has no sequence-classification class for: the critic puts its scalar head on the base model
NO_CLASSIFICATION_CLASS = {
    "granite": {},
    # attention and Mamba side by side; its layers hold non-persistent buffers (mup_vector) that only its own weight
    # initialisation fills, which transformers skipped for a class it took for custom code: garbage or NaN values
    "falcon_h1": {"head_dim": 8, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8,
                  "mamba_chunk_size": 16},
}


@pytest.mark.parametrize("model_type", NO_CLASSIFICATION_CLASS)
def test_a_critic_of_a_family_without_a_classification_class_holds_the_causal_lm_s_own_body(model_type, tmp_path):
    """Every parameter and buffer of the body, as transformers loads the causal LM; finite values."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **NO_CLASSIFICATION_CLASS[model_type]})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    lm, critic = AutoModelForCausalLM.from_pretrained(tmp_path), load_scalar_head_model(str(tmp_path)).eval()
    body = {**dict(lm.named_buffers()), **dict(lm.named_parameters())}
    held = {**dict(critic.named_buffers()), **dict(critic.named_parameters())}
    assert set(body) - set(held) == {"lm_head.weight"}
    for name in set(body) & set(held):
        assert torch.equal(held[name], body[name]), name
    tokens, lengths = ragged()
    with torch.no_grad():
        assert torch.isfinite(per_token_scores(critic, tokens, lengths)).all()


def test_a_classifier_with_more_than_one_output_is_refused_naming_its_labels(tmp_path):
    """transformers' own error for the head's shape asked for ignore_mismatched_sizes; a critic or reward model
    scores with one output, and the refusal says so."""
    from transformers import LlamaForSequenceClassification

    config = AutoConfig.for_model("llama", **COMMON, num_labels=2)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    for trained_head in (True, False):
        with pytest.raises(ValueError, match="its head has another shape than one output .* num_labels=2"):
            load_scalar_head_model(str(tmp_path), trained_head=trained_head)
