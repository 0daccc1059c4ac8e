"""Small helpers for tests that talk to the servers over real gRPC."""

from __future__ import annotations

import random

import grpc
import pytest

from serving.wire import grpc_options


def channel(address: str) -> grpc.Channel:
    ch = grpc.insecure_channel(address, options=grpc_options(1024))
    grpc.channel_ready_future(ch).result(timeout=30)
    return ch


def expect_invalid(fn, request, *words: str) -> str:
    """Call and assert INVALID_ARGUMENT whose details mention every word; returns the details."""
    with pytest.raises(grpc.RpcError) as err:
        fn(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for w in words:
        assert w in err.value.details(), (w, err.value.details())
    return err.value.details()


def random_blobs(seed: int = 7, count: int = 6) -> list[bytes]:
    """Deterministic junk payloads of assorted sizes (the empty message is excluded on purpose)."""
    rng = random.Random(seed)
    return [bytes(rng.getrandbits(8) for _ in range(size)) for size in rng.sample([3, 17, 64, 255, 1024, 4096, 9000], count)]


def send_raw(ch: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    """Send raw bytes to a method, bypassing the stubs' serializers; returns the status code."""
    call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        call(payload, timeout=30)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK
