"""The `math_verify` scorer: Hugging Face's math-verify, called as NeMo-RL's math environment calls it, in worker
processes.

math-verify bounds its parsing and comparing with SIGALRM, which only a process's main thread may use, while the
reward server scores on its model thread. So samples go to worker processes (`verifier_worker`) that score on their
main thread with those timeouts; one that has not answered within `timeout_s` (a computation no signal interrupts,
an exact 10^(10^10)) is killed, and its sample scores 0.0, logged and counted. A worker that is gone (killed, or
killed for its time) is started again when it is next needed; a sample whose worker died before answering is sent
to another.
"""

from __future__ import annotations

import atexit
import json
import logging
import selectors
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable

from serving.errors import ServiceError
from serving.rest import Throttle

from .scorers import final_answer

log = logging.getLogger(__name__)

# The tail of a response that is parsed: the answer is at its end, and parsing is not linear in the text
RESPONSE_TAIL_CHARS = 16384
START_TIMEOUT_S = 60.0  # a worker imports math-verify and sympy: a second or two
_MINUS = str.maketrans("\u2212", "-")  # a Unicode minus sign is a minus


def gold_text(label: str) -> str:
    """The label as math-verify's gold, in \\boxed{} as NeMo-RL passes it: its own \\boxed{...} or GSM8K '#### N'
    answer, else the whole label (NeMo-RL's data gives bare answers; GSM8K's `answer` ends with '#### N')."""
    answer = final_answer(label.translate(_MINUS), last_number=False)
    return "\\boxed{" + (answer or "") + "}"


def response_text(response: str) -> str:
    """The part of a response that is parsed: its last RESPONSE_TAIL_CHARS characters, or as many from its last
    \\boxed{ (or \\fbox{) where that lies before them (a boxed answer followed by a long check), a Unicode minus read as
    '-', and \\fbox as \\boxed (which math-verify does not read)."""
    start = max(0, len(response) - RESPONSE_TAIL_CHARS)
    if start and (boxed := max(response.rfind("\\boxed{"), response.rfind("\\fbox{"))) != -1:
        start = min(start, boxed)
    return response[start:start + RESPONSE_TAIL_CHARS].translate(_MINUS).replace("\\fbox{", "\\boxed{")


