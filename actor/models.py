"""The actor's models: the policy it trains (all layers, the top N blocks, or LoRA adapters) and the reference
policy of the KL term (resident on the device, offloaded to the CPU between uses, or the policy itself with its
adapters disabled). The trainer asks `load_models` once; the step never branches on these choices.

What trains (docs/policy_models.md):
- `policy.num_layers_unfrozen=-1`: every parameter.
- `policy.num_layers_unfrozen=N >= 0`: the top N transformer blocks, every module of the decoder after its block list
  (the final norm) and the LM head; the embeddings and the lower blocks are frozen. A head tied to the input
  embeddings is one tensor with them, and is frozen with them.
- `policy.lora`: only the adapters (peft injects them into the model's own modules, so the model the actor runs is
  the Hugging Face model itself, adapted).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from embedded import naming_the_model, resolve_model
from serving.modeling import embeddable_pad_id, load_tokenizer, vocab_sha256

from .checkpoints import OTHER_CHOICES, ResumeError
from .config import LoraConfig, PolicyConfig

if TYPE_CHECKING:  # peft loads only for a LoRA policy: a quarter second of every actor start otherwise
    from peft import PeftModel

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


class ModelSetupError(ValueError):
    """The policy cannot be set up as configured; the message names the key and what is wrong."""


def padding_id(tokenizer: PreTrainedTokenizerBase, embedding_rows: int, source: str) -> int:
    """The id generated rows are padded with (`embeddable_pad_id`: the tokenizer's pad token, else its EOS, the first
    the policy can embed). ModelSetupError names policy.model_name when neither exists or fits."""
    pad = embeddable_pad_id(tokenizer, embedding_rows, source, "policy")
    if pad is not None:
        return pad
    named = [f"{name} {i}" for name, i in (("pad", tokenizer.pad_token_id), ("EOS", tokenizer.eos_token_id))
             if i is not None]
    if not named:
        raise ModelSetupError(f"policy.model_name: the tokenizer of {source} has neither a pad token nor an EOS token; "
                              "generation pads rows with one of them (set pad_token or eos_token in its "
                              "tokenizer_config.json)")
    raise ModelSetupError(
        f"policy.model_name: the tokenizer of {source} pads with ids past the policy's embedding table "
        f"({embedding_rows} rows): {', '.join(named)}; the tokenizer has tokens the "
        "model was not resized for (model.resize_token_embeddings(len(tokenizer)), then save it)")


# --- the reference policy ------------------------------------------------------------------------------------

class Reference(Protocol):
    def resident(self) -> AbstractContextManager[PreTrainedModel]:
        """The reference model, ready for a forward pass on the policy's device for the duration of the block."""
        ...


@dataclass
class ResidentReference:
    """A frozen copy that stays on the policy's device."""

    model: PreTrainedModel

    def resident(self) -> AbstractContextManager[PreTrainedModel]:
        return nullcontext(self.model)


@dataclass
class OffloadedReference:
    """A frozen copy kept on the CPU, moved to `device` for each use and back after it (trlx's offload)."""

    model: PreTrainedModel
    device: torch.device

    @contextmanager
    def resident(self) -> Iterator[PreTrainedModel]:
        self.model.to(self.device)
        try:
            yield self.model
        finally:
            self.model.to("cpu")


@dataclass
class DisabledAdapterReference:
    """The LoRA policy with its adapters switched off: the base model, with no second copy in memory."""

    adapted: PeftModel

    @contextmanager
    def resident(self) -> Iterator[PreTrainedModel]:
        with self.adapted.disable_adapter():
            yield self.adapted.get_base_model()


# --- freezing ------------------------------------------------------------------------------------------------

