"""The operator endpoints every service answers: /health (liveness), /ready (readiness), /metrics."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import gzip
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import h11
import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from uvicorn.protocols.http.h11_impl import H11Protocol

from .security import CLIENT_CERTIFIED, route_path
from .wire import bare_host

# No `*_created` series beside each counter and histogram: the text format shows each as a gauge family of its own,
# doubling what every scrape stores. Every service (the actor too) serves /metrics through this module.
disable_created_metrics()


class _TooLarge(BaseException):
    """A body past the limit, raised while the app reads it. Not an Exception: FastAPI answers those raised while it
    reads a body with 400, where this one must reach BodyLimit and become 413."""


class BodyLimit:
    """ASGI middleware: a request body larger than `limit` bytes gets 413, whether its Content-Length says so at
    once or a chunked body passes the limit while it is read, so no body past the limit is held in memory (the REST
    counterpart of the gRPC receive limit)."""

    def __init__(self, app, limit: int, key: str, refused: Callable[[str], None] = lambda route: None):
        self.app, self.limit, self.key = app, limit, key
        self.refused = refused  # told each refusal's route path, for the request counters

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_path(scope)
        if route is None:  # no route: the app's 404, which reads no body, and counts nothing (no caller-named series)
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            self.refused(route)
            return await self._refuse(send, int(declared))
        received, started = 0, False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge
            return message

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            self.refused(route)
            if not started:
                await self._refuse(send, received)

    async def _refuse(self, send, size: int) -> None:
        body = (f'{{"detail": "the request body ({size} bytes or more) is larger than this server takes '
                f'({self.limit} bytes; {self.key})"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# The scope state key of when a request's bytes reached the server (time.monotonic(); TimedRequestProtocol)
REQUEST_ARRIVED = "request_arrived"


class ServingRequests:
    """ASGI middleware: each HTTP request is served inside `serving(arrived)`, `arrived` being when its bytes reached
    the server, so that a server that begins to stop still serves the requests that arrived before (one still being
    received or parsed included) and waits for them (serving.server.Service.serving_request). One the server's
    shutdown cancels when its grace period is over is answered 503, as those that arrive after the stop are (uvicorn
    answered 500 and logged the cancellation's traceback; clients retry a 503, not a 500)."""

    def __init__(self, app, serving: Callable[[float], AbstractContextManager]):
        self.app, self.serving = app, serving

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        with self.serving(scope.get("state", {}).get(REQUEST_ARRIVED, time.monotonic())):
            try:
                await self.app(scope, receive, watched_send)
            except asyncio.CancelledError:  # only the shutdown cancels a request: uvicorn's, at the grace deadline
                if started:  # a reply the client was not reading (its socket full): the connection closes with the
                    return  # server; raised, uvicorn logged a traceback for each such client
                body = b'{"detail": "the server stopped before this request finished (grace_period_s); retry it"}'
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})


def add_ops_routes(app: FastAPI, registry: CollectorRegistry, is_ready: Callable[[], bool]) -> None:
    # HEAD too (RFC 9110: wherever GET is), which some load balancers and uptime checkers probe with
    @app.api_route("/health", methods=["GET", "HEAD"])
    def health() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.api_route("/ready", methods=["GET", "HEAD"])
    def ready(response: Response) -> dict:
        """Readiness: 200 when the service can do its work, else 503."""
        ok = is_ready()
        response.status_code = 200 if ok else 503
        return {"ready": ok}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    def metrics(request: Request) -> Response:
        """Prometheus exposition in the format the scraper's Accept header asks for: OpenMetrics for Prometheus
        itself (its default scrape protocols list it first), the text format otherwise."""
        try:
            encode, content_type = choose_encoder(request.headers.get("accept", ""))
        except (TypeError, ValueError):  # prometheus-client fails on a version= that is no number: the default
            encode, content_type = choose_encoder("")
        body, headers = encode(registry), {"Vary": "Accept-Encoding"}
        if "gzip" in request.headers.get("accept-encoding", ""):  # as prometheus-client's own exporters do
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        return Response(body, media_type=content_type, headers=headers)


