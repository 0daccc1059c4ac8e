"""Tensor codec: torch.Tensor <-> ppo_services.v1.Tensor (raw little-endian bytes + dtype + shape)."""

from __future__ import annotations

import math
import sys

import torch

from ppo_services.v1 import common_pb2

from .errors import InvalidArgument

DTYPES: dict[int, torch.dtype] = {
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_FLOAT64: torch.float64,
    common_pb2.DTYPE_INT64: torch.int64,
    common_pb2.DTYPE_INT32: torch.int32,
    common_pb2.DTYPE_INT16: torch.int16,
    common_pb2.DTYPE_INT8: torch.int8,
    common_pb2.DTYPE_UINT8: torch.uint8,
    common_pb2.DTYPE_BOOL: torch.bool,
}
_WIRE = {v: k for k, v in DTYPES.items()}
_BIG_ENDIAN = sys.byteorder == "big"


def encode(t: torch.Tensor) -> common_pb2.Tensor:
    """Serialize a CPU or GPU tensor of a supported dtype (copied to CPU, made contiguous)."""
    if t.dtype not in _WIRE:
        raise TypeError(f"unsupported dtype {t.dtype}; supported: {sorted(str(d) for d in _WIRE)}")
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
    if _BIG_ENDIAN and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size()).flip(1)
    return common_pb2.Tensor(dtype=_WIRE[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def shape_text(shape: list[int]) -> str:
    """A shape for an error message: in full up to 8 dimensions, else its start and the count."""
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...] ({len(shape)} dimensions)"


def decode(msg: common_pb2.Tensor, field: str) -> torch.Tensor:
    """Deserialize; raises InvalidArgument naming `field` when dtype, shape or byte count are wrong."""
    if msg.dtype not in DTYPES:
        allowed = ", ".join(common_pb2.DType.Name(k) for k in DTYPES)
        raise InvalidArgument(f"{field}: dtype {msg.dtype} is not supported; expected one of {allowed}")
    dtype = DTYPES[msg.dtype]
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}: shape {shape_text(shape)} has a negative dimension")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(
            f"{field}: {len(msg.data)} data bytes do not match shape {shape_text(shape)} of "
            f"{common_pb2.DType.Name(msg.dtype)} ({expected} bytes expected)"
        )
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
    if _BIG_ENDIAN and itemsize > 1:
        raw = raw.reshape(-1, itemsize).flip(1).reshape(-1)
    return raw.view(dtype).reshape(shape)
