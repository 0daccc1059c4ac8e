"""What a request must be before any servicer sees it: bytes that parse as the method's message, and no larger
than the receive limit.

Every gRPC service of a server (ours, health, reflection v1 and v1alpha) is registered through
`add_parsing_service`, which parses the request bytes here: bytes that are no valid message get INVALID_ARGUMENT
naming the expected message (stock handlers answer UNKNOWN and log a traceback). The receive limit
(`receive_limit_bytes`) follows from the model's max_length, so a junk message far larger than any real request is
refused by gRPC before it is buffered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from .metrics import ServiceMetrics

MIB = 1024 * 1024
GRPC_DEFAULT_LIMIT = 4 * MIB
# The largest legitimate encoding of one token: a Train row carries int64 tokens plus returns, old_values and mask
# per action, which a client may send as float64 (8 + 3 x 8 bytes); a text carries query and prompt (16 bytes each).
BYTES_PER_TOKEN = 32
HEADROOM = 2
FIXED_BYTES = 1 * MIB  # lengths, request id, labels, framing


def bare_host(host: str) -> str:
    """`host` without the brackets an IPv6 literal may come in, as in a URL (`[::1]` -> `::1`), which getaddrinfo
    and ipaddress take bare."""
    return host.removeprefix("[").removesuffix("]")


def grpc_host(host: str) -> str:
    """`host` as a gRPC address takes it: an IPv6 literal in brackets (`::1` -> `[::1]`), anything else as it is."""
    bare = bare_host(host)
    return f"[{bare}]" if ":" in bare else host


def receive_limit_bytes(max_message_mb: int, max_request_rows: int, max_length: int | None) -> int:
    """gRPC receive limit: min(max_message_mb MiB, max(4 MiB, HEADROOM x max_request_rows x max_length x
    BYTES_PER_TOKEN + 1 MiB)); just max_message_mb MiB when the max length is unknown (None)."""
    cap = max_message_mb * MIB
    if max_length is None:
        return cap
    return min(cap, max(GRPC_DEFAULT_LIMIT, HEADROOM * max_request_rows * max_length * BYTES_PER_TOKEN + FIXED_BYTES))


def is_known_method(full_name: str) -> bool:
    """Whether `package.Service.Method` is a method of the protos this process imported."""
    try:
        descriptor_pool.Default().FindMethodByName(full_name)
    except KeyError:
        return False
    return True


def grpc_options(max_message_mb: int, receive_limit: int | None = None) -> list[tuple[str, int]]:
    """Channel/server options raising gRPC's 4 MiB default message limit: sends up to max_message_mb MiB, receives
    up to `receive_limit` bytes (default: the same)."""
    size = max_message_mb * MIB
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", receive_limit or size)]


def add_parsing_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor,
                        metrics: ServiceMetrics | None = None, package: str | None = None) -> str:
    """Register `servicer`'s methods for `service` like the generated add_*_to_server, but parse each request here
    (unary and server-streaming methods, and streams both ways). `metrics` counts the refused requests;
    `package` serves the service under another proto package with identical messages (reflection v1 answers with
    v1alpha's servicer). Returns the service's full name."""
    package = package or service.file.package
    handlers = {}
    for method in service.methods:
        if metrics is not None:  # a series per method from the start, at 0: an alert tells "idle" from "not scraped"
            metrics.requests.labels(method.name, grpc.StatusCode.OK.name)
        parse = _parser(method, package, metrics)
        behavior = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _parse_stream(behavior, parse), response_serializer=_serialize)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _parse_then_write(behavior, parse), response_serializer=_serialize)
        elif method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client-streaming methods are not served")
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parse_then(behavior, parse), response_serializer=_serialize)
    name = f"{package}.{service.name}"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    return name


def _serialize(reply: Message) -> bytes:
    return reply.SerializeToString()


def _parser(method: MethodDescriptor, package: str, metrics: ServiceMetrics | None) -> Callable:
    request_cls = GetMessageClass(method.input_type)
    expected = method.input_type.full_name
    if method.input_type.file.package == method.containing_service.file.package:
        expected = f"{package}.{method.input_type.name}"

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            return request_cls.FromString(raw)
        except DecodeError as e:
            if metrics is not None:
                metrics.record_request(method.name, grpc.StatusCode.INVALID_ARGUMENT.name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {expected} message ({e})")
            raise  # not reached: abort raises

    return parse


def _parse_then(behavior: Callable, parse: Callable) -> Callable:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        return await behavior(await parse(raw, context), context)

    return handler


def _parse_then_write(behavior: Callable, parse: Callable) -> Callable:
    """Server streaming; `behavior` writes its replies with context.write (as health Watch does)."""

    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> None:
        await behavior(await parse(raw, context), context)

    return handler


def _parse_stream(behavior: Callable, parse: Callable) -> Callable:
    """Streams both ways; `behavior` is an async generator over the parsed requests (as reflection is). A request
    that does not parse ends the call with INVALID_ARGUMENT after the replies to the ones before it."""

    async def handler(raw_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async def requests():
            async for raw in raw_requests:
                yield await parse(raw, context)

        async for reply in behavior(requests(), context):
            yield reply

    return handler
