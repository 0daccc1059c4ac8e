"""The `math_verify` scorer: Hugging Face's math-verify, called as NeMo-RL's math environment calls it, in worker
processes.

math-verify bounds its parsing and comparing with SIGALRM, which only a process's main thread may use, while the
reward server scores on its model thread. So samples go to worker processes (`verifier_worker`) that score on their
main thread with those timeouts; one that has not answered within `timeout_s` (a computation no signal interrupts,
an exact 10^(10^10)) is killed and replaced, and its sample scores 0.0, logged and counted.
"""

from __future__ import annotations

import json
import logging
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from .scorers import final_answer

log = logging.getLogger(__name__)

# The tail of a response that is parsed: the answer is at its end, and parsing is not linear in the text
RESPONSE_TAIL_CHARS = 16384
_MINUS = str.maketrans("\u2212", "-")  # a Unicode minus sign is a minus


def gold_text(label: str) -> str:
    """The label as math-verify's gold, in \\boxed{} as NeMo-RL passes it: its own \\boxed{...} or GSM8K '#### N'
    answer, else the whole label (NeMo-RL's data gives bare answers; GSM8K's `answer` ends with '#### N')."""
    answer = final_answer(label.translate(_MINUS), last_number=False)
    return "\\boxed{" + (answer or "") + "}"


def response_text(response: str) -> str:
    """The part of a response that is parsed: its last RESPONSE_TAIL_CHARS characters, a Unicode minus read as '-',
    and \\fbox as \\boxed (which math-verify does not read)."""
    return response[-RESPONSE_TAIL_CHARS:].translate(_MINUS).replace("\\fbox{", "\\boxed{")


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reward_server.verifier_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, encoding="utf-8", bufsize=1,
            start_new_session=True)  # its own session: a terminal's Ctrl-C reaches the server, which ends it
        self.ready = False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class MathVerifyPool:
    """`workers` processes scoring (response, label) pairs; `score` spreads a batch over them and waits."""

    def __init__(self, workers: int, timeout_s: float, on_timeout: Callable[[], None] = lambda: None,
                 start_timeout_s: float = 120.0):
        self.timeout_s, self.on_timeout = timeout_s, on_timeout
        self.timeouts = 0  # samples scored 0.0 because their worker did not answer in time
        self._lock = threading.Lock()
        self._workers = [_Worker() for _ in range(workers)]
        for worker in self._workers:  # started together, awaited in turn (each imports sympy: a second or two)
            self._await_ready(worker, start_timeout_s)

    @staticmethod
    def _await_ready(worker: _Worker, timeout_s: float) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(worker.proc.stdout, selectors.EVENT_READ)
            line = worker.proc.stdout.readline() if sel.select(timeout_s) else ""
        if line.strip() != json.dumps("ready"):
            worker.kill()
            raise RuntimeError(f"the math_verify worker did not start (is math-verify installed?); it said "
                               f"{line.strip()[:200]!r}")
        worker.ready = True

    def score(self, responses: list[str], labels: list[str]) -> list[float]:
        """1.0 or 0.0 for each response against its label."""
        with self._lock:
            return self._score(deque(enumerate(zip(responses, labels, strict=True))), len(responses))

    def _score(self, todo: deque, n: int) -> list[float]:
        scores = [0.0] * n
        idle = list(self._workers)
        busy: dict[object, tuple[_Worker, int, float]] = {}  # its stdout -> (worker, sample, deadline)
        with selectors.DefaultSelector() as sel:
            while todo or busy:
                while todo and idle:
                    worker = idle.pop()
                    i, (response, label) = todo.popleft()
                    worker.proc.stdin.write(json.dumps([response_text(response), gold_text(label)]) + "\n")
                    worker.proc.stdin.flush()
                    busy[worker.proc.stdout] = (worker, i, time.monotonic() + self.timeout_s)
                    sel.register(worker.proc.stdout, selectors.EVENT_READ)
                wait = max(0.0, min(deadline for _, _, deadline in busy.values()) - time.monotonic())
                for key, _ in sel.select(wait):
                    worker, i, _ = busy.pop(key.fileobj)
                    sel.unregister(key.fileobj)
                    line = worker.proc.stdout.readline()
                    if line:
                        scores[i] = float(json.loads(line))
                        idle.append(worker)
                    else:  # it died (killed from outside, say): replaced, and its sample scores 0
                        log.error("a math_verify worker exited (%s) while it scored a sample: replaced; the sample "
                                  "scores 0.0", worker.proc.wait())
                        idle.append(self._replace(worker))
                now = time.monotonic()
                for out, (worker, i, deadline) in list(busy.items()):
                    if deadline <= now:
                        del busy[out]
                        sel.unregister(out)
                        self.timeouts += 1
                        self.on_timeout()
                        log.warning("math_verify did not score a sample within %.1f s (math_verify.timeout_s): its "
                                    "worker is replaced and the sample scores 0.0 (%d so far)", self.timeout_s,
                                    self.timeouts)
                        idle.append(self._replace(worker))
        return scores

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker()
        self._workers[self._workers.index(worker)] = fresh
        self._await_ready(fresh, 120.0)
        return fresh

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
