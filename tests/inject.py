"""Fault injection for tests: run a service module as `python -m <module>` would, but SIGKILL the process just before
the Nth call of one of its functions, to crash it at a precise point (the real server otherwise, unchanged).

    python tests/inject.py critic_server.core:CriticCore.save:2 critic_server --port ... [its arguments]
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import signal
import sys
from pathlib import Path


def kill_before_call(spec: str) -> None:
    """`module:Qualified.name:N`: the Nth call of that function kills the process before it runs."""
    module, qualname, n = spec.split(":")
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls = getattr(owner, name), [0]

    @functools.wraps(original)
    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(n):
            print(f"inject: SIGKILL before call {n} of {qualname}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, counted)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    spec, target, *rest = sys.argv[1:]
    kill_before_call(spec)
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
