"""Models and token layouts shared by the critic and reward servers, the actor and the embedded builder.

Token batches are right-padded int64 [B, S] with int64 lengths [B] everywhere.

Critic and reward model are both `AutoModelForSequenceClassification` checkpoints with `num_labels=1`
(or the same layout built here for model types transformers has no such class for; or, for checkpoints saved as
`*ForTokenClassification` as verl saves them, that class, whose head has a bias and is named `classifier` in GPT-2's
family: `score_head`): a causal-LM body plus a linear head, which `from_pretrained` loads as-is. The critic reads the
head at every position (values), the reward model at the last valid position (rewards).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_MASKED_LM_MAPPING,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceUnavailable(ValueError):
    """The configured device is not here; the message names the key that asked for it."""


def resolve_device(spec: str, key: str = "device") -> torch.device:
    """The device a service computes on ('auto': CUDA where torch sees a GPU, else the CPU). A CUDA device torch does
    not see (a CPU-only build of torch, no GPU visible, an index past the GPUs) is refused (DeviceUnavailable),
    naming `key`. On CUDA this also turns off SDPA's cuDNN attention backend for the process
    (`use_flash_or_efficient_attention`)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else "torch sees no GPU here (CUDA_VISIBLE_DEVICES, the driver)")
            raise DeviceUnavailable(f"{key}={spec}: {why} (torch {torch.__version__}); use {key}=cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceUnavailable(f"{key}={spec}: torch sees {count} GPU(s) here, cuda:0 to cuda:{count - 1}")
        use_flash_or_efficient_attention()
    return device


def embeddable_pad_id(tokenizer: PreTrainedTokenizerBase, embedding_rows: int, source: str,
                      model: str = "model") -> int | None:
    """The id rows are padded with: the tokenizer's pad token, else its EOS, the first that the model (`model`, for
    the log) can embed, an id below its `embedding_rows`. Padding positions are masked, so any such id will do: a pad
    token added to the tokenizer without resizing the model's embeddings is passed over, with a warning. None when
    neither exists or fits."""
    named = [(name, i) for name, i in (("pad", tokenizer.pad_token_id), ("EOS", tokenizer.eos_token_id)) if i is not None]
    fits = [(name, i) for name, i in named if 0 <= i < embedding_rows]
    if fits and fits[0] != named[0]:
        log.warning("the pad token of %s (id %d) is past the %s's embedding table (%d rows), which was not resized "
                    "for it; rows are padded with %s (id %d) instead (padding positions are masked)", source,
                    named[0][1], model, embedding_rows, *fits[0])
    return fits[0][1] if fits else None


def use_flash_or_efficient_attention() -> None:
    """Keep `scaled_dot_product_attention` off its cuDNN backend (torch then picks flash or memory-efficient attention,
    the same numerics class). cuDNN builds an execution plan for every new shape, and our shapes change all the time
    by design: generation drops finished rows from the batch, and padding-free passes and length-sorted
    micro-batches vary in width. On one H100 (`python -m bench.generation --device cuda --precision bfloat16`,
    docs/PERFORMANCE.md) stop-at-EOS generation ran at 429 tokens/s with cuDNN attention and 3306 without."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("CUDA: scaled_dot_product_attention's cuDNN backend off (a plan per new shape); flash or "
                 "memory-efficient attention instead")


# OpenRLHF saves its reward and critic models' head as `value_head` (its default `value_head_prefix` before `score`)
_HEAD_ALIASES = {r"^value_head\.": "score."}


def load_scalar_head_model(path: str, dtype: torch.dtype = torch.float32, *, trained_head: bool = False,
                           trust_remote_code: bool = False) -> PreTrainedModel:
    """Load a Hugging Face checkpoint with a one-output `score` head. A causal-LM checkpoint (e.g. the
    policy) gets a freshly initialised head, which is how a critic is initialised from the policy; with
    `trained_head` (a reward model) a checkpoint without the head's weights is refused instead. Model types
    without a sequence-classification class in transformers get one built from their base model
    (`scalar_head_class`). A checkpoint that leaves the whole body uninitialised is refused. `trust_remote_code`
    lets transformers run the model code a checkpoint ships (its config's auto_map)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    labels, config.num_labels = config.num_labels, 1  # the checkpoint's own count, for the refusal below

    def load(cls: type) -> tuple[PreTrainedModel, dict]:
        remote = {"trust_remote_code": trust_remote_code} if cls is AutoModelForSequenceClassification else {}
        return cls.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True,
                                   key_mapping=_HEAD_ALIASES, **remote)

    try:
        model, info = load(scalar_head_class(config, trust_remote_code))
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e):
            raise
        raise ValueError(f"{path}: its head has another shape than one output (a critic and a reward model score with "
                         f"one; the checkpoint's config has num_labels={labels}): {str(e).splitlines()[0]}") from None
    # transformers reverses a load's key mapping when the model is saved: the critic's checkpoints keep `score`
    if getattr(model, "_weight_conversions", None):
        model._weight_conversions = [c for c in model._weight_conversions
                                     if getattr(c, "source_patterns", None) != list(_HEAD_ALIASES)]
    name, head = score_head(model)
    if head is None or (name == "classifier" and type(config) in MODEL_FOR_MASKED_LM_MAPPING):
        # an encoder's token classifier (BERT's, DeBERTa's: a model type with a masked-LM class) sees the tokens after
        # each position, so it cannot value a prefix
        raise NoScoreHead(f"{path}: {type(model).__name__} has no `score` head; the critic reads a linear `score` "
                          f"over a decoder body's hidden states at every position, as transformers' decoder models lay "
                          f"out sequence classification (an encoder such as BERT or DeBERTa serves as a reward model "
                          f"only)")
    return _checked(path, model, info, {n for n, _ in head.named_parameters(prefix=name)}, trained_head)


