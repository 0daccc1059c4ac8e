"""Process start-up: the imports of torch, transformers and the model code without Python's cyclic garbage collector.

Those imports create hundreds of thousands of objects (modules, classes, functions), none of them garbage, and the
collector walks them again and again while they are made: about a sixth of a service's start-up CPU time. Each
entry point imports its heavy modules inside `imports_without_gc()`; the objects made there are then frozen out of
later collections (`gc.freeze`), so the collections a training step triggers do not walk them either.
"""

from __future__ import annotations

import gc
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
