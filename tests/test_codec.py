"""Tensor codec: every supported dtype survives the wire; malformed tensors are rejected by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from google.protobuf.internal import api_implementation

from ppo_services.v1 import common_pb2
from serving.codec import DTYPES, OWN_MIN_BYTES, OWNS_READ_BYTES, decode, encode, retain_freed_memory
from serving.errors import InvalidArgument


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 1000).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4), (64, 80)], ids=str)  # 64 x 80: >= OWN_MIN_BYTES
def test_round_trip_is_exact(dtype, shape):
    t = sample(dtype, shape)
    msg = common_pb2.Tensor.FromString(encode(t).SerializeToString())
    back = decode(msg, "x")
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back, t)


def test_wire_format_is_little_endian_row_major():
    msg = encode(torch.tensor([[1, 2], [3, 258]], dtype=torch.int16))
    assert msg.dtype == common_pb2.DTYPE_INT16 and list(msg.shape) == [2, 2]
    assert msg.data == bytes([1, 0, 2, 0, 3, 0, 2, 1])


def test_non_contiguous_and_special_values():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(decode(encode(t), "x"), t.contiguous())
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    back = decode(encode(special), "x")
    assert torch.isnan(back[0]) and back[1] == float("inf") and back[2] == -float("inf")
    assert torch.signbit(back[3])


def test_decoded_tensor_is_writable_and_independent_of_the_message():
    msg = encode(torch.zeros(3))
    back = decode(msg, "x")
    back += 1
    assert torch.equal(decode(msg, "x"), torch.zeros(3))


@pytest.mark.parametrize(
    "msg, words",
    [
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2], data=b"\0" * 7), ["field", "7 data bytes", "8 bytes expected"]),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), ["field", "DTYPE_FLOAT32"]),
        (common_pb2.Tensor(dtype=99, shape=[1], data=b"\0"), ["field", "dtype 99"]),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[-1], data=b""), ["field", "negative"]),
        # no elements, so no bytes, but torch multiplies the sizes out and overflows int64
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[2**62, 2**62, 0], data=b""),
         ["field: shape [4611686018427387904, 4611686018427387904, 0] is too large", "9223372036854775807 elements"]),
    ],
    ids=["short-data", "unspecified-dtype", "unknown-dtype", "negative-dim", "sizes-overflow"],
)
def test_malformed_tensors_name_the_field(msg, words):
    with pytest.raises(InvalidArgument) as err:
        decode(msg, "field")
    for w in words:
        assert w in str(err.value)


def test_unsupported_dtype_is_refused_on_encode():
    with pytest.raises(TypeError, match="complex64"):
        encode(torch.zeros(2, dtype=torch.complex64))


def test_a_large_decoded_tensor_owns_its_memory_and_is_writable():
    """Large payloads are decoded without the extra copy (the tensor takes over the bytes `msg.data` returned): it
    must still be writable, independent of the message and of any other decode of it, and raise no warning."""
    t = torch.arange(4096, dtype=torch.float32)
    msg = common_pb2.Tensor.FromString(encode(t).SerializeToString())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first, second = decode(msg, "x"), decode(msg, "x")
    first += 1
    assert torch.equal(second, t) and torch.equal(decode(msg, "x"), t)
    assert torch.equal(first, t + 1)
    assert first.data_ptr() != second.data_ptr()


def test_every_read_of_a_bytes_field_is_a_new_object_where_decode_relies_on_it():
    """decode takes over the bytes object `msg.data` returns only with protobuf backends that build a new one at
    every read; if a backend started to share it, a decoded tensor would write into the message."""
    msg = encode(torch.zeros(OWN_MIN_BYTES))
    if OWNS_READ_BYTES:
        assert msg.data is not msg.data
    else:
        assert api_implementation.Type() == "python"


def test_the_copying_path_of_other_protobuf_backends(monkeypatch):
    monkeypatch.setattr("serving.codec.OWNS_READ_BYTES", False)
    t = torch.arange(4096, dtype=torch.int32)
    msg = encode(t)
    back = decode(msg, "x")
    back += 1
    assert torch.equal(decode(msg, "x"), t) and torch.equal(back, t + 1)


def test_malloc_thresholds_are_left_to_the_environment_when_it_sets_them(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert retain_freed_memory() is False