# How long a client may take to send a whole request from the moment the server waits for one (the connection's
# opening, or the end of its last response), plus one second for every READ_MIN_RATE bytes it has sent, and how long
# it may fall silent while it sends one: a large body on a slow link arrives as long as it keeps at least that rate
# on average and never pauses that long (Apache's mod_reqtimeout and nginx's client_body_timeout, together). The same
# time bounds how long a client may leave the server's reply unread.
REQUEST_READ_TIMEOUT_S = 30.0
READ_MIN_RATE = 64 * 1024
# How long a connection this server has closed may take to go (see TimedRequestProtocol._reap_when_closed).
CLOSE_WAIT_S = 1.0


class TimedRequestProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with deadlines on what a client owes the server:

    - its request: a connection that has not sent its whole request (head and body) within `read_timeout_s` of the
      server starting to wait for it, plus a second for every READ_MIN_RATE bytes sent, or that falls silent for
      `read_timeout_s` while it sends one, is closed. uvicorn alone closes only a connection that stays silent after
      a response (timeout_keep_alive, which every byte resets) and none before its first request, so a client that
      opened connections and sent nothing, or a byte every few seconds ("slowloris"), held each one, and its file
      descriptor, for as long as it liked;
    - reading the reply: a connection whose client leaves the server's writes blocked (a full buffer) for
      `read_timeout_s` is dropped; uvicorn waited for it without end, shutdown included.

    Work on a whole request is not timed: a slow /get_reward is answered however long it computes. A connection the
    server has closed is dropped if it lingers (`_reap_when_closed`). Each request's scope state records whether its
    client presented a verified certificate (CLIENT_CERTIFIED) and when its bytes arrived (REQUEST_ARRIVED)."""

    read_timeout_s = REQUEST_READ_TIMEOUT_S
    _read_deadline: asyncio.TimerHandle | None = None
    _write_deadline: asyncio.TimerHandle | None = None
    _lost = _reaping = False
    _waiting_since = _last_data = 0.0
    _received = 0

    @classmethod
    def with_timeout(cls, seconds: float) -> type[TimedRequestProtocol]:
        return type(cls.__name__, (cls,), {"read_timeout_s": seconds})

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        tls = transport.get_extra_info("ssl_object")
        # whether the client proved itself with a certificate the server's client CA signed (requested, not
        # required, so that probes need none; one that does not verify has failed the handshake already), for
        # the REST routes that need it (serving.security.add_rest_client_cert_check)
        self.app_state = {**self.app_state, CLIENT_CERTIFIED: tls is not None and tls.getpeercert() is not None}
        self._watch_reading()

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        self._last_data = self.loop.time()
        # the arrival of a request whose head these bytes complete (its scope's state is a copy taken then)
        self.app_state[REQUEST_ARRIVED] = time.monotonic()
        super().data_received(data)
        self._watch_reading(moved=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._stop_deadline()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.read_timeout_s, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def shutdown(self) -> None:
        if not self.transport.is_closing():  # a second close of a TLS transport detaches it from its TLS layer
            super().shutdown()
        self._reap_when_closed()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._reap_when_closed()

    def _reap_when_closed(self) -> None:
        """Once this server has closed the connection, drop it if it is still there CLOSE_WAIT_S later. Over TLS a
        close sends close_notify and then waits for the client's, up to asyncio's ssl_shutdown_timeout (30 s): an idle
        keep-alive client (a Prometheus scraper over HTTPS) held the server's shutdown, and with it the critic's exit
        save, for those 30 s. A reply still being written is given until its buffer drains (a client that leaves it
        unread is dropped by the write deadline)."""
        if self._reaping or self._lost:
            return
        self._reaping = True

        def check() -> None:
            if self._lost:
                return
            try:
                pending = self.transport.get_write_buffer_size()
            except AttributeError:  # a TLS transport closed twice has let go of its TLS layer: nothing to flush
                pending = 0
            if self.transport.is_closing() and pending == 0:
                self.transport.abort()
            else:  # still answering a request, or writing out its reply
                self.loop.call_later(CLOSE_WAIT_S, check)

        self.loop.call_later(CLOSE_WAIT_S, check)

    def _watch_reading(self, moved: bool = False) -> None:
        """A deadline runs while the client owes (part of) a request; it starts when the wait does, and the bytes
        that arrive move it on at READ_MIN_RATE, to at most `read_timeout_s` after the last of them."""
        if self.transport.is_closing():  # closed by the server (Connection: close, HTTP/1.0, a 400 or 413)
            self._stop_deadline()
            self._reap_when_closed()
            return
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._stop_deadline()
            return
        if self._read_deadline is None:
            self._waiting_since = self._last_data = self.loop.time()
            self._received = 0
        elif not moved:
            return
        else:
            self._read_deadline.cancel()
        when = min(self._waiting_since + self.read_timeout_s + self._received / READ_MIN_RATE,
                   self._last_data + self.read_timeout_s)
        self._read_deadline = self.loop.call_at(when, self._read_timed_out)

    def _stop_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.transport.close()
        self._reap_when_closed()


# How often each kind of client noise uvicorn logs may reach the log (ClientNoiseFilter)
CLIENT_NOISE_EVERY_S = 60.0


class Throttle:
    """Repeated messages, by kind: one passes every `every_s` seconds, the rest are counted, and the next that passes
    learns how many were held back since (the log of a flood reads a line per interval, not a line per event)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def admit(self, kind: str) -> tuple[int, float] | None:
        """None to hold this one back; else (how many were held back, seconds since the last that passed)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind, -math.inf)
            if now - last < self.every_s:
                self._held[kind] += 1
                return None
            self._last[kind] = now
            return self._held.pop(kind, 0), now - last

    def held_back(self) -> collections.Counter[str]:
        """The counts held back since each kind last passed, forgotten here (told at shutdown)."""
        with self._lock:
            held, self._held = self._held, collections.Counter()
        return held


class ClientNoiseFilter(logging.Filter):
    """uvicorn logs a warning for every malformed request and every WebSocket upgrade a client sends, so any client
    that reaches a REST port could fill the log at its request rate. Each such warning passes at most once every
    `every_s` seconds, saying how many were held back since; uvicorn's advice to install a WebSocket library is
    dropped (these services serve no WebSocket: the upgrade is answered as a plain request)."""

    NOISE = ("Invalid HTTP request received.", "Unsupported upgrade request.")
    DROPPED = "No supported WebSocket library detected"

    def __init__(self, every_s: float = CLIENT_NOISE_EVERY_S):
        super().__init__()
        self.throttle = Throttle(every_s)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.DROPPED):
            return False
        if message not in self.NOISE:
            return True
        if (admitted := self.throttle.admit(message)) is None:
            return False
        if held := admitted[0]:
            record.msg, record.args = self._with_count(message, held), ()
        return True

    def flush(self, logger: logging.Logger) -> None:
        """Log the counts still held back (at shutdown: a burst that ended is otherwise never told)."""
        for message, count in self.throttle.held_back().items():
            logger.warning(self._with_count(message, count))

    @staticmethod
    def _with_count(message: str, held: int) -> str:
        return f"{message} ({held} more since the last such line, not logged)"


# The one filter on uvicorn's error log (uvicorn_config installs it; the servers flush it as they stop)
CLIENT_NOISE = ClientNoiseFilter()


def flush_client_noise() -> None:
    """Log what CLIENT_NOISE still holds back (a server's last words)."""
    CLIENT_NOISE.flush(logging.getLogger("uvicorn.error"))


class TimedHandshakeLoop(asyncio.SelectorEventLoop):
    """The servers' event loop: a client of a TLS listener must finish the TLS handshake within
    `handshake_timeout_s` (their http_read_timeout_s). uvicorn passes no ssl_handshake_timeout, so asyncio's 60 s
    applied whatever http_read_timeout_s said, and TimedRequestProtocol's deadline only starts once the handshake is
    done: a client that opened TLS connections and never finished the handshake held each one for a minute."""

    def __init__(self, handshake_timeout_s: float):
        super().__init__()
        self.handshake_timeout_s = handshake_timeout_s

    async def create_server(self, *args, ssl_handshake_timeout=None, **kwargs):  # type: ignore[override]
        if kwargs.get("ssl") is not None and ssl_handshake_timeout is None:
            ssl_handshake_timeout = self.handshake_timeout_s
        return await super().create_server(*args, ssl_handshake_timeout=ssl_handshake_timeout, **kwargs)


def uvicorn_config(app: FastAPI, host: str, port: int, read_timeout_s: float = REQUEST_READ_TIMEOUT_S,
                   cert_file: str | None = None, key_file: str | None = None,
                   client_ca_file: str | None = None) -> uvicorn.Config:
    """Every service's REST server: HTTP/1.1 with a deadline for reading each request (TimedRequestProtocol), the
    service's own logging (clients' noise held back: ClientNoiseFilter) and signal handling; HTTPS with `cert_file`,
    asking clients for a certificate signed by `client_ca_file` where one is given (optional in the handshake: each
    route decides whether it needs one)."""
    tls = {}
    if cert_file:
        tls = {"ssl_certfile": cert_file, "ssl_keyfile": key_file}
        if client_ca_file:
            tls |= {"ssl_ca_certs": client_ca_file, "ssl_cert_reqs": ssl.CERT_OPTIONAL}
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                            http=TimedRequestProtocol.with_timeout(read_timeout_s), **tls)
    logging.getLogger("uvicorn.error").addFilter(CLIENT_NOISE)  # after the Config, which sets up uvicorn's loggers
    return config


class QuietUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the service's handler decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class PortTaken(OSError):
    """The REST port cannot be bound (taken, or not an address of this host)."""


def bind_http(host: str, port: int) -> socket.socket:
    """Bind the REST port before uvicorn serves on it. uvicorn binding it itself calls sys.exit from inside its task
    or thread on failure: a service would die mid-start (or, in a thread, go on without its endpoints) instead of
    stopping with an error that names the port."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(bare_host(host), port,
                                                             type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT does not block a restart
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise PortTaken(f"cannot listen on {host}:{port} (HTTP): {e.strerror or e}; is the port taken?") from e
    return sock


def bind_failure(host: str, port: int, what: str, key: str) -> str:
    """Why `host:port` (config keys `host` and `key`) could not be listened on by `what` (gRPC, HTTP), for a bind that
    has just failed: probed again with a plain socket, to tell a host that does not resolve or is no address of this
    machine from a port another process holds (every such failure used to be put down to the port)."""
    bare = bare_host(host)
    where = f"cannot listen on {host}:{port} ({what})"
    try:
        addresses = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"{where}: host {host!r} does not resolve ({e.strerror}); set host to a name or address of this machine"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"{where}: the port is taken (another process listens on it); set {key} to a free port"
                if e.errno == errno.EADDRNOTAVAIL:
                    return f"{where}: {host} is no address of this machine; set host to one of its addresses"
                if e.errno == errno.EACCES:
                    return f"{where}: permission denied (ports below 1024 need privileges); set {key} to a port above"
                return f"{where}: {e.strerror or e}"
    return f"{where}: the port was taken, or the host unusable, at that moment; {key} and host bind now"


def start_ops_thread(app: FastAPI, host: str, port: int) -> QuietUvicorn:
    """Serve `app` from a daemon thread (for processes whose main thread does other work, like the actor).
    Returns the server; set `.should_exit = True` to stop it. Raises PortTaken at once when the port cannot be bound."""
    sock = bind_http(host, port)
    server = QuietUvicorn(uvicorn_config(app, host, port))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ops-http", daemon=True).start()
    return server
