"""Scalar-head models shared by the critic and reward servers (and the embedded default's builder).

Critic and reward model are both `AutoModelForSequenceClassification` checkpoints with `num_labels=1`:
a causal-LM body plus a linear `score` head, which `from_pretrained` loads as-is. The critic reads the
head at every position (values), the reward model at the last valid position (rewards).
"""

from __future__ import annotations

import hashlib
import json

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


def load_scalar_head_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a Hugging Face checkpoint with a one-output `score` head. A causal-LM checkpoint (e.g. the
    policy) gets a freshly initialised head, which is how a critic is initialised from the policy."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer stored beside a checkpoint."""
    return AutoTokenizer.from_pretrained(path)


def attention_mask_from_lengths(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """int64 [B] lengths -> int64 [B, S] mask, 1 on the first lengths[b] positions (right padding)."""
    return (torch.arange(seq_len, device=lengths.device)[None, :] < lengths[:, None]).long()


def per_token_scores(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Head output at every position: float32 [B, S]; entry t scores the prefix tokens[:, :t+1].
    Padding positions are zeroed. tokens int64 [B, S] right-padded, lengths int64 [B]."""
    mask = attention_mask_from_lengths(lengths, tokens.shape[1])
    body = getattr(model, model.base_model_prefix)
    hidden = body(input_ids=tokens, attention_mask=mask).last_hidden_state
    scores = model.score(hidden).squeeze(-1).float()
    return scores * mask


def last_token_scores(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """float [B, S] per-token scores -> float [B] at the last valid position lengths[b]-1."""
    return scores.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)


def max_length_of(model: PreTrainedModel) -> int:
    """Longest sequence the model's position embeddings allow."""
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise ValueError(f"cannot tell the maximum sequence length of {type(cfg).__name__}")


def vocab_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """Fingerprint of the token -> id mapping, so two services can tell whether they share a tokenizer."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()
