"""The operator endpoints every service answers: /health (liveness), /ready (readiness), /metrics."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def add_ops_routes(app: FastAPI, registry: CollectorRegistry, is_ready: Callable[[], bool]) -> None:
    @app.get("/health")
    def health() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready")
    def ready(response: Response) -> dict:
        """Readiness: 200 when the service can do its work, else 503."""
        ok = is_ready()
        response.status_code = 200 if ok else 503
        return {"ready": ok}

    @app.get("/metrics")
    def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class QuietUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the service's handler decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def start_ops_thread(app: FastAPI, host: str, port: int) -> QuietUvicorn:
    """Serve `app` from a daemon thread (for processes whose main thread does other work, like the actor).
    Returns the server; set `.should_exit = True` to stop it."""
    server = QuietUvicorn(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, name="ops-http", daemon=True).start()
    return server