def decoder_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(qualified name, module list) of the model's transformer blocks: the first ModuleList whose length is
    config.num_hidden_layers (model.layers for Llama/Mistral/Qwen, transformer.h for GPT-2)."""
    n = getattr(model.config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and n is not None and len(module) == n:
            return name, module
    found = f"no list of {n} modules" if n is not None else "its config has no num_hidden_layers"
    raise ModelSetupError(f"policy.num_layers_unfrozen: cannot find the transformer blocks of {type(model).__name__} "
                          f"({found}); set policy.num_layers_unfrozen=-1 to train every layer")


def freeze_lower_layers(model: PreTrainedModel, num_unfrozen: int) -> str:
    """Freeze (requires_grad False) the embeddings and every block below the top `num_unfrozen`; the top blocks, the
    decoder's modules after its block list (the final norm) and the LM head stay trainable, except a head tied to the
    input embeddings, which is frozen with them. Returns a one-line description for the log."""
    name, blocks = decoder_blocks(model)
    if num_unfrozen > len(blocks):
        raise ModelSetupError(f"policy.num_layers_unfrozen={num_unfrozen}, but {type(model).__name__} has "
                              f"{len(blocks)} transformer blocks ({name}): use 0..{len(blocks)}, or -1 for all")
    decoder_name, _, list_name = name.rpartition(".")
    decoder = model.get_submodule(decoder_name)
    model.requires_grad_(False)
    for block in list(blocks)[len(blocks) - num_unfrozen:]:
        block.requires_grad_(True)
    children = list(decoder.named_children())
    for _, child in children[[n for n, _ in children].index(list_name) + 1:]:
        child.requires_grad_(True)  # after the blocks: the final norm
    inside = {id(p) for p in decoder.parameters()}
    for p in model.parameters():
        if id(p) not in inside:  # outside the decoder: the LM head
            p.requires_grad_(True)
    embeddings = model.get_input_embeddings()
    embeddings.requires_grad_(False)  # a tied head is this same tensor
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    return (f"the top {num_unfrozen} of {len(blocks)} blocks ({name}), the final norm and the LM head train"
            + (" (the LM head is tied to the input embeddings: frozen with them)" if tied else ""))


# --- LoRA ----------------------------------------------------------------------------------------------------

def add_adapters(model: PreTrainedModel, cfg: LoraConfig) -> PeftModel:
    """The model with fresh LoRA adapters (B = 0, so it computes what the base model does); only they train."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = cfg.target_modules
    try:
        return get_peft_model(model, PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                                    target_modules=targets, task_type="CAUSAL_LM"))
    except ValueError as e:  # peft prints a whole module (a block list: the whole model) that it cannot adapt
        why = re.sub(r"Target module (\w+)\(.*\) is not supported", r"Target module \1 is not supported", str(e),
                     flags=re.DOTALL)
        raise ModelSetupError(f"policy.lora.target_modules={targets!r}: {why}") from None


