"""Running a service: gRPC (with health and reflection) and REST in one event loop, one signal handler.

Start-up: both listeners come up first (liveness answers at once), the model loads in a thread, then
readiness turns on. SIGTERM/SIGINT: health NOT_SERVING and /ready 503 first, then requests that arrive are refused,
while those that arrived before (queued, running, or still being received or validated) finish within the grace
period, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import transformers
from fastapi import FastAPI
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batching import ModelWorker
from .codec import retain_freed_memory
from .errors import NotReady, ServiceError
from .metrics import ServiceMetrics
from .modeling import DeviceUnavailable, set_thread_budget
from .rest import (
    BodyLimit,
    PortTaken,
    QuietUvicorn,
    ServingRequests,
    Throttle,
    TimedHandshakeLoop,
    add_ops_routes,
    bind_failure,
    bind_http,
    flush_client_noise,
    uvicorn_config,
)
from .security import (
    OPEN_GRPC_PREFIXES,
    AuthInterceptor,
    SecurityError,
    add_rest_auth,
    add_rest_client_cert_check,
    check_certificate,
    check_exposure,
    load_token,
    report_certificate,
    route_path,
    server_credentials,
)
from .server_config import ServerConfig
from .wire import add_parsing_service, grpc_host, grpc_options, is_known_method, receive_limit_bytes

log = logging.getLogger(__name__)

_REPLY_FLUSH_S = 1.0  # after the model work drained: time for the last replies to reach their clients


# When the request being served reached this server (time.monotonic()): one that arrived before the server began
# to stop is still served (Service.require_ready)
_ARRIVED: contextvars.ContextVar[float] = contextvars.ContextVar("request_arrived")


_MAX_DETAILS = 2000  # characters; gRPC fails a call whose status message passes its 16 KiB metadata limit


def status_details(message: str) -> str:
    """An error message short enough to travel as a gRPC status (one naming a 10,000-dimension shape is not)."""
    if len(message) <= _MAX_DETAILS:
        return message
    return f"{message[:_MAX_DETAILS]}... ({len(message)} characters)"


def rpc_method(name: str) -> Callable:
    """Wrap an async servicer method: count and time it, map ServiceError to its gRPC status, and turn any
    other exception into INTERNAL without taking the server down. The servicer has `.metrics`."""

    def decorate(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(method)
        async def wrapper(self, request, context: grpc.aio.ServicerContext):
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return await method(self, request, context)
            except ServiceError as e:
                code = e.grpc_code
                await context.abort(code, status_details(str(e)))
            except (asyncio.CancelledError, grpc.aio.AbortError):
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as e:
                log.exception("%s failed", name)
                code = grpc.StatusCode.INTERNAL
                await context.abort(code, status_details(f"{name} failed: {type(e).__name__}: {e}"))
            finally:
                self.metrics.record_request(name, code.name, time.perf_counter() - start)

        return wrapper

    return decorate


REFLECTION_V1 = "grpc.reflection.v1"
_DESCRIPTORS = Path(__file__).resolve().parent.parent / "ppo_services" / "v1" / "descriptors.binpb"


class DocumentedReflectionServicer(reflection.aio.ReflectionServicer):
    """Reflection that describes our .proto files with their comments (source info), which the stock servicer
    drops: `grpcurl describe ppo_services.v1.CriticService.Train` shows what each RPC and field means."""

    def __init__(self, service_names: list[str]):
        super().__init__(service_names)
        files = descriptor_pb2.FileDescriptorSet.FromString(_DESCRIPTORS.read_bytes()).file
        self._documented = {f.name: f.SerializeToString() for f in files}

    def _with_comments(self, response):
        if response.HasField("file_descriptor_response"):
            protos = response.file_descriptor_response.file_descriptor_proto
            for i, raw in enumerate(protos):
                name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
                protos[i] = self._documented.get(name, raw)
        return response

    def _file_by_filename(self, request, filename):
        return self._with_comments(super()._file_by_filename(request, filename))

    def _file_containing_symbol(self, request, fully_qualified_name):
        response = super()._file_containing_symbol(request, fully_qualified_name)
        if response.HasField("error_response") and _is_method_or_enum_value(fully_qualified_name):
            # the stock servicer's lookup finds neither: the file of the service or enum that holds it
            response = super()._file_containing_symbol(request, fully_qualified_name.rpartition(".")[0])
        return self._with_comments(response)


def _is_method_or_enum_value(name: str) -> bool:
    if is_known_method(name):
        return True
    parent, _, last = name.rpartition(".")
    try:
        return last in descriptor_pool.Default().FindEnumTypeByName(parent).values_by_name
    except KeyError:
        return False


class ArrivalInterceptor(grpc.aio.ServerInterceptor):
    """Records when each call to our services began to arrive (its headers, before its message), so that a call whose
    message is still arriving when the server begins to stop is served too, and the shutdown waits for it
    (Service.call_arriving). Health and reflection calls are not counted: a Watch must not hold a shutdown."""

    def __init__(self, service: Service):
        self.service = service

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if not details.method.startswith(OPEN_GRPC_PREFIXES):
            self.service.call_arriving(asyncio.current_task())
        return await continuation(details)


def _describe_reflection_v1() -> None:
    """Put grpc.reflection.v1's file into the descriptor pool reflection answers from, so that the v1 service it
    lists can be described too: grpcio-reflection ships only v1alpha's, whose messages are v1's under another
    package."""
    pool, name = descriptor_pool.Default(), "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, proto.name, proto.package = f".{proto.package}.", name, REFLECTION_V1
    for method in (m for service in proto.service for m in service.method):
        method.input_type = method.input_type.replace(old, f".{REFLECTION_V1}.")
        method.output_type = method.output_type.replace(old, f".{REFLECTION_V1}.")
    for field in (f for message in proto.message_type for f in message.field if f.type_name):
        field.type_name = field.type_name.replace(old, f".{REFLECTION_V1}.")
    pool.AddSerializedFile(proto.SerializeToString())


class ListingHealthServicer(health.aio.HealthServicer):
    """The stock health servicer, with grpc.health.v1's List answered (the stock one leaves it unimplemented, and
    every call logged a traceback): the status of every service it knows."""

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()})


def add_probe_services(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard health, and server reflection under grpc.reflection.v1 (what current grpcurl and Postman ask
    first) and v1alpha (older clients), with the request bytes parsed in our code like every other service. The
    two reflection protocols have identical messages, so one servicer answers both. Returns the health servicer."""
    _describe_reflection_v1()
    health_servicer = ListingHealthServicer()
    health_name = add_parsing_service(server, health_servicer, health_pb2.DESCRIPTOR.services_by_name["Health"])
    reflection_service = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
    names = [*service_names, health_name, f"{REFLECTION_V1}.{reflection_service.name}", reflection_service.full_name]
    reflection_servicer = DocumentedReflectionServicer(names)
    add_parsing_service(server, reflection_servicer, reflection_service)
    add_parsing_service(server, reflection_servicer, reflection_service, package=REFLECTION_V1)
    return health_servicer