def score_head(model: PreTrainedModel) -> tuple[str, torch.nn.Module | None]:
    """(name, module) of the linear head that scores the body's hidden states at every position: `score`, as
    transformers' decoders name it, or the `classifier` of a token-classification model whose family names it so
    (GPT-2, GPT-NeoX, BLOOM, Falcon, MPT, ...: verl saves its critics and reward models of those families so).
    `load_scalar_head_model` accepts a model only with a head, and a `classifier` only over a decoder."""
    if getattr(model, "score", None) is not None:
        return "score", model.score
    if type(model).__name__.endswith("ForTokenClassification"):
        return "classifier", getattr(model, "classifier", None)
    return "score", None


def _checked(path: str, model: PreTrainedModel, info: dict, head: set[str], trained_head: bool) -> PreTrainedModel:
    """`model` as loaded from `path` with transformers' loading `info`, once it is known to hold its body's weights
    and, with `trained_head`, those of its `head` parameters; a config without a pad token gets EOS as one."""
    body = [name for name, _ in model.named_parameters() if name not in head]
    missing = set(info["missing_keys"])
    if body and set(body) <= missing:
        raise ValueError(f"{path} has no weights for the body of {type(model).__name__} (expected keys like "
                         f"{body[0]!r}): it is not a checkpoint of this model type")
    if trained_head and head & missing:
        raise ValueError(f"{path} has no weights for the reward head ({', '.join(sorted(head & missing))}): it is not "
                         f"a reward model (a causal LM or a base model would score with a random head); a reward "
                         f"model is a sequence-classification checkpoint with one label")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


class NoScoreHead(ValueError):
    """The checkpoint's sequence-classification class has no per-position `score` head (an encoder's `classifier`)."""


