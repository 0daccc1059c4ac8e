"""Rollout generation behind a small interface; this module ships the PyTorch backend.

A backend turns prompts (token ids) into a `Rollout`: right-padded prompt+response token ids with their
lengths. The response includes the stop token (EOS counted in the response). The TensorRT-LLM backend
will implement the same `GenerationBackend` protocol, plus `update_weights` for refit.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
)
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from serving.modeling import CompileUnavailable, computing_in, pad_and_stack, require_compiler, right_pad
from serving.prepack import can_prepack, prepacked_linears

from .stop_strings import StopStringMatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    stop_token_ids: tuple[int, ...] = ()  # EOS plus any extra stop tokens
    stop_strings: tuple[str, ...] = ()  # a row stops once its decoded response contains one (needs the tokenizer)


@dataclass
class Rollout:
    """tokens int64 [B, S] right-padded prompt+response; lengths, prompt_lengths int64 [B];
    ended bool [B]: the response finished with a stop token (not truncated by max_new_tokens)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    ended: torch.Tensor
    # float32 [B, S-1]: the generation engine's log-prob of each response action (0 elsewhere), the
    # behaviour policy of importance-sampling correction when the engine is not the trained policy
    logprobs: torch.Tensor | None = None
    # float32 [B, S-1]: 1 on the actions the policy sampled, where the response interleaves other tokens (a
    # multi-turn episode's observations); None: every response action is the policy's
    policy_mask: torch.Tensor | None = None
    # float32 [B]: rewards that came with the rollout (an environment's); None: a reward source scores it
    rewards: torch.Tensor | None = None

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.lengths - self.prompt_lengths

    def action_mask(self) -> torch.Tensor:
        """float32 [B, S-1]: 1 on actions that produced response tokens the policy sampled (action t produces
        token t+1); observation tokens of a multi-turn episode are 0."""
        if self.policy_mask is not None:
            return self.policy_mask
        t = torch.arange(self.tokens.shape[1] - 1)[None, :]
        return ((t >= self.prompt_lengths[:, None] - 1) & (t < self.lengths[:, None] - 1)).float()


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Stack micro-batch rollouts of different widths into one batch."""
    def stack(xs: list[torch.Tensor | None]) -> torch.Tensor | None:
        return pad_and_stack(xs) if all(x is not None for x in xs) else None

    rewards = [p.rewards for p in parts]
    return Rollout(pad_and_stack([p.tokens for p in parts], pad_id), torch.cat([p.lengths for p in parts]),
                   torch.cat([p.prompt_lengths for p in parts]), torch.cat([p.ended for p in parts]),
                   stack([p.logprobs for p in parts]), stack([p.policy_mask for p in parts]),
                   torch.cat(rewards) if all(x is not None for x in rewards) else None)


def select_rows(r: Rollout, index: torch.Tensor) -> Rollout:
    """The rows `index` (int64 [K]) of a rollout, trimmed to their longest row."""
    lengths = r.lengths[index]
    width = int(lengths.max()) if len(index) else 1
    return Rollout(r.tokens[index, :width], lengths, r.prompt_lengths[index], r.ended[index],
                   None if r.logprobs is None else r.logprobs[index, :width - 1],
                   None if r.policy_mask is None else r.policy_mask[index, :width - 1],
                   None if r.rewards is None else r.rewards[index])


class GenerationBackend(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Rollout:
        """Sample one response per prompt."""
        ...

    def update_weights(self, model: PreTrainedModel) -> None:
        """Make the next generate() use the policy's current weights (refit)."""
        ...


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None) -> tuple[int, ...]:
    """The tokens that end a response, as `generate()` would stop: the tokenizer's EOS and every `eos_token_id` of
    the model's generation config (chat models list their end-of-turn tokens there, e.g. Llama 3's <|eot_id|>)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    configured = None if generation_config is None else generation_config.eos_token_id
    ids += [configured] if isinstance(configured, int) else list(configured or [])
    return tuple(dict.fromkeys(int(i) for i in ids))


class PreallocatedLayer(DynamicLayer):
    """One full-attention layer's KV cache in buffers allocated once, [batch, kv_heads, max_cache_len, head_dim].

    `update` writes the new states in place and returns views of the filled prefix, so attention reads exactly the
    tokens seen so far (as with `DynamicLayer`, same mask sizes) without re-copying the whole cache every step the way
    `DynamicLayer`'s `torch.cat` does. `batch_select_indices` keeps a subset of rows in new buffers of that many rows
    (only the filled prefix is copied)."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.length = 0
        self._keys: torch.Tensor | None = None  # the buffers; `keys` and `values` are views of their filled prefix
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b = key_states.shape[0]
        self._keys = key_states.new_empty((b, key_states.shape[1], self.max_cache_len, key_states.shape[-1]))
        self._values = value_states.new_empty((b, value_states.shape[1], self.max_cache_len, value_states.shape[-1]))
        self.length = 0
        self.is_initialized = True
        self._set_views()

    def _set_views(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.max_cache_len:
            raise ValueError(f"PreallocatedLayer holds {self.max_cache_len} tokens; {end} asked")
        if torch.compiler.is_compiling():
            # index_copy_ into the whole buffer: a compiled decode step writes it in place, where a copy into a slice
            # view of its input it would write back whole
            where = torch.arange(self.length, end, device=self._keys.device)
            self._keys.index_copy_(2, where, key_states)
            self._values.index_copy_(2, where, value_states)
        else:  # eager, a copy into the slice: the faster write on the CPU (python -m bench.kv_cache)
            self._keys[:, :, self.length:end].copy_(key_states)
            self._values[:, :, self.length:end].copy_(value_states)
        self.length = end
        self._set_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._set_views()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if self.is_initialized:
            self.length = max(self.length + tokens_to_remove, 0)
            self._set_views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (any order, at most the current batch size) as rows 0..len(indices)-1."""
        if not self.is_initialized:
            return
        n = indices.numel()
        if n > self._keys.shape[0]:
            raise ValueError("PreallocatedLayer cannot grow its batch")
        kept_k, kept_v = self.keys.index_select(0, indices), self.values.index_select(0, indices)
        # fresh buffers, not views of the old ones' first rows: a compiled decode step takes them as whole inputs
        self._keys = self._keys.new_empty((n, *self._keys.shape[1:]))
        self._values = self._values.new_empty((n, *self._values.shape[1:]))
        self._keys[:, :, : self.length].copy_(kept_k)
        self._values[:, :, : self.length].copy_(kept_v)
        self._set_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PreallocatedLayer cannot grow its batch")


class PreallocatedCache(Cache):
    """A `Cache` of `PreallocatedLayer`s, one per decoder layer, each holding up to `max_cache_len` tokens.

    `sliding_windows[i]` marks layer i as a sliding-window (or chunked) attention layer whose window is longer than
    `max_cache_len`, so it never slides here: it keeps every token like a full layer and says it is sliding, so the
    model builds that layer's mask (plain causal within the window) from it."""

    def __init__(self, max_cache_len: int, sliding_windows: list[int | None]):
        super().__init__(layers=never_sliding_layers(PreallocatedLayer, max_cache_len, sliding_windows))


def never_sliding_layers(layer_class: type[CacheLayerMixin], max_cache_len: int,
                         sliding_windows: list[int | None]) -> list[CacheLayerMixin]:
    """One `layer_class(max_cache_len)` per decoder layer; where `sliding_windows[i]` is a window (longer than
    `max_cache_len`, so it never slides here) layer i says it is sliding, with that window, so that the model builds
    its mask (plain causal within the window) from it."""
    layers = []
    for window in sliding_windows:
        layer = layer_class(max_cache_len)
        if window is not None:
            if window <= max_cache_len:
                raise ValueError(f"a sliding window of {window} would slide within {max_cache_len} tokens")
            layer.is_sliding, layer.sliding_window = True, window
        layers.append(layer)
    return layers


class _StaticLayer(StaticLayer):
    """transformers' `StaticLayer` with the values' buffer in the values' own dtype: under autocast a model can hand
    the cache float32 keys (rotary embeddings computed in float32) and bfloat16 values."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.values.dtype != value_states.dtype:
            self.values = self.values.to(value_states.dtype)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.values)


class StaticShapeCache(Cache):
    """A `Cache` of transformers' `StaticLayer`s: every decode step attends over the whole buffer of `max_cache_len`
    positions (the causal mask hides those not yet written) and writes at a position held in a device tensor, so each
    step has the same shapes and reads no position from the host: a CUDA graph of the step can be replayed. It costs
    attention over the unwritten positions too (nothing on a launch-bound GPU step, a real cost on a CPU) and keeps
    finished rows in the batch (no compaction). Reused, with `reset`, for every generation of the same batch and
    length, so its buffers keep their addresses from one generation to the next. Sliding windows as in
    `PreallocatedCache` (longer than `max_cache_len`, so they never slide)."""

    def __init__(self, max_cache_len: int, sliding_windows: list[int | None]):
        super().__init__(layers=never_sliding_layers(_StaticLayer, max_cache_len, sliding_windows))
        self.max_cache_len = max_cache_len

    def filled(self) -> list[int]:
        """Positions written so far, per layer (a host sync)."""
        return [int(layer.get_seq_length()) for layer in self.layers]


def cache_layer_windows(model: PreTrainedModel, max_cache_len: int) -> list[int | None] | None:
    """Per decoder layer, None for full attention or the window of a sliding-window layer whose window is longer than
    `max_cache_len`; None where transformers' `DynamicCache` for `model` has other layers (a window that slides,
    linear attention, KV sharing...) or none."""
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return None
    try:
        probe = DynamicCache(config=model.config)
    except (AttributeError, KeyError, TypeError, ValueError):  # an exotic config: the DynamicCache path deals with it
        return None
    windows: list[int | None] = []
    for layer in probe.layers:
        if type(layer) is DynamicLayer:
            windows.append(None)
        elif type(layer) is DynamicSlidingWindowLayer and layer.sliding_window > max_cache_len:
            windows.append(layer.sliding_window)
        else:
            return None
    return windows or None


def preallocated_cache_for(model: PreTrainedModel, max_cache_len: int) -> PreallocatedCache | None:
    """A `PreallocatedCache` for `model`, or None where transformers' `DynamicCache` for it has layers other than full
    attention and sliding windows longer than `max_cache_len` (a window that slides, linear attention, KV sharing...)."""
    windows = cache_layer_windows(model, max_cache_len)
    return PreallocatedCache(max_cache_len, windows) if windows else None


class _CacheNotUsed(Exception):
    """The model cannot run on the pre-allocated cache (it failed on it, or did not fill it)."""


@dataclass
class GenerationStats:
    """What the last `generate` did: the cache it used, decode forwards run, how often finished rows were dropped,
    and the rows computed summed over decode forwards (the batch's work)."""

    cache: str = ""
    decode_steps: int = 0
    compiled_steps: int = 0  # decode forwards run by the compiled step
    compactions: int = 0
    row_steps: int = 0

    def add(self, other: GenerationStats) -> None:
        for name in GENERATION_COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


# The counted fields of GenerationStats, reported per step as generation/<name> and summed on the actor's /metrics
# as ppo_actor_generation_<name>_total, with what each counts.
GENERATION_COUNTS = {
    "decode_steps": "Decode forwards the PyTorch generation backend ran",
    "compiled_steps": "Decode forwards run by the compiled decode step",
    "compactions": "Times finished rows were dropped from the generation batch",
    "row_steps": "Rows computed, summed over decode forwards",
}


class GenerationCounts:
    """Per-step `generation/*` metrics: what a backend ran since the last report, from its running `totals`
    (backends without them, such as TensorRT-LLM's, report none)."""

    def __init__(self, backend: GenerationBackend):
        self.backend = backend
        self.seen = GenerationStats()

    def metrics(self) -> dict[str, float]:
        totals = getattr(self.backend, "totals", None)
        if totals is None:
            return {}
        now = dataclasses.replace(totals)
        counts = {f"generation/{name}": float(getattr(now, name) - getattr(self.seen, name))
                  for name in GENERATION_COUNTS}
        self.seen = now
        return counts


def cudagraphs_checked(fn: Callable, key: str) -> Callable:
    """`fn` (compiled with mode="reduce-overhead"), warning once if its first call, where inductor compiles it and
    decides, ran it without recording CUDA graphs (a CPU tensor among its inputs, an op a graph cannot capture ...):
    it then runs compiled but launch by launch, and the log says so instead of leaving `key` looking in force."""
    from torch._dynamo.utils import counters

    first = True

    def call(*args):
        nonlocal first
        if not first:
            return fn(*args)
        skips = counters["inductor"]["cudagraph_skips"]
        out = fn(*args)
        first = False
        if counters["inductor"]["cudagraph_skips"] > skips:
            log.warning("%s: inductor compiled the decode step but recorded no CUDA graph for it, so it runs without "
                        "them (TORCH_LOGS=perf_hints logs why)", key)
        return out

    return call


def first_call_logged(fn: Callable, what: str) -> Callable:
    """`fn`, logging how long its first call took: a compiled function compiles then, and a run pauses for it."""
    first = True

    def call(*args):
        nonlocal first
        if not first:
            return fn(*args)
        started = time.perf_counter()
        out = fn(*args)
        first = False
        log.info("%s in %.1f s", what, time.perf_counter() - started)
        return out

    return call


class TorchGenerationBackend:
    """Batched sampling with a KV cache on the training policy itself (no copy, so no refit needed).

    Prompts are left-padded so every row's next token sits in the same cache column. The KV cache is pre-allocated
    for prompt + max_new_tokens (`PreallocatedCache`: written in place, attention over the filled prefix only); models
    whose cache layers are not plain full attention, or that do not fill the cache they are given, fall back
    automatically to transformers' `DynamicCache` (`kv_cache="dynamic"` forces it). `kv_cache="static"` decodes on
    `StaticShapeCache` instead (every step the same shapes, finished rows kept in the batch), which `cuda_graphs`
    (on a CUDA device) replays as CUDA graphs of the compiled decode step. The attention mask is allocated
    once and sliced; the prefill computes logits for the last position only. On a CPU in float32 (`prepack`, the
    default), the linear layers compute through weights prepacked for oneDNN for the length of each generation
    (`serving.prepack`).

    Finished rows leave the batch: when the rows still running drop below `compact_below` of the rows in the batch,
    the batch is compacted (cache rows, positions, mask, sampled history); until then finished rows ride along and
    their samples are discarded. `compact_below=0` never compacts, 1 compacts as soon as any row finishes. The one
    host sync per decode step is the count of finished rows (none without stop tokens). Stop strings
    (`SamplingParams.stop_strings`, with the `tokenizer`) decode a window of each running row's newest tokens every
    step (`StopStringMatcher`); without them nothing is decoded. With the `tokenizer`, a model whose output has more
    rows than the tokenizer has ids (padded, as Qwen's and Pythia's are) samples only ids the tokenizer has; the
    recorded log-probs stay the full model's, as the policy's own pass computes them.

    With a fixed seed the output is deterministic; rows share one random stream, so a row's sample depends on the
    batch it is in (as before).
    """

    def __init__(self, model: PreTrainedModel, pad_id: int, device: torch.device, *, kv_cache: str = "auto",
                 compact_below: float = 0.75, tokenizer: PreTrainedTokenizerBase | None = None,
                 compile_decode: bool = False, compute_dtype: torch.dtype = torch.float32, prepack: bool = True,
                 cuda_graphs: bool = False):
        if kv_cache not in ("auto", "dynamic", "static"):
            raise ValueError(f"kv_cache must be 'auto', 'dynamic' or 'static', got {kv_cache!r}")
        if cuda_graphs:  # CUDA graphs replay fixed shapes and addresses: the static-shape cache, compiled
            if device.type != "cuda":
                raise CompileUnavailable(f"policy.generation.cuda_graphs=true: CUDA graphs need a CUDA device, and the "
                                         f"policy is on {device} (policy.device); or set policy.generation.cuda_graphs=false")
            kv_cache, compile_decode = "static", True
        if not 0.0 <= compact_below <= 1.0:
            raise ValueError("compact_below must be in [0, 1]")
        self.model = model
        self.pad_id = pad_id
        self.device = device
        self.kv_cache = kv_cache
        self.compact_below = compact_below
        self.tokenizer = tokenizer  # decodes the newest tokens when stop strings are set
        # ids past the tokenizer's (a model's output padded past its vocabulary, as Qwen's and Pythia's are) are never
        # sampled: no tokenizer, reward server or stop string could read them
        self.sampled_ids = decodable_ids(tokenizer) if tokenizer is not None else None
        # other than float32: every forward under torch.autocast in this dtype (mixed precision; the cache holds it)
        self.compute_dtype = compute_dtype
        # on a CPU in float32: the linear layers through weights prepacked for oneDNN during each generation
        # (serving.prepack; the policy's weights change between generations, never within one)
        self.prepack = prepack and can_prepack(device, compute_dtype)
        # the decode step through torch.compile on the pre-allocated cache, for batches of 2 rows or more (dynamo
        # compiles a dimension of size 1 apart: a lone row runs eager); prefill and DynamicCache stay eager
        # cuda_graphs: compiled with mode="reduce-overhead" (inductor's CUDA graph trees: one graph recorded per batch
        # size and cache length, replayed as one launch) on the static-shape cache (StaticShapeCache), reused across
        # generations of the same shape so that its buffers keep their addresses
        self.cuda_graphs = cuda_graphs
        self.compiled_step = None
        if compile_decode:
            require_compiler("policy.generation.cuda_graphs" if cuda_graphs else "policy.generation.compile", device)
            what = ("policy.generation.cuda_graphs=true: decode step compiled and its CUDA graph recorded" if cuda_graphs
                    else "policy.generation.compile=true: decode step compiled")
            step = torch.compile(decode_step, dynamic=True, mode="reduce-overhead" if cuda_graphs else None)
            if cuda_graphs:
                step = cudagraphs_checked(step, "policy.generation.cuda_graphs=true")
            self.compiled_step = first_call_logged(step, what)
        self._static_cache: tuple[tuple, StaticShapeCache] | None = None  # the last one, by (model, batch, length)
        self.last_stats = GenerationStats()
        self.totals = GenerationStats()  # summed over every generate call (GenerationCounts reports them per step)
        self._no_preallocated: set[type] = set()  # model classes that failed on the pre-allocated cache

    def update_weights(self, model: PreTrainedModel) -> None:
        self.model = model

    # The warm-up's sizes: batch, prompt and new tokens unlike each other and unlike common head counts and sizes, so
    # that dynamo's duck sizing (one symbol for equal sizes) ties none of them to another dimension of the graph.
    WARM_UP_SHAPE = (7, 17, 2)

    def warm_up(self) -> float:
        """With the compiled decode step, compile it now (a short generation from dummy prompts) so the first rollout
        does not pause for it; returns the seconds it took (0 without compile_decode). Its work is left out of
        `last_stats` and `totals`, and it draws from a generator of its own, so the run's samples are as without it."""
        if self.compiled_step is None:
            return 0.0
        rows, width, new = self.WARM_UP_SHAPE
        last, totals = self.last_stats, dataclasses.replace(self.totals)
        started = time.perf_counter()
        self.generate([[self.pad_id] * width] * rows, SamplingParams(max_new_tokens=new), seed=0)
        self.last_stats, self.totals = last, totals
        return time.perf_counter() - started

    @torch.no_grad()  # not inference_mode: the tokens feed autograd-tracked passes later
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Rollout:
        """Sample one response per prompt; what it took is in `last_stats`."""
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer: TorchGenerationBackend(..., tokenizer=...)")
        b = len(prompts)
        widths = torch.tensor([len(p) for p in prompts])
        p_max = int(widths.max())
        # Left-pad for decoding so every row's next token sits in the same column.
        ids = torch.full((b, p_max), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, p_max), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, p_max - len(p):] = torch.tensor(p)
            attn[i, p_max - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)

        was_training = self.model.training
        self.model.eval()
        try:
            packed = prepacked_linears(self.model, b, enabled=self.prepack)
            with computing_in(self.device, self.compute_dtype), packed:
                cache = None
                if self.kv_cache == "static" and type(self.model) not in self._no_preallocated:
                    cache = self._static_cache_for(b, p_max + params.max_new_tokens)
                elif self.kv_cache == "auto" and type(self.model) not in self._no_preallocated:
                    cache = preallocated_cache_for(self.model, p_max + params.max_new_tokens)
                out = None
                if cache is not None:
                    try:
                        out = self._decode(ids, attn, params, seed, cache)
                    except _CacheNotUsed as e:
                        self._no_preallocated.add(type(self.model))
                        self._static_cache = None
                        log.warning("%s cannot use the pre-allocated KV cache (%s); generating with DynamicCache",
                                    type(self.model).__name__, e.__cause__ or "the cache was not filled")
                if out is None:
                    try:
                        cache = DynamicCache(config=self.model.config)
                    except (AttributeError, KeyError, TypeError, ValueError):
                        cache = DynamicCache()
                    out = self._decode(ids, attn, params, seed, cache)
        finally:
            self.model.train(was_training)

        out, out_lp, string_end = out
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long)
        is_stop = torch.isin(out, stops)
        done = is_stop.any(1)
        resp_len = torch.where(done, is_stop.int().argmax(1) + 1, params.max_new_tokens)
        by_string = string_end > 0  # the response ends right after the token that completed a stop string
        resp_len = torch.where(by_string, torch.minimum(resp_len, string_end), resp_len)
        done = done | by_string
        rows = [list(p) + out[i, : int(resp_len[i])].tolist() for i, p in enumerate(prompts)]
        tokens, lengths = right_pad(rows, self.pad_id)
        logprobs = torch.zeros((b, tokens.shape[1] - 1), dtype=torch.float32)
        for i, p in enumerate(prompts):  # action t produced token t + 1: the response starts at action len(p) - 1
            n = int(resp_len[i])
            logprobs[i, len(p) - 1: len(p) - 1 + n] = out_lp[i, :n]
        return Rollout(tokens, lengths, widths.clone(), done, logprobs)

    # The static-shape cache's length is rounded up to a multiple of this, so that prompts of slightly different
    # lengths share one cache (and one CUDA graph)
    STATIC_LENGTH_MULTIPLE = 64

    def _static_cache_for(self, batch: int, length: int) -> StaticShapeCache | None:
        """The static-shape cache for `batch` rows of up to `length` tokens: the last one, reset, if it has that batch
        and room for them (the same buffers, so a recorded CUDA graph replays on them), else a new one."""
        m = self.STATIC_LENGTH_MULTIPLE
        key = (id(self.model), batch, -(-length // m) * m)
        if self._static_cache is not None and self._static_cache[0] == key:
            cache = self._static_cache[1]
            cache.reset()
            return cache
        self._static_cache = None  # the old buffers go before the new ones are made
        windows = cache_layer_windows(self.model, length)
        if windows is None:
            return None
        if any(w is not None and w <= key[2] for w in windows):  # rounded up, a window would slide: not rounded
            key = (*key[:2], length)
        cache = StaticShapeCache(key[2], windows)
        self._static_cache = (key, cache)
        return cache

    def _decode(self, ids: torch.Tensor, attn: torch.Tensor, params: SamplingParams, seed: int,
                cache: Cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample up to max_new_tokens per row into (tokens int64 [B, N], log-probs float32 [B, N], stop-string
        ends int64 [B]: the response length where a stop string ended it, else 0) on the CPU; after a row's stop
        token or stop string its tokens are pad."""
        model, dev, pad, n_new = self.model, self.device, self.pad_id, params.max_new_tokens
        b, p_max = ids.shape
        kind = {PreallocatedCache: "preallocated", StaticShapeCache: "static"}.get(type(cache), "dynamic")
        stats = GenerationStats(cache=kind)
        warpers = _warpers(params)
        stops = torch.tensor(params.stop_token_ids, device=dev, dtype=torch.long)
        matcher = StopStringMatcher(self.tokenizer, params.stop_strings) if params.stop_strings else None
        gen = torch.Generator(device=dev).manual_seed(seed)
        keep_last = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
        compact = self.compact_below > 0 and all(type(layer) in _SELECTABLE_LAYERS for layer in cache.layers)

        static = isinstance(cache, StaticShapeCache)  # the mask covers the whole cache, every step the same shape
        mask = torch.ones((b, cache.max_cache_len if static else p_max + n_new), dtype=attn.dtype, device=dev)
        mask[:, :p_max] = attn  # sliced to the cache length every step, unless static
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        prefill = dict(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache, use_cache=True,
                       **keep_last)
        if isinstance(cache, PreallocatedCache | StaticShapeCache):
            try:
                logits = model(**prefill).logits[:, -1, :]
            except Exception as e:  # retried on DynamicCache, where an error not due to the cache recurs
                raise _CacheNotUsed from e
            filled = cache.filled() if static else [layer.length for layer in cache.layers]
            if any(n != p_max for n in filled):
                raise _CacheNotUsed
        else:
            logits = model(**prefill).logits[:, -1, :]
        pos = positions[:, -1:] + 1

        out = torch.full((b, n_new), pad, dtype=torch.long, device=dev)  # by prompt row
        out_lp = torch.zeros((b, n_new), dtype=torch.float32, device=dev)
        ends = torch.zeros(b, dtype=torch.long, device=dev)  # stop-string ends, by prompt row
        # By batch slot: the row each slot holds, its samples so far (the warpers' input ids), whether it finished.
        rows = torch.arange(b, device=dev)
        hist = torch.full((b, n_new), pad, dtype=torch.long, device=dev)
        hist_lp = torch.zeros((b, n_new), dtype=torch.float32, device=dev)
        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        string_end = torch.zeros(b, dtype=torch.long, device=dev)  # by batch slot, like `finished`
        limit = self.sampled_ids if self.sampled_ids is not None and self.sampled_ids < logits.shape[-1] else None
        if limit is not None:
            log_once(f"the policy scores {logits.shape[-1]} ids and its tokenizer has {limit}: the ids past the "
                     "tokenizer's are never sampled")
        for t in range(n_new):
            logits = logits.float()
            sampled = logits if limit is None else logits[:, :limit]
            if params.temperature == 0:
                nxt = sampled.argmax(-1)
            else:
                scores = sampled
                for w in warpers:
                    scores = w(hist[:, :t], scores)
                nxt = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen).squeeze(1)
            nxt = nxt.masked_fill(finished, pad)
            hist[:, t] = nxt
            hist_lp[:, t] = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1)
            if matcher is not None:  # before the length check: the last token may complete a stop string too
                hit = matcher.completed(hist, t, finished)
                string_end = torch.where(hit, t + 1, string_end)
                finished |= hit
            if t + 1 == n_new:
                break
            n = nxt.shape[0]
            if len(stops) or matcher is not None:
                if len(stops):
                    finished |= torch.isin(nxt, stops)
                running = n - int(finished.sum())  # the step's one host sync
                if running == 0:
                    break
                if compact and running < self.compact_below * n:
                    out.index_copy_(0, rows, hist)
                    out_lp.index_copy_(0, rows, hist_lp)
                    keep = (~finished).nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    ends.index_copy_(0, rows, string_end)
                    rows, hist, hist_lp, mask, pos, nxt = (x[keep] for x in (rows, hist, hist_lp, mask, pos, nxt))
                    finished, string_end = finished[keep], string_end[keep]
                    stats.compactions += 1
            step = decode_step
            if self.compiled_step is not None and isinstance(cache, PreallocatedCache | StaticShapeCache) \
                    and nxt.shape[0] > 1:
                step = self.compiled_step
                stats.compiled_steps += 1
                if self.cuda_graphs:  # a new step: the last replay's outputs (logits, used above) may be overwritten
                    torch.compiler.cudagraph_mark_step_begin()
            logits = step(model, nxt[:, None], mask if static else mask[:, : p_max + t + 1], pos, cache, bool(keep_last))
            pos = pos + 1
            stats.decode_steps += 1
            stats.row_steps += nxt.shape[0]
        out.index_copy_(0, rows, hist)
        out_lp.index_copy_(0, rows, hist_lp)
        ends.index_copy_(0, rows, string_end)
        self.last_stats = stats
        self.totals.add(stats)
        return out.cpu(), out_lp.cpu(), ends.cpu()


def decode_step(model: PreTrainedModel, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: Cache, keep_last: bool) -> torch.Tensor:
    """One decode forward: the next token's logits [B, V] for tokens [B, 1] at `positions` [B, 1], attending to the
    cache under `mask` [B, cache length + 1]."""
    kwargs = {"logits_to_keep": 1} if keep_last else {}
    return model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                 **kwargs).logits[:, -1, :]


# Cache layers whose `batch_select_indices` keeps all their per-row state (linear-attention layers, for one, do not).
_SELECTABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, PreallocatedLayer)


def decodable_ids(tokenizer: PreTrainedTokenizerBase) -> int:
    """One past the largest id the tokenizer maps to a token (added tokens included)."""
    return max(tokenizer.get_vocab().values()) + 1


@functools.cache
def log_once(message: str) -> None:
    log.info(message)


def _warpers(params: SamplingParams) -> LogitsProcessorList:
    warpers = LogitsProcessorList()
    if params.temperature > 0 and params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


def _takes_logits_to_keep(model: PreTrainedModel) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
