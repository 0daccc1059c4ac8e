"""One `math_verify` worker process (reward_server.verifier starts them): JSON lines in, JSON lines out.

Each line read is `[response, gold]`; each line written is the score, 1.0 or 0.0. It scores on this process's main
thread, where math-verify's own SIGALRM timeouts work (they refuse other threads). It imports math-verify and nothing
of torch, and ends when its input closes (the server gone, however it went).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys

# Parsing and comparing are each bounded by math-verify's own timeout; the server kills a worker that does not
# answer within its timeout_s (a computation no signal interrupts, such as an exact 10^(10^10))
PARSE_TIMEOUT_S = 1
VERIFY_TIMEOUT_S = 1
MEMORY_LIMIT_BYTES = 2 << 30  # a runaway expansion is a MemoryError here, not the host's memory


def main() -> None:
    # the answers go out on a descriptor of their own: whatever a library prints (to sys.stdout or to descriptor 1)
    # goes nowhere, where it would be read as a sample's answer
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - for the process's life
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs whole responses at every failure
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as e:
        print(json.dumps({"error": f"{e} (pip install math-verify)"}), file=replies)
        return

    # NeMo-RL's math environment: the gold as LaTeX, the response as a plain expression or LaTeX
    gold_config, response_config = (LatexExtractionConfig(),), (ExprExtractionConfig(), LatexExtractionConfig())
    print(json.dumps("ready"), file=replies)
    try:
        for line in sys.stdin:
            response, gold = json.loads(line)
            try:
                expected = parse(gold, gold_config, parsing_timeout=PARSE_TIMEOUT_S)
                got = parse(response, response_config, parsing_timeout=PARSE_TIMEOUT_S)
                score = float(bool(expected) and verify(expected, got, timeout_seconds=VERIFY_TIMEOUT_S))
            except BaseException:  # noqa: BLE001 - its TimeoutException is no Exception; any failure scores 0
                score = 0.0
            print(json.dumps(score), file=replies)
    except BrokenPipeError:  # the server is gone: nothing to flush to either
        os._exit(0)


if __name__ == "__main__":
    main()
