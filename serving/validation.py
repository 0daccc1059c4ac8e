"""Request validation both servers share: every failure is an InvalidArgument naming the field and what
was expected, raised before any work is queued, so a bad request never reaches the model."""

from __future__ import annotations

import torch

from .errors import InvalidArgument
from .modeling import NO_LENGTH_LIMIT


def check_tokens(tokens: torch.Tensor, field: str, vocab_size: int, max_length: int, max_rows: int) -> None:
    """tokens must be a non-empty integer [B, S] tensor with S <= max_length, and no more tokens than `max_rows` rows
    of max_length (`max_request_rows`; shorter rows fit in proportion; with no length limit, at most max_rows rows).
    The receive limit alone does not hold a request to it: it counts bytes for the widest encoding of a token, and
    uint8 ids are a 32nd of that. The ids themselves are checked by `token_ids`, against the rows' lengths."""
    if tokens.dim() != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise InvalidArgument(f"{field}: expected a non-empty [batch, seq_len] tensor, got shape {list(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise InvalidArgument(f"{field}: expected integer token ids (DTYPE_INT64), got {tokens.dtype}")
    rows, width = tokens.shape
    if width > max_length:
        raise InvalidArgument(f"{field}: sequence length {width} exceeds the model's max length {max_length}")
    if max_length >= NO_LENGTH_LIMIT and rows > max_rows:
        raise InvalidArgument(f"{field}: {rows} rows, more than one request may carry (max_request_rows {max_rows})")
    if max_length < NO_LENGTH_LIMIT and rows * width > max_rows * max_length:
        raise InvalidArgument(f"{field}: {rows} x {width} = {rows * width} tokens, more than one request may carry "
                              f"(max_request_rows {max_rows} rows of the model's max length {max_length})")


def token_ids(tokens: torch.Tensor, lengths: torch.Tensor, field: str, vocab_size: int) -> torch.Tensor:
    """`tokens` (checked by check_tokens) as int64, once every id at a position before its row's length lies in
    [0, vocab_size) (else InvalidArgument); positions at or past lengths[b] are padding, ignored whatever they hold
    (-1 and -100 are common), and come back as 0 so that no forward pass looks them up."""
    tokens = tokens.long()
    valid = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    bad = valid & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        row, position = (int(i) for i in bad.nonzero()[0])
        kept = tokens[valid]
        raise InvalidArgument(f"{field}: token ids before each row's length must lie in [0, {vocab_size}), got "
                              f"{field}[{row}, {position}] = {int(tokens[row, position])} (range [{int(kept.min())}, "
                              f"{int(kept.max())}]; positions at or past lengths[b] are padding, and may hold any id)")
    return torch.where(valid, tokens, torch.zeros((), dtype=torch.long))


def check_int_vector(t: torch.Tensor, field: str, batch: int) -> None:
    """t must be an integer tensor of shape [batch]."""
    if t.shape != (batch,) or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise InvalidArgument(f"{field}: expected integer shape [{batch}], got {t.dtype} {list(t.shape)}")


def check_lengths(lengths: torch.Tensor, field: str, batch: int, seq_len: int) -> None:
    """lengths must be an integer [B] tensor with 1 <= lengths[b] <= S."""
    check_int_vector(lengths, field, batch)
    if int(lengths.min()) < 1 or int(lengths.max()) > seq_len:
        raise InvalidArgument(f"{field}: every length must lie in [1, {seq_len}], got [{int(lengths.min())}, {int(lengths.max())}]")


def check_per_action(t: torch.Tensor, field: str, shape: tuple[int, int], allow_bool: bool = False) -> torch.Tensor:
    """A finite float [B, S-1] tensor (bool too if allow_bool); returned as float32."""
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{field}: expected shape {list(shape)}, got {list(t.shape)}")
    if not (t.dtype.is_floating_point or (allow_bool and t.dtype == torch.bool)):
        raise InvalidArgument(f"{field}: expected a float tensor{' or bool' if allow_bool else ''}, got {t.dtype}")
    if not torch.isfinite(t).all():
        raise InvalidArgument(f"{field}: contains NaN or infinity")
    t = t.float()
    if not torch.isfinite(t).all():  # finite in float64, past float32's range
        raise InvalidArgument(f"{field}: contains values beyond float32's range (|x| > 3.4e38), which the critic "
                              "computes in")
    return t
