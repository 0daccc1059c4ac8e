"""Rollout generation behind a small interface; this module ships the PyTorch backend.

A backend turns prompts (token ids) into a `Rollout`: right-padded prompt+response token ids with their
lengths. The response includes the stop token (EOS counted in the response). The TensorRT-LLM backend
will implement the same `GenerationBackend` protocol, plus `update_weights` for refit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from serving.modeling import pad_and_stack, right_pad


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    stop_token_ids: tuple[int, ...] = ()  # EOS plus any extra stop tokens


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

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.lengths - self.prompt_lengths

    def action_mask(self) -> torch.Tensor:
        """float32 [B, S-1]: 1 on actions that produced response tokens (action t produces token t+1)."""
        t = torch.arange(self.tokens.shape[1] - 1)[None, :]
        return ((t >= self.prompt_lengths[:, None] - 1) & (t < self.lengths[:, None] - 1)).float()


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Stack micro-batch rollouts of different widths into one batch."""
    logprobs = None
    if all(p.logprobs is not None for p in parts):
        logprobs = pad_and_stack([p.logprobs for p in parts])
    return Rollout(pad_and_stack([p.tokens for p in parts], pad_id), torch.cat([p.lengths for p in parts]),
                   torch.cat([p.prompt_lengths for p in parts]), torch.cat([p.ended for p in parts]), logprobs)


def select_rows(r: Rollout, index: torch.Tensor) -> Rollout:
    """The rows `index` (int64 [K]) of a rollout, trimmed to their longest row."""
    lengths = r.lengths[index]
    width = int(lengths.max()) if len(index) else 1
    return Rollout(r.tokens[index, :width], lengths, r.prompt_lengths[index], r.ended[index],
                   None if r.logprobs is None else r.logprobs[index, :width - 1])


class GenerationBackend(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Rollout:
        """Sample one response per prompt."""
        ...

    def update_weights(self, model: PreTrainedModel) -> None:
        """Make the next generate() use the policy's current weights (refit)."""
        ...


class TorchGenerationBackend:
    """Batched sampling with a KV cache on the training policy itself (no copy, so no refit needed)."""

    def __init__(self, model: PreTrainedModel, pad_id: int, device: torch.device):
        self.model = model
        self.pad_id = pad_id
        self.device = device

    def update_weights(self, model: PreTrainedModel) -> None:
        self.model = model

    @torch.no_grad()  # not inference_mode: the tokens feed autograd-tracked passes later
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Rollout:
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
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
        warpers = LogitsProcessorList()
        if params.temperature > 0 and params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        stops = torch.tensor(params.stop_token_ids, device=self.device, dtype=torch.long)
        gen = torch.Generator(device=self.device).manual_seed(seed)

        was_training = self.model.training
        self.model.eval()
        cache = DynamicCache()
        out = torch.full((b, params.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        out_lp = torch.zeros((b, params.max_new_tokens), dtype=torch.float32, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        resp_len = torch.full((b,), params.max_new_tokens, dtype=torch.long, device=self.device)
        step_ids, positions = ids, (attn.cumsum(1) - 1).clamp(min=0)
        for t in range(params.max_new_tokens):
            logits = self.model(input_ids=step_ids, attention_mask=attn, position_ids=positions,
                                past_key_values=cache, use_cache=True).logits[:, -1, :].float()
            if params.temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(warpers(out[:, :t], logits), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            out[:, t] = nxt
            out_lp[:, t] = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1)
            hit = torch.isin(nxt, stops) & ~done
            resp_len = torch.where(hit, torch.full_like(resp_len, t + 1), resp_len)
            done |= hit
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            positions = positions[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype, device=self.device)], dim=1)
        self.model.train(was_training)

        out, out_lp, resp_len, done = out.cpu(), out_lp.cpu(), resp_len.cpu(), done.cpu()
        rows = [list(p) + out[i, : int(resp_len[i])].tolist() for i, p in enumerate(prompts)]
        tokens, lengths = right_pad(rows, self.pad_id)
        logprobs = torch.zeros((b, tokens.shape[1] - 1), dtype=torch.float32)
        for i, p in enumerate(prompts):  # action t produced token t + 1: the response starts at action len(p) - 1
            n = int(resp_len[i])
            logprobs[i, len(p) - 1: len(p) - 1 + n] = out_lp[i, :n]
        return Rollout(tokens, lengths, widths.clone(), done, logprobs)
