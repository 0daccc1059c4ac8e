"""Process start-up: the imports of torch, transformers and the model code without Python's cyclic garbage collector,
and a quiet stop for a signal that comes before a server serves.

Those imports create hundreds of thousands of objects (modules, classes, functions), none of them garbage, and the
collector walks them again and again while they are made: about a sixth of a service's start-up CPU time. Each
entry point imports its heavy modules inside `imports_without_gc()`; the objects made there are then frozen out of
later collections (`gc.freeze`), so the collections a training step triggers do not walk them either.
"""

from __future__ import annotations

import gc
import os
import signal
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
