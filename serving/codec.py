"""Tensor codec: torch.Tensor <-> ppo_services.v1.Tensor (raw little-endian bytes + dtype + shape).

Copies of the data, which bound the codec's speed on large tensors (`python -m bench.service_split` measures it):
encode makes one (tensor -> bytes; protobuf then copies the bytes into the message), decode makes one
(protobuf's message -> the bytes object that `msg.data` returns, which the decoded tensor then owns).

A decoded tensor is always writable and shares memory with nothing that can change: not with the message (a later
decode of the same message gives the original values) and not with any other object.

Large messages: every copy lands in freshly allocated memory, and on a virtual machine the first touch of a page can
cost more than copying it (about 10 us per 4 KiB page on the machine of the numbers below). By default glibc's malloc
soon gives freed blocks of a few MiB back to the kernel (it unmaps blocks above its mmap threshold and trims a free
heap top above twice that threshold, which starts at 128 KiB and only grows as large blocks are freed), so each large
message pays those page faults again. Every service process (and the actor) therefore calls `retain_freed_memory` at
start, which sets both thresholds to the ceilings glibc's own adjustment reaches, and the next message reuses warm
pages: a float32 [512, 4096] round
trip (encode, serialize, parse, decode) went from about 0.3 to 2.5-3 GB/s on a 2-core VM. Any malloc setting in the
environment wins.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import sys
import warnings

import torch
from google.protobuf.internal import api_implementation

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
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
_BIG_ENDIAN = sys.byteorder == "big"

# protobuf's upb backend (the default since protobuf 4.21) builds a new bytes object at every read of a bytes field,
# so the object `msg.data` returns is referenced by nothing but the caller: the decoded tensor can take it over
# instead of copying it (tests/test_codec.py checks that reads still give new objects). Other backends are not relied
# on (the pure-Python one returns the object the message holds) and are copied from, as are small payloads: CPython
# shares the bytes objects of length 0 and 1.
OWNS_READ_BYTES = api_implementation.Type() == "upb"
OWN_MIN_BYTES = 4096

# torch warns once per process that a tensor over a read-only buffer is writable: for the bytes this module takes
# over that is intended (it is the only reference), so the one warning is spent here, at import.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0", dtype=torch.uint8)


MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES  # what glibc's dynamic trim threshold becomes at that mmap threshold
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def retain_freed_memory() -> bool:
    """Have glibc's malloc serve blocks up to MMAP_THRESHOLD_BYTES from its heap and keep up to TRIM_THRESHOLD_BYTES
    of free heap top instead of returning it to the kernel, so consecutive large messages reuse warm pages. These
    are the values glibc's dynamic thresholds reach by themselves once a process has freed a 32 MiB block; set from
    the start, each malloc arena keeps at most TRIM_THRESHOLD_BYTES of free memory at its top. Does nothing (returns
    False) without glibc or when the environment sets malloc's thresholds (MALLOC_MMAP_THRESHOLD_,
    MALLOC_TRIM_THRESHOLD_, or GLIBC_TUNABLES)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))



def encode(t: torch.Tensor) -> common_pb2.Tensor:
    """Serialize a CPU or GPU tensor of a supported dtype (copied to CPU, made contiguous)."""
    if t.dtype not in _WIRE:
        raise TypeError(f"unsupported dtype {t.dtype}; supported: {sorted(str(d) for d in _WIRE)}")
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
    if _BIG_ENDIAN and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size()).flip(1)
    return common_pb2.Tensor(dtype=_WIRE[t.dtype], shape=t.shape, data=raw.numpy().tobytes())


_MAX_ELEMENTS = 2**63 - 1  # torch's numel is an int64


def shape_text(shape: list[int]) -> str:
    """A shape for an error message: in full up to 8 dimensions, else its start and the count."""
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...] ({len(shape)} dimensions)"


def decode(msg: common_pb2.Tensor, field: str) -> torch.Tensor:
    """Deserialize into a writable tensor of its own; raises InvalidArgument naming `field` when dtype, shape or byte
    count are wrong."""
    if msg.dtype not in DTYPES:
        allowed = ", ".join(common_pb2.DType.Name(k) for k in DTYPES)
        raise InvalidArgument(f"{field}: dtype {msg.dtype} is not supported; expected one of {allowed}")
    dtype = DTYPES[msg.dtype]
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}: shape {shape_text(shape)} has a negative dimension")
    if math.prod(d for d in shape if d) > _MAX_ELEMENTS:  # torch multiplies the sizes out, a 0 among them or not
        raise InvalidArgument(f"{field}: shape {shape_text(shape)} is too large: its nonzero dimensions multiply to "
                              f"more than {_MAX_ELEMENTS} elements")
    itemsize = _ITEMSIZE[msg.dtype]
    expected = math.prod(shape) * itemsize
    data = msg.data  # a copy of the message's bytes (see OWNS_READ_BYTES)
    if len(data) != expected:
        raise InvalidArgument(
            f"{field}: {len(data)} data bytes do not match shape {shape_text(shape)} of "
            f"{common_pb2.DType.Name(msg.dtype)} ({expected} bytes expected)"
        )
    if OWNS_READ_BYTES and expected >= OWN_MIN_BYTES:
        raw = torch.frombuffer(data, dtype=torch.uint8)  # the tensor becomes the only owner of `data`
    elif expected:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        raw = torch.empty(0, dtype=torch.uint8)
    if _BIG_ENDIAN and itemsize > 1:
        raw = raw.reshape(-1, itemsize).flip(1).reshape(-1)
    return raw.view(dtype).reshape(shape)