def load_sequence_classifier(path: str, dtype: torch.dtype = torch.float32, *,
                             trust_remote_code: bool = False) -> PreTrainedModel:
    """A reward model that scores a whole sequence through its own pooling and head: the BERT-style encoders (DeBERTa,
    RoBERTa, BERT, ...) whose sequence-classification class reads a `classifier` over the first token rather than a
    `score` at every position, as OpenAssistant's DeBERTa reward models do. It must be a one-label checkpoint with
    the head's weights."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if config.num_labels != 1:
        raise ValueError(f"{path}: a reward model has one output, and this checkpoint has num_labels="
                         f"{config.num_labels}")
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=dtype, output_loading_info=True, trust_remote_code=trust_remote_code)
    prefix = f"{model.base_model_prefix}."  # the head: its pooling and classifier, outside the body
    return _checked(path, model, info, {name for name, _ in model.named_parameters() if not name.startswith(prefix)},
                    trained_head=True)


def sequence_scores(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor, *,
                    separator: int | None = None) -> torch.Tensor:
    """A sequence classifier's score of each right-padded row (its own pooling and head), float32 [B]. A model that
    tells a pair's segments apart by token type ids (BERT's, ELECTRA's) takes the tokenizer's `separator` id: the
    tokens after a row's first separator are its second segment (type 1), as the tokenizer types
    `[CLS] a [SEP] b [SEP]`; a row without a second segment is all type 0."""
    mask = attention_mask_from_lengths(lengths, tokens.shape[1])
    types = {}
    if separator is not None:
        sep = (tokens == separator).long()
        types["token_type_ids"] = ((sep.cumsum(1) - sep) > 0).long() * mask
    return model(input_ids=tokens, attention_mask=mask, **types).logits[:, 0].float()


def scalar_head_class(config: PretrainedConfig, trust_remote_code: bool = False) -> type:
    """The class that loads `config`'s model type with a linear `score` head. A checkpoint saved as a
    `*ForTokenClassification` (verl trains its critics and reward models so: the same body and a head with a bias,
    `score`, or `classifier` in GPT-2's, GPT-NeoX's, BLOOM's families: `score_head`) loads with
    `AutoModelForTokenClassification`, which keeps that bias (the sequence-classification head has none, so the bias
    would be dropped). Otherwise `AutoModelForSequenceClassification` where transformers (or, with
    `trust_remote_code`, the checkpoint's own code) has a sequence-classification class for the type; otherwise one
    built from the type's base model (`AutoModel`), laid out as transformers' own `GenericForSequenceClassification`
    classes are (the body under the type's `base_model_prefix`, then `score`), so it loads the body of a causal-LM
    checkpoint of that type and its saved checkpoints load back the same way (Granite, Cohere, CodeGen, Gemma 3n,
    Llama 4, ... have no such class)."""
    architectures = getattr(config, "architectures", None) or []
    if type(config) in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING and any(
            str(a).endswith("ForTokenClassification") for a in architectures):
        return AutoModelForTokenClassification
    auto_map = getattr(config, "auto_map", None) or {}
    if type(config) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING or (
            trust_remote_code and "AutoModelForSequenceClassification" in auto_map):
        return AutoModelForSequenceClassification
    if type(config) in MODEL_MAPPING:
        return _generic_scalar_head(MODEL_MAPPING[type(config)])
    if trust_remote_code and "AutoModel" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return _generic_scalar_head(get_class_from_dynamic_module(auto_map["AutoModel"], config._name_or_path))
    raise ValueError(f"model type {config.model_type!r}: transformers has neither a sequence-classification nor a "
                     f"base model class for it, so it cannot carry a value or reward head")


@functools.cache
def _generic_scalar_head(base: type[PreTrainedModel]) -> type:
    # the family's own PreTrainedModel (GranitePreTrainedModel, ...): the class in the MRO right above PreTrainedModel
    family = next(c for c in base.__mro__ if PreTrainedModel in c.__bases__)
    name = base.__name__.removesuffix("Model") + "ForSequenceClassification"
    prefix = family.base_model_prefix or GenericForSequenceClassification.base_model_prefix

    def __init__(self, config: PretrainedConfig) -> None:
        # GenericForSequenceClassification's own, but with the body built from `base` itself: its AutoModel lookup
        # knows nothing of a checkpoint's own code
        super(GenericForSequenceClassification, self).__init__(config)
        self.num_labels = config.num_labels
        setattr(self, prefix, base(config))
        self.score = torch.nn.Linear(config.get_text_config().hidden_size, self.num_labels, bias=False)
        self.post_init()

    # custom code as far as its body is: transformers skips its own weight initialisation in a model it takes for
    # custom code (wherever the class is not defined in transformers), which left Falcon-H1's non-persistent mup_vector
    # buffers as uninitialised memory, and the values garbage
    return type(name, (GenericForSequenceClassification, family),
                {"base_model_prefix": prefix, "__init__": __init__, "__module__": __name__,
                 "is_custom_code": classmethod(lambda cls: base.is_custom_code())})


def copy_remote_code(config: PretrainedConfig, source: str, target: Path) -> None:
    """Copy into `target` the Python files in the checkpoint directory `source` that `config.auto_map` names (a
    checkpoint's own model code), so a checkpoint written from that model loads with trust_remote_code as its source
    did; nothing for a model without them."""
    for ref in (getattr(config, "auto_map", None) or {}).values():
        for name in [ref] if isinstance(ref, str) else [r for r in ref if r]:  # a tokenizer's maps to a pair
            module = name.split("--")[-1].rsplit(".", 1)[0] + ".py"
            if (Path(source) / module).is_file() and not (target / module).exists():
                shutil.copy(Path(source) / module, target / module)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer stored beside a checkpoint."""
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def attention_mask_from_lengths(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """int64 [B] lengths -> int64 [B, S] mask, 1 on the first lengths[b] positions (right padding)."""
    return (torch.arange(seq_len, device=lengths.device)[None, :] < lengths[:, None]).long()


def right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (int64 [B, max_len] right-padded, int64 [B] lengths)."""
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens, torch.tensor([len(r) for r in rows], dtype=torch.long)


def pad_and_stack(rows: list[torch.Tensor], pad: int = 0) -> torch.Tensor:
    """Right-pad [B_i, S_i] tensors to the longest S and concatenate along the batch."""
    width = max(r.shape[1] for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad) for r in rows])


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the platform says)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_thread_budget(n: int, key: str = "num_threads") -> None:
    """The process's torch threads set to `n` (0: torch's default, one per core), with a warning where `n` is more
    than the cores this process may run on: threads past them time-slice the same cores and a step gets slower."""
    if n <= 0:
        return
    cores = usable_cores()
    if n > cores:
        log.warning("%s=%d is more than the %d CPU cores this process may use; torch's threads will contend for them "
                    "(a value at most %d is faster)", key, n, cores, cores)
    torch.set_num_threads(n)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` for the block (0: unchanged), then restored: a process gives
    cores back while another process on the same machine computes at the same time."""
    before = torch.get_num_threads()
    if n <= 0 or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class PassLimits:
    """How a batch is cut into forward passes (`length_buckets`): at most `rows` rows (0: no limit) and `tokens` tokens
    counted padded (rows x the pass's width; 0: no limit), the width being the pass's longest row rounded up to a
    multiple of `width_multiple`."""

    rows: int = 0
    tokens: int = 0
    width_multiple: int = 1

    @classmethod
    def of(cls, size: int | PassLimits, max_tokens: int = 0) -> PassLimits:
        """`size` itself when it is a PassLimits, else at most `size` rows (at least 1) and `max_tokens` tokens."""
        return size if isinstance(size, PassLimits) else cls(rows=max(1, size), tokens=max_tokens)

    def width(self, longest: int, cap: int | None = None) -> int:
        """A pass's width for its `longest` row: rounded up to width_multiple, at most `cap` (the batch's width)."""
        w = -(-longest // self.width_multiple) * self.width_multiple
        return w if cap is None else min(w, max(cap, longest))


def length_buckets(lengths: torch.Tensor, size: int | PassLimits, max_tokens: int = 0) -> list[torch.Tensor]:
    """Row indices in chunks of at most `size` rows, longest rows first. A chunk trimmed to its own longest row
    carries little padding, so passes over the chunks cost in proportion to the valid tokens, not the padded
    batch; for right-padded causal models the outputs at valid positions are the same either way. With
    `max_tokens` > 0 a chunk also holds at most that many tokens counted padded (its rows x its longest row; a
    longer row alone makes its own chunk), so long rows go in few to a pass and short ones in many. `size` may be a
    PassLimits instead, which then gives both (its rows 0: no row limit) and the width multiple the tokens are
    counted at."""
    limits = PassLimits.of(size, max_tokens)
    lengths = lengths.cpu()
    order = torch.argsort(lengths, descending=True, stable=True)
    most_rows = limits.rows if limits.rows > 0 else len(order)
    if limits.tokens <= 0:
        return list(order.split(most_rows))
    sorted_lengths = lengths[order].tolist()
    sizes, start = [], 0
    while start < len(order):
        rows = min(most_rows, len(order) - start,
                   max(1, limits.tokens // max(1, limits.width(sorted_lengths[start]))))
        sizes.append(rows)
        start += rows
    return list(order.split(sizes))


def by_length(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokens: torch.Tensor, lengths: torch.Tensor,
              size: int | PassLimits, device: torch.device | str = "cpu", max_tokens: int = 0,
              observe: Callable[[int], object] | None = None) -> torch.Tensor:
    """Apply `fn(tokens [b, w], lengths [b])` to length buckets of at most `size` rows (and `max_tokens` padded
    tokens, when > 0; or as a PassLimits gives), each trimmed to its longest row w (rounded up to the limits' width
    multiple, within the batch's width), and gather the outputs back in row order on the CPU.
    `fn` returns [b] per row or [b, w - k] per position; positions past a bucket's width are 0 in the result
    ([B] or [B, S - k]). `observe`, when given, is called with each pass's padded tokens (b x w) before it runs."""
    limits = PassLimits.of(size, max_tokens)
    out = None
    for idx in length_buckets(lengths, limits):
        w = limits.width(int(lengths[idx].max()), tokens.shape[1])
        if observe is not None:
            observe(len(idx) * w)
        y = fn(tokens[idx, :w].to(device), lengths[idx].to(device)).cpu()
        if out is None:
            shape = (tokens.shape[0],) if y.dim() == 1 else (tokens.shape[0], tokens.shape[1] - (w - y.shape[1]))
            out = torch.zeros(shape, dtype=y.dtype)
        if y.dim() == 1:
            out[idx] = y
        else:
            out[idx, :y.shape[1]] = y
    if out is None:
        raise ValueError("by_length needs at least one row")
    return out


def causal_lm_logits(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A causal LM's logits [B, S, V] over right-padded rows: tokens int64 [B, S], lengths int64 [B]."""
    return model(input_ids=tokens, attention_mask=attention_mask_from_lengths(lengths, tokens.shape[1])).logits


class CompileUnavailable(RuntimeError):
    """torch.compile was asked for where it cannot run; the message names the key that asked."""


ModelPass = Callable[[PreTrainedModel, torch.Tensor, torch.Tensor], torch.Tensor]


def require_compiler(key: str, device: torch.device) -> None:
    """Refuse `key=true` (CompileUnavailable) where torch.compile cannot build kernels: on the CPU inductor builds
    C++ kernels, on a GPU Triton kernels, so a machine without a C++ compiler, or without Triton or a GPU it
    supports, is refused at start rather than at the first pass."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except RuntimeError as e:  # inductor's InvalidCxxCompiler
            raise CompileUnavailable(f"{key}=true: torch.compile on the CPU builds C++ kernels, and no C++ compiler was "
                                     f"found ({type(e).__name__}; install g++ or clang++, or set $CXX), or set "
                                     f"{key}=false") from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileUnavailable(f"{key}=true: torch.compile on {device} builds Triton kernels, and Triton cannot run "
                                     f"here (the triton package is missing, or the GPU is older than compute capability "
                                     f"7.0, or no GPU is visible), or set {key}=false")


def compiled(fn: ModelPass, enabled: bool, key: str, device: torch.device) -> ModelPass:
    """`fn(model, tokens, lengths)` compiled by torch.compile when `enabled` (else `fn` itself), with dynamic shapes:
    one graph per model and grad mode serves every bucket width and row count, one row and one token included
    (`fn` returns per-position outputs, [B, S, ...], or one per row, [B]). Each first call compiles (tens of seconds
    on a CPU; see `warm_up`); the passes then run inductor's fused kernels, with float results equal to eager up to
    reduction order. Refused here, naming `key`, where it cannot compile (`require_compiler`)."""
    if not enabled:
        return fn
    require_compiler(key, device)
    graph = torch.compile(fn, dynamic=True)

    def pass_(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        rows, width = tokens.shape
        # Dynamo compiles a dimension of size 1 apart: a lone row runs as two copies of itself and a one-token batch
        # gets a padding column (masked, and after the real one, so causal attention never sees it); the extra
        # outputs are dropped. Fresh contiguous inputs (a few bytes a row): the graph guards on its inputs' strides
        # and on whether they are views, so a caller's trimmed slice and the warm-up's batch share one graph.
        if rows == 1:
            tokens, lengths = tokens.expand(2, -1), lengths.expand(2)
        if width == 1:
            tokens = torch.cat([tokens, tokens], dim=1)
        out = graph(model, tokens.clone(memory_format=torch.contiguous_format),
                    lengths.clone(memory_format=torch.contiguous_format))
        return out[:rows, :width] if out.dim() > 1 else out[:rows]  # per position, or per row (sequence_scores)

    return pass_


def computing_in(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """The region where passes compute in `dtype` on float32 weights: `torch.autocast` on `device`'s type, disabled
    for float32 (mixed precision, as NeMo-RL's and TRL's bf16 training run)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def mixed_precision(pass_: ModelPass, device: torch.device, dtype: torch.dtype) -> ModelPass:
    """`pass_` with its forward in `computing_in(device, dtype)`: float32 weights (what the optimizer updates), matmuls
    and attention in `dtype`; `pass_` itself for float32. A backward of its output runs outside the autocast region,
    as autocast asks."""
    if dtype == torch.float32:
        return pass_

    def pass_in_dtype(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        with computing_in(device, dtype):
            return pass_(model, tokens, lengths)

    return pass_in_dtype


def warm_up(pass_: ModelPass, models: list[PreTrainedModel], device: torch.device, *,
            train: PreTrainedModel | None = None,
            grad_free: Callable[[], AbstractContextManager] = torch.inference_mode,
            packed: Callable[[], AbstractContextManager] = nullcontext) -> float:
    """Run `pass_` once over a 2-row dummy batch (one row padded) so a compiled pass compiles now, at load, instead
    of at its first request: without gradients for each of `models`, under `grad_free` (as the servers' Infer and
    Score run; the actor's log-prob passes run under torch.no_grad) and `packed` (the prepacked weights those passes
    compute through, serving.prepack, when they do), and forward and backward in grad mode for `train` (as the
    critic's Train and the policy update run, on the plain layers). The gradients are dropped: weights and optimizer
    state are untouched. Returns the seconds it took."""
    started = time.perf_counter()
    width = min(8, *(max_length_of(m) for m in [*models, *([train] if train is not None else [])]))
    tokens = (torch.arange(2 * width) % 2).view(2, width).to(device)  # ids 0 and 1 exist in every vocabulary
    lengths = torch.tensor([width, max(width - 2, 1)], device=device)
    with grad_free(), packed():
        for model in models:
            pass_(model, tokens, lengths)
    if train is not None and any(p.requires_grad for p in train.parameters()):
        with torch.enable_grad():
            pass_(train, tokens, lengths).sum().backward()
        for p in train.parameters():
            p.grad = None
    return time.perf_counter() - started


def per_token_scores(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Head output at every position: float32 [B, S]; entry t scores the prefix tokens[:, :t+1].
    Padding positions are zeroed. tokens int64 [B, S] right-padded, lengths int64 [B]."""
    mask = attention_mask_from_lengths(lengths, tokens.shape[1])
    body = getattr(model, model.base_model_prefix)
    hidden = body(input_ids=tokens, attention_mask=mask).last_hidden_state
    scores = score_head(model)[1](hidden).squeeze(-1).float()
    return scores * mask


def last_token_scores(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """float [B, S] per-token scores -> float [B] at the last valid position lengths[b]-1."""
    return scores.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)


def at_last_token(pass_: ModelPass) -> ModelPass:
    """`pass_` (per-token scores [B, S], e.g. `per_token_scores` or its compiled form) read at each row's last valid
    position: a decoder reward model's score of each row, [B]."""
    def scores(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return last_token_scores(pass_(model, tokens, lengths), lengths)

    return scores


@dataclass(frozen=True)
class RewardNormalization:
    """`(score - mean) / std`: the statistics a reward model's scores are meant to be normalised with (the default
    leaves scores as they are, exactly)."""

    mean: float = 0.0
    std: float = 1.0

    def __str__(self) -> str:
        return f"(score - {self.mean:g}) / {self.std:g}"

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return (scores - self.mean) / self.std


def normalization_text(normalization: RewardNormalization) -> str:
    """How GetInfo reports a normalisation: its formula, or empty for none (scores as the model gives them)."""
    return "" if normalization == RewardNormalization() else str(normalization)


def reward_normalization(config: PretrainedConfig, setting: bool | None, key: str, source: str, *,
                         role: str = "reward model", outputs: str = "rewards") -> RewardNormalization:
    """How the scores of `source` (a `role`: reward model, or the critic's model) are normalised, from its config
    (logged, as its `outputs`, when they are): OpenRLHF's reward models trained with `--normalize_reward` carry
    `normalize_reward: true` and their scores' `mean` and `std` in config.json, and OpenRLHF reports
    `(score - mean) / std` from them, as its critic does for its values when started from such a model. `setting` (the
    server's `key`) None follows the checkpoint's own `normalize_reward` (without stats that is the identity, as in
    OpenRLHF); True requires the stats; False never normalises. Stats that are not a finite number, or a std that is
    not > 0, are refused, naming `key`."""
    wanted = bool(getattr(config, "normalize_reward", False)) if setting is None else setting
    stats = {name: getattr(config, name, None) for name in ("mean", "std")}
    if not wanted or (setting is None and None in stats.values()):
        return RewardNormalization()
    for name, value in stats.items():
        if value is None:
            raise ValueError(f"{key}=true: the {role}'s config.json has no `{name}` (OpenRLHF writes `mean` and "
                             f"`std` there for a reward model trained with --normalize_reward); set {key}=false")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{key}: the {role}'s config.json has {name}={value!r}; expected a finite number")
    if stats["std"] <= 0:
        raise ValueError(f"{key}: the {role}'s config.json has std={stats['std']!r}; expected a number > 0")
    normalization = RewardNormalization(float(stats["mean"]), float(stats["std"]))
    log.info("%s of %s reported as %s (its config.json's mean and std)", outputs, source, normalization)
    return normalization


# The max_length of a model whose positions have no limit, and of a rule scorer whose tokenizer sets none: the
# largest int32, as GetInfo reports it.
NO_LENGTH_LIMIT = 2**31 - 1

# Where configs keep their position limit: most of transformers' own, GPT-2's and GPT-J's, MPT's, and the remote-code
# models' (ChatGLM and Qwen 1 call it seq_length).
_POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "seq_length")


def max_length_of(model: PreTrainedModel | PretrainedConfig) -> int:
    """Longest sequence the model's positions allow, from the model's (text) config. A config that declares no limit
    belongs to a model whose positions have none (ALiBi biases in BLOOM, and in MPT and Falcon with `alibi`):
    NO_LENGTH_LIMIT. Models with learned position embeddings, which fail past their table, all declare it."""
    cfg = model if isinstance(model, PretrainedConfig) else model.config
    cfg = cfg.get_text_config()  # a multimodal config keeps the language model's limit there; any other is itself
    for key in _POSITION_LIMIT_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, NO_LENGTH_LIMIT)
    return NO_LENGTH_LIMIT


def max_length_before_loading(spec: str) -> int | None:
    """max_length_of the checkpoint `spec` (a path, hub id or embedded:<name>) read from its config alone: no weights
    are loaded and the embedded models are not built; None when the config cannot be read (loading then says why)."""
    if spec.startswith("embedded:"):
        # the embedded models' position limit is a constant of their build
        from embedded.build import MAX_LENGTH

        return MAX_LENGTH
    try:
        return max_length_of(AutoConfig.from_pretrained(spec, trust_remote_code=False))
    except (OSError, ValueError):
        return None


@functools.cache  # per tokenizer object: what it adds is fixed once it is loaded
def special_affixes(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text it encodes on its own (`tokenizer(text)`): BOS
    for Llama, Mistral and Gemma; [CLS] and [SEP] for BERT-style encoders; nothing for GPT-2 or Qwen."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return list(full[:k]), list(full[k + len(plain):])
    return [], []  # the special tokens change how the text itself encodes: none are added


def text_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], *, ending: bool) -> list[list[int]]:
    """Token ids of each text as the tokenizer encodes a text on its own, which is how models are trained on plain
    text: the special tokens it adds before the text (see `special_affixes`) and, with `ending`, those after it (a
    prompt goes on, so it gets none after). One a text already carries (decoded with its special tokens kept) is not
    added twice."""
    prefix, suffix = special_affixes(tokenizer)
    suffix = suffix if ending else []
    rows = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    return [(prefix if row[:len(prefix)] != prefix else []) + row
            + (suffix if row[len(row) - len(suffix):] != suffix else []) for row in rows]


def vocab_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """Fingerprint of the token -> id mapping, so two services can tell whether they share a tokenizer."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()
