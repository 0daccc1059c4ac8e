"""Process start-up: the imports of torch, transformers and the model code without Python's cyclic garbage collector,
a quiet stop for a signal that comes before a server serves, and why a port could not be listened on.

Those imports create hundreds of thousands of objects (modules, classes, functions), none of them garbage, and the
collector walks them again and again while they are made: about a sixth of a service's start-up CPU time. Each
entry point imports its heavy modules inside `imports_without_gc()`; the objects made there are then frozen out of
later collections (`gc.freeze`), so the collections a training step triggers do not walk them either.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Within the block the cyclic collector is off (reference counting still frees what is dropped); after it, every
    object then alive is moved to the permanent generation and the collector runs as before (as it was, if the
    caller had turned it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def stop_at_once_until_serving(name: str, until: str = "it began serving") -> None:
    """Until the server's event loop takes the signals over (serving.server.Service.serve; the actor's training loop,
    PPOTrainer.fit), SIGTERM or SIGINT ends the process at once with exit 0: nothing is owed yet (the actor's start
    writes nothing a restart does not redo). Without this a signal in the seconds of imports, model loading or
    waiting for servers killed it (exit -15), or printed a KeyboardInterrupt traceback."""

    def stop(signum: int, frame) -> None:
        os.write(2, f"{name}: stopped by {signal.Signals(signum).name} before {until}\n".encode())
        os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def bind_failure(host: str, port: int, what: str, key: str) -> str:
    """Why `host:port` (config keys `host` and `key`) could not be listened on by `what` (gRPC, HTTP), for a bind that
    has just failed: probed again with a plain socket, to tell a host that does not resolve or is no address of this
    machine from a port another process holds (every such failure used to be put down to the port)."""
    bare = host.removeprefix("[").removesuffix("]")  # an IPv6 literal may come bracketed, as in a URL
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
