"""The operator endpoints every service answers: /health (liveness), /ready (readiness), /metrics."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.exposition import choose_encoder

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

    def __init__(self, app, limit: int, key: str):
        self.app, self.limit, self.key = app, limit, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
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
            if not started:
                await self._refuse(send, received)

    async def _refuse(self, send, size: int) -> None:
        body = (f'{{"detail": "the request body ({size} bytes or more) is larger than this server takes '
                f'({self.limit} bytes; {self.key})"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
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
        return Response(encode(registry), media_type=content_type)


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
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT does not block a restart
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise PortTaken(f"cannot listen on {host}:{port} (HTTP): {e.strerror or e}; is the port taken?") from e
    return sock


def start_ops_thread(app: FastAPI, host: str, port: int) -> QuietUvicorn:
    """Serve `app` from a daemon thread (for processes whose main thread does other work, like the actor).
    Returns the server; set `.should_exit = True` to stop it. Raises PortTaken at once when the port cannot be bound."""
    sock = bind_http(host, port)
    server = QuietUvicorn(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ops-http", daemon=True).start()
    return server