class _Worker:
    """One worker process; `ready()` waits until it says it is ready (a ServiceError when it cannot start)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reward_server.verifier_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, encoding="utf-8", bufsize=1,
            start_new_session=True)  # its own session: a terminal's Ctrl-C reaches the server, which ends it

    def ready(self) -> _Worker:
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(START_TIMEOUT_S) else ""
        if line.strip() != json.dumps("ready"):
            self.kill()
            said = json.loads(line) if line.startswith("{") else {"error": line.strip()[:200] or "nothing"}
            raise ServiceError(f"a math_verify worker process cannot start: {said.get('error')}")
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, response: str, label: str) -> bool:
        """Send one sample; False when the process is gone."""
        try:
            self.proc.stdin.write(json.dumps([response_text(response), gold_text(label)]) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):  # ValueError: its pipe closed by kill()
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a write left in the buffer of a pipe whose reader is gone
                pass


class MathVerifyPool:
    """`workers` processes scoring (response, label) pairs; `score` spreads a batch over them and waits. Called from
    one thread at a time (the server's model thread)."""

    def __init__(self, workers: int, timeout_s: float, on_timeout: Callable[[int], None] = lambda n: None,
                 batch_timeout_s: float = float("inf")):
        self.timeout_s, self.on_timeout, self.batch_timeout_s = timeout_s, on_timeout, batch_timeout_s
        self.timeouts = 0  # samples scored 0.0 because their worker did not answer in time, or their batch ran out
        self._said = Throttle(60.0)  # a timeout's warning at most once a minute: the count says the rest
        # started side by side (each imports sympy), at load, so a missing math-verify stops the server before ready
        self._slots: list[_Worker | None] = [_Worker() for _ in range(workers)]
        for worker in self._slots:
            worker.ready()
        atexit.register(self.close)  # at exit, not left scoring a sample for a server that is gone

    def _worker(self, slot: int) -> _Worker:
        """The slot's worker, started again if it is gone (retired here, or exited by itself)."""
        if (worker := self._slots[slot]) is not None and not worker.alive():
            log.warning("a math_verify worker process had exited (%s): starting another", worker.proc.returncode)
            self._retire(slot)
        if self._slots[slot] is None:
            self._slots[slot] = _Worker().ready()
        return self._slots[slot]

    def _retire(self, slot: int) -> None:
        """Kill the slot's worker; the next sample for the slot starts another."""
        self._slots[slot].kill()
        self._slots[slot] = None

    def score(self, responses: list[str], labels: list[str],
              abandoned: Callable[[], bool] = lambda: False) -> list[float]:
        """1.0 or 0.0 for each response against its label. Once `abandoned()` (every caller gone), no further sample
        is sent: the rest score 0.0, for nobody. Past `batch_timeout_s` no further sample is sent either: the rest
        score 0.0, counted as timeouts (those being scored then still get their own time)."""
        scores = [0.0] * len(responses)
        todo = deque(enumerate(zip(responses, labels, strict=True)))
        idle = list(range(len(self._slots)))
        busy: dict[object, tuple[int, int, tuple[str, str], float]] = {}  # stdout -> (slot, sample, pair, deadline)
        lost: set[int] = set()  # samples whose worker died under them once: a second death scores them 0.0
        sel = selectors.DefaultSelector()
        batch_deadline = time.monotonic() + self.batch_timeout_s
        try:
            while todo or busy:
                if todo and abandoned():
                    log.info("math_verify: the callers of this batch are gone; %d of its samples are not scored",
                             len(todo))
                    todo.clear()
                if todo and time.monotonic() >= batch_deadline:
                    self.timeouts += len(todo)
                    self.on_timeout(len(todo))
                    log.warning("math_verify: a batch of %d samples took longer than %.0f s "
                                "(math_verify.batch_timeout_s): its %d samples not yet sent score 0.0 (%d so far)",
                                len(responses), self.batch_timeout_s, len(todo), self.timeouts)
                    todo.clear()
                while todo and idle:
                    slot = idle.pop()
                    worker = self._worker(slot)
                    i, pair = todo.popleft()
                    if not worker.send(*pair):  # it died since: the next round starts another for the sample
                        todo.appendleft((i, pair))
                        idle.append(slot)
                        continue
                    busy[worker.proc.stdout] = (slot, i, pair, time.monotonic() + self.timeout_s)
                    sel.register(worker.proc.stdout, selectors.EVENT_READ)
                if not busy:
                    continue
                wait = max(0.0, min(min(deadline for *_, deadline in busy.values()),
                                    batch_deadline if todo else float("inf")) - time.monotonic())
                for key, _ in sel.select(wait):
                    slot, i, pair, _ = busy.pop(key.fileobj)
                    sel.unregister(key.fileobj)
                    idle.append(slot)
                    line = key.fileobj.readline()
                    if line:
                        scores[i] = float(json.loads(line))
                    elif i not in lost:  # it died while it scored (killed from outside, say): sent to another
                        log.error("a math_verify worker process exited while it scored a sample: sending it again")
                        lost.add(i)
                        todo.appendleft((i, pair))
                    else:  # the sample kills its workers
                        log.error("math_verify workers exited twice while they scored one sample: it scores 0.0")
                now = time.monotonic()
                for out, (slot, i, _, deadline) in list(busy.items()):
                    if deadline <= now:
                        del busy[out]
                        sel.unregister(out)
                        self._retire(slot)
                        idle.append(slot)
                        self.timeouts += 1
                        self.on_timeout(1)
                        if self._said.admit("timeout") is not None:
                            log.warning("math_verify did not score a sample within %.1f s (math_verify.timeout_s): "
                                        "it scores 0.0 and its worker process is replaced (%d so far; this warning "
                                        "comes at most once a minute)", self.timeout_s, self.timeouts)
        finally:  # a failure mid-batch: no worker keeps an answer nobody reads, which the next batch would take
            for slot, *_ in busy.values():
                self._retire(slot)
            sel.close()
        return scores

    def close(self) -> None:
        for worker in self._slots:
            if worker is not None:
                worker.kill()