def merged_state_dict(adapted: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own key names) with every active adapter merged in, W + (alpha/r) B A, on the
    CPU; the model being trained is left untouched (peft's merge_and_unload would change it in place)."""
    from peft.tuners.lora import LoraLayer

    base = adapted.get_base_model()
    merged = {k.replace(".base_layer.", "."): v.detach().cpu()
              for k, v in base.state_dict().items() if ".lora_" not in k}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                key = f"{name}.weight"
                delta = sum(module.get_delta_weight(a).cpu().float() for a in module.active_adapters)
                merged[key] = (merged[key].float() + delta).to(merged[key].dtype)
    return merged


# --- loading -------------------------------------------------------------------------------------------------

@dataclass
class PolicyModels:
    """policy: the model the actor generates with, computes log-probs with and trains (adapters injected with LoRA);
    reference: the KL term's model, None when skipped; trainable: what the optimizer holds, in a fixed order (an
    optimizer state saved by one run loads into the next); adapted: the peft wrapper with LoRA, else None."""

    policy: PreTrainedModel
    reference: Reference | None
    trainable: list[torch.nn.Parameter]
    adapted: PeftModel | None
    save_merged: bool = False

    def save(self, directory: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """directory/actor: the policy in Hugging Face format, or with LoRA the adapter (adapter_config.json,
        adapter_model.safetensors); with lora.save_merged also directory/actor_merged, the merged model. Both hold the
        tokenizer."""
        if self.adapted is None:
            self.policy.save_pretrained(directory / "actor")
        else:
            self.adapted.save_pretrained(directory / "actor")
            if self.save_merged:
                self.policy.save_pretrained(directory / "actor_merged", state_dict=merged_state_dict(self.adapted))
                tokenizer.save_pretrained(directory / "actor_merged")
        tokenizer.save_pretrained(directory / "actor")

    @contextmanager
    def training(self) -> Iterator[None]:
        """The policy update: LoRA's dropout is on inside the block; everything else stays in eval mode (no dropout,
        so without LoRA dropout the first epoch's ratio is exactly 1)."""
        dropouts = [m for name, m in self.policy.named_modules() if name.rpartition(".")[2] == "lora_dropout"]
        for m in dropouts:
            m.train()
        try:
            yield
        finally:
            for m in dropouts:
                m.eval()


def require_lm_head(model: PreTrainedModel, loading_info: dict, key: str, spec: str) -> None:
    """Refuse a checkpoint whose language-model head transformers had to initialise at random (a reward or value
    model given as a policy: it would train and sample from noise)."""
    head = model.get_output_embeddings()
    names = [n for n, p in model.named_parameters() if head is not None and p is head.weight]
    if set(names) & set(loading_info.get("missing_keys", ())):
        raise ModelSetupError(f"{key}={spec} has no weights for the language-model head ({names[0]}): it is not a "
                              f"causal language model (a reward or value model?)")


def vocabulary_misfit(reference: PreTrainedModel, reference_path: str, policy: PreTrainedModel,
                      policy_path: str) -> str | None:
    """Why `reference` cannot score the policy's tokens (an embedding table of another size; a tokenizer beside it
    with another vocabulary), or None."""
    rows, ref_rows = (m.get_input_embeddings().num_embeddings for m in (policy, reference))
    if rows != ref_rows:
        return f"its embedding table has {ref_rows} rows, the policy's {rows}"
    try:
        theirs, ours = load_tokenizer(reference_path), load_tokenizer(policy_path)
    except (OSError, ValueError):  # no tokenizer beside the reference: its rows are what can be compared
        return None
    if vocab_sha256(theirs) != vocab_sha256(ours):
        return "its tokenizer's vocabulary differs from the policy's"
    return None


def load_models(cfg: PolicyConfig, checkpoint: Path | None, device: torch.device, dtype: torch.dtype,
                with_reference: bool = True) -> PolicyModels:
    """The policy from cfg.model_name, or from `checkpoint`/actor when resuming (with LoRA: the base model plus the
    saved adapter, trainable), frozen or adapted as configured, on `device`; and the reference policy unless
    `with_reference` is false. `dtype` is the passes' compute dtype: the policy's and a separate reference's weights
    are float32 whatever it is (the passes run in it under autocast); a LoRA base, never trained, is held in it."""
    saved = checkpoint / "actor" if checkpoint is not None else None
    holds_adapter = saved is not None and (saved / ADAPTER_CONFIG).is_file()
    if saved is not None and holds_adapter != (cfg.lora is not None):
        raise ResumeError(f"{checkpoint} holds {'a LoRA adapter' if holds_adapter else 'full policy weights'}, but "
                          f"policy.lora is {'null' if cfg.lora is None else 'set'}: resume with the policy.lora the "
                          "run was started with, or checkpointing.resume=never")
    base_path = resolve_model(cfg.model_name, key="policy.model_name") if saved is None or holds_adapter else str(saved)
    # trained weights stay float32 (the passes run in `dtype` under autocast: mixed precision); LoRA's frozen base
    # is held in `dtype`, its adapters in float32 (peft's default)
    try:
        with naming_the_model("policy.model_name", cfg.model_name) if base_path != str(saved) else nullcontext():
            model, info = AutoModelForCausalLM.from_pretrained(
                base_path, dtype=dtype if cfg.lora is not None else torch.float32,
                trust_remote_code=cfg.trust_remote_code, output_loading_info=True)
    except (OSError, ValueError, SafetensorError) as e:
        if base_path != str(saved):
            raise
        raise ResumeError(f"{checkpoint}: its policy cannot be loaded ({type(e).__name__}: {e}){OTHER_CHOICES}") \
            from None
    require_lm_head(model, info, "policy.model_name", cfg.model_name if base_path != str(saved) else str(saved))
    adapted = None
    if cfg.lora is not None:
        from peft import PeftModel

        adapted = (PeftModel.from_pretrained(model, str(saved), is_trainable=True) if holds_adapter
                   else add_adapters(model, cfg.lora))
        model = adapted.get_base_model()
        lora = adapted.peft_config["default"]  # a resumed adapter keeps the settings it was saved with
        what = f"LoRA adapters (rank {lora.r}, alpha {lora.lora_alpha}) train"
    elif cfg.num_layers_unfrozen >= 0:
        what = freeze_lower_layers(model, cfg.num_layers_unfrozen)
    else:
        what = "every layer trains"
    model.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ModelSetupError(f"policy.num_layers_unfrozen={cfg.num_layers_unfrozen} leaves no parameter of "
                              f"{type(model).__name__} to train")
    total = sum(p.numel() for p in model.parameters())
    log.info("policy: %s; %d of %d parameters (%.2f%%)", what, sum(p.numel() for p in trainable), total,
             100 * sum(p.numel() for p in trainable) / total)

    reference: Reference | None = None
    if with_reference and not cfg.separate_reference:
        reference = DisabledAdapterReference(adapted)
        log.info("reference policy: the policy with its LoRA adapters disabled (no second copy)")
    elif with_reference:
        # float32 like the policy, both computing under the same autocast: at the start the two agree exactly (a
        # bf16 copy would differ in its norms and biases, which autocast leaves to their weights' dtype)
        ref_key = "policy.reference_model_name" if cfg.reference_model_name else "policy.model_name"
        ref_spec = cfg.reference_model_name or cfg.model_name
        with naming_the_model(ref_key, ref_spec):
            ref, info = AutoModelForCausalLM.from_pretrained(resolve_model(ref_spec, key=ref_key), dtype=torch.float32,
                                                             trust_remote_code=cfg.trust_remote_code,
                                                             output_loading_info=True)
        require_lm_head(ref, info, ref_key, ref_spec)
        ref.eval().requires_grad_(False)
        if cfg.reference_model_name and (why := vocabulary_misfit(ref, resolve_model(ref_spec, key=ref_key), model,
                                                                   base_path)):
            raise ModelSetupError(f"policy.reference_model_name={ref_spec}: {why}; the KL to it would compare "
                                  f"different tokens: give a reference with the policy's tokenizer")
        if cfg.reference_offload:
            reference = OffloadedReference(ref, device)
            log.info("reference policy: on the CPU, moved to %s for its log-prob passes", device)
        else:
            reference = ResidentReference(ref.to(device))
    return PolicyModels(model, reference, trainable, adapted, save_merged=cfg.lora is not None and cfg.lora.save_merged)