MAX_STREAMS_PER_CONNECTION = 256  # calls one gRPC connection may hold open at once; more wait in the client
IDLE_CONNECTION_S = 600.0  # a gRPC connection with no call for this long is closed (the client reopens it)
LOOP_ERRORS_EVERY_S = 10.0  # the same event-loop error is logged at most once in this many seconds


class ThrottledLoopErrors:
    """The event loop's exception handler: each kind of error (by its message) is logged the first time and then at
    most once every LOOP_ERRORS_EVERY_S, with the count held back. Out of file descriptors (a flood of connections),
    asyncio logs a traceback for every failed accept: 839,234 of them, 373 MB, in 70 s, in a probe."""

    def __init__(self, every_s: float = LOOP_ERRORS_EVERY_S):
        self.throttle = Throttle(every_s)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        key = str(context.get("message", ""))
        if (admitted := self.throttle.admit(key)) is None:
            return
        held, since = admitted
        if held:
            context = {**context, "message": f"{key} ({held} more like it in the last {since:.0f} s)"}
        loop.default_exception_handler(context)


def more_open_files() -> None:
    """Raise this process's soft limit of open files to its hard limit (at most 65536): each client connection
    takes one, and at the usual soft limit of 1024 a few hundred idle clients could make the server refuse the
    next one, or fail a Save (`Too many open files`)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class Service:
    """One server process. Subclasses set up their core, servicers and extra routes."""

    name: str = "service"
    # whether TLS without a client CA may guard a non-loopback listener (a server whose calls change nothing)
    tls_alone_authenticates: bool = True

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.metrics = ServiceMetrics(self.name)
        self.worker: ModelWorker | None = None
        self.abandoned = False
        self.ready = False
        self.stopping_since: float | None = None  # time.monotonic() when the shutdown began
        self._requests: dict[object, float] = {}  # the requests being served, and when each arrived
        self.app = FastAPI(title=f"{self.name} server", docs_url=None, redoc_url=None, openapi_url=None,
                           redirect_slashes=False)
        add_ops_routes(self.app, self.metrics.registry, lambda: self.ready)

        @self.app.exception_handler(RequestValidationError)
        async def count_rejected_body(request, exc):
            """A REST body FastAPI rejects (422) counts as an INVALID_ARGUMENT request of its route. The detail
            names each bad field (`loc`) without echoing its input, which may be what JSON cannot carry back
            (NaN, a lone surrogate) and would turn the 422 into a 500."""
            self.metrics.record_request(route_path(request.scope).strip("/"), grpc.StatusCode.INVALID_ARGUMENT.name)
            detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
            return JSONResponse({"detail": detail}, status_code=422)

        @self.app.exception_handler(StarletteHTTPException)
        async def count_unparsable_body(request, exc):
            """A body FastAPI could not parse but is no JSON syntax error (not UTF-8, an integer past Python's
            4,300 digits, nesting past the recursion limit) is raised as a 400 "There was an error parsing the body"
            from the parser's exception: counted as an INVALID_ARGUMENT request of its route, and its reason
            named. Any other HTTP error (404 for an unknown path, 405) is answered as FastAPI answers it."""
            if exc.status_code != 400 or exc.__cause__ is None:
                return await http_exception_handler(request, exc)
            self.metrics.record_request(route_path(request.scope).strip("/"), grpc.StatusCode.INVALID_ARGUMENT.name)
            cause = exc.__cause__
            reason = "nested too deeply" if isinstance(cause, RecursionError) else f"{type(cause).__name__}: {cause}"
            return JSONResponse({"detail": f"body: cannot be parsed as JSON ({reason[:300]})"}, status_code=400)

    # --- to implement -------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model (runs in a thread while the listeners are already up)."""
        raise NotImplementedError

    def add_servicers(self, server: grpc.aio.Server) -> list[str]:
        """Register gRPC servicers; return their full service names (for health and reflection)."""
        raise NotImplementedError

    def max_length_hint(self) -> int | None:
        """The max_length load() will find, read before loading (from the model's config, without weights), for
        the gRPC receive limit; None when it cannot be told then (the limit is max_message_mb)."""
        return None

    # --- shared ---------------------------------------------------------------------------------
    def require_ready(self) -> ModelWorker:
        """The model worker, for a request this server serves: any while it is ready, and while it stops, those
        that arrived before (a REST body or a gRPC message still being received, parsed or validated)."""
        if self.worker is None or not (self.ready or self._arrived_before_stop(_ARRIVED.get(None))):
            raise NotReady("model is not loaded yet or the server is shutting down")
        return self.worker

    @contextlib.contextmanager
    def serving_request(self, arrived: float) -> Iterator[None]:
        """Serve one REST request that reached the server at `arrived` (a gRPC call: `call_arriving`); the shutdown
        waits for those that arrived before it began (`_owed_requests`)."""
        key, token = object(), _ARRIVED.set(arrived)
        self._requests[key] = arrived
        try:
            yield
        finally:
            del self._requests[key]
            _ARRIVED.reset(token)

    def call_arriving(self, call: asyncio.Task) -> None:
        """A gRPC call began to arrive now, in the task that will run its handler (grpc.aio runs both in one): its
        arrival is that task's (_ARRIVED), and it counts as served until the task ends, however the call ends (a
        message that never arrives whole included)."""
        key, arrived = object(), time.monotonic()
        _ARRIVED.set(arrived)
        self._requests[key] = arrived
        call.add_done_callback(lambda _: self._requests.pop(key, None))

    def _arrived_before_stop(self, arrived: float | None) -> bool:
        return self.stopping_since is not None and arrived is not None and arrived < self.stopping_since

    def _owed_requests(self) -> bool:
        """Whether requests that arrived before the shutdown are still being served."""
        return any(self._arrived_before_stop(t) for t in self._requests.values())

    def _load_in_background(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Run load() in a daemon thread, so a SIGTERM during a long load need not wait for it."""
        done = loop.create_future()

        def settle(err: BaseException | None) -> None:
            if done.done():
                return
            if err is None:
                done.set_result(None)
            else:
                done.set_exception(err)

        def run() -> None:
            try:
                self.load()
                err = None
            except BaseException as e:  # noqa: BLE001 - reported by the event loop
                err = e
            loop.call_soon_threadsafe(settle, err)

        threading.Thread(target=run, name=f"{self.name}-load", daemon=True).start()
        return done

    async def serve(self) -> int:
        """Run until SIGTERM/SIGINT; returns the process exit code."""
        cfg = self.cfg
        set_thread_budget(cfg.num_threads)
        retain_freed_memory()  # large messages reuse warm pages (serving/codec.py)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(ThrottledLoopErrors())
        more_open_files()
        stop = asyncio.Event()
        exit_code = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        try:
            token = load_token(cfg.auth_token_file)
            check_exposure(cfg.host, token, cfg, tls_alone=self.tls_alone_authenticates)
            credentials = server_credentials(cfg)
            if cfg.tls_cert_file:
                report_certificate(cfg.tls_cert_file, check_certificate(cfg.tls_cert_file, cfg.tls_key_file),
                                   self.metrics)
        except SecurityError as e:
            log.error("%s: %s", self.name, e)
            return 2
        # The receive limit is fixed when the server is built, before the model loads: it follows from the max
        # length in the model's config, read without the weights. REST bodies have the same limit.
        max_length = self.max_length_hint()
        receive_limit = receive_limit_bytes(cfg.max_message_mb, cfg.max_request_rows, max_length)
        self.app.add_middleware(BodyLimit, limit=receive_limit, key="max_message_mb, max_request_rows",
                                refused=lambda route: self.metrics.record_request(
                                    route.strip("/"), grpc.StatusCode.RESOURCE_EXHAUSTED.name))
        if token:  # outside the body limit: a caller without the token is refused before its body is read
            add_rest_auth(self.app, token, self.metrics)
        if cfg.tls_client_ca_file:  # mutual TLS covers REST too, but for the probes
            add_rest_client_cert_check(self.app, self.metrics)
        # outermost: a request that arrived before a shutdown is served, however far it had got
        self.app.add_middleware(ServingRequests, serving=self.serving_request)
        # No SO_REUSEPORT: a second server on a taken port must fail, not share its traffic.
        interceptors = [ArrivalInterceptor(self), *([AuthInterceptor(token, self.metrics)] if token else [])]
        server = grpc.aio.server(interceptors=interceptors,
                                 # a connection that has not finished its handshake (TLS, HTTP/2's opening) by
                                 # http_read_timeout_s is closed, as on REST (gRPC's own default is 60 s or more)
                                 options=[*grpc_options(cfg.max_message_mb, receive_limit), ("grpc.so_reuseport", 0),
                                          ("grpc.server_handshake_timeout_ms", int(cfg.http_read_timeout_s * 1000)),
                                          ("grpc.http2.min_recv_ping_interval_without_data_ms",
                                           int(cfg.min_ping_interval_s * 1000)),
                                          # a bound on the calls one connection holds open (20,000 calls whose
                                          # message never came held 13 KB each) and on connections left idle
                                          # (a client reconnects by itself when it calls again)
                                          ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                                          ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_S * 1000))])
        names = self.add_servicers(server)
        health_servicer = add_probe_services(server, names)
        for n in ["", *names]:
            await health_servicer.set(n, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            address = f"{grpc_host(cfg.host)}:{cfg.port}"
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if bound == 0:
            log.error("%s %s", self.name, bind_failure(cfg.host, cfg.port, "gRPC", "port"))
            return 1
        try:
            http_socket = bind_http(cfg.host, cfg.http_port)
        except PortTaken:
            log.error("%s %s", self.name, bind_failure(cfg.host, cfg.http_port, "HTTP", "http_port"))
            return 1
        await server.start()

        http = QuietUvicorn(uvicorn_config(self.app, cfg.host, cfg.http_port, cfg.http_read_timeout_s,
                                           cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file))
        http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
        log.info("%s listening: gRPC%s %s:%d, HTTP%s %s:%d%s", self.name, " (TLS)" if credentials else "", cfg.host,
                 bound, "S" if credentials else "", cfg.host, http_socket.getsockname()[1],
                 ", bearer token required" if token else "")
        log.info("%s receives gRPC messages up to %.1f MiB (max_length %s, max_request_rows %d, max_message_mb %d)",
                 self.name, receive_limit / 2**20, max_length or "unknown", cfg.max_request_rows, cfg.max_message_mb)

        load = self._load_in_background(loop)
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait([load, stop_task, http_task], return_when=asyncio.FIRST_COMPLETED)
        if http_task.done() and not stop.is_set():
            log.error("%s: its HTTP server stopped: %s", self.name, http_task.exception() or "without an error")
            await server.stop(0)
            return 1
        if load.done() and not stop.is_set() and load.exception() is not None:
            err = load.exception()
            log.error("%s cannot load its model: %s: %s", self.name, type(err).__name__, err)
            stop.set()
            exit_code = 1
        if load.done() and not stop.is_set():
            self.worker = ModelWorker(self.metrics, cfg.batching.max_batch_size,
                                      cfg.batching.max_queue_delay_ms / 1000, cfg.batching.max_queue_size,
                                      on_failure=lambda: stop.set())
            self.worker.start()
            self.ready = True
            self.metrics.ready.set(1)
            for n in ["", *names]:
                await health_servicer.set(n, health_pb2.HealthCheckResponse.SERVING)
            log.info("%s ready", self.name)
            await stop.wait()
            if self.worker.failed:
                exit_code = 1

        # One deadline: the requests that arrived before the shutdown, and the model work they wait for (queued and
        # running), finish first, then gRPC stops with a short window to send their replies; long-lived streams
        # such as a health Watch must not hold the process for the whole grace period.
        self.stopping_since = time.monotonic()
        deadline = self.stopping_since + cfg.grace_period_s
        log.info("%s shutting down (grace %.0fs)", self.name, cfg.grace_period_s)
        for sig in (signal.SIGTERM, signal.SIGINT):  # a repeated signal changes nothing, to the process's last instant
            loop.remove_signal_handler(sig)  # (the loop's close would restore the default, which kills)
            signal.signal(sig, signal.SIG_IGN)
        self.ready = False
        self.metrics.ready.set(0)
        await health_servicer.enter_graceful_shutdown()
        finished = True
        if self.worker is not None:
            finished = await self.worker.drain(max(0.0, deadline - time.monotonic()), self._owed_requests)
        await server.stop(min(_REPLY_FLUSH_S, max(0.0, deadline - time.monotonic())) if finished else 0)
        # REST within the same deadline: uvicorn alone waits for every connection to close, however long a client
        # takes to finish sending a request or to read its reply; past it, its requests still running are cancelled
        http.config.timeout_graceful_shutdown = max(1, deadline - time.monotonic())
        http.should_exit = True
        await http_task
        flush_client_noise()
        if not finished:
            log.warning("%s: grace period over with model work still running; abandoning it", self.name)
            self.abandoned = True
        if not load.done():
            log.info("%s: stopping before its model finished loading", self.name)
            self.abandoned = True
        log.info("%s stopped", self.name)
        return exit_code


def run_service(make_service: Callable[[], Service]) -> None:
    """Entry point of `python -m <server>`: logging, the service (`make_service()`; a device that is not here exits
    1 with the reason, naming the key), event loop, then exit: 0 after a clean shutdown, 1 when the server could not
    start or its model worker failed."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    transformers.utils.logging.disable_progress_bar()
    try:
        service = make_service()
    except DeviceUnavailable as e:
        sys.exit(f"error: {e}")
    with asyncio.Runner(loop_factory=functools.partial(TimedHandshakeLoop, service.cfg.http_read_timeout_s)) as runner:
        code = runner.run(service.serve())
    if service.abandoned:  # a model thread is still busy: exit now rather than wait for it or tear it down
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
