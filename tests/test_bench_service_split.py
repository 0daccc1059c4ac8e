"""`python -m bench.service_split --quick` runs end to end and prints every measurement (its figures are not checked:
the quick run's tiny model says nothing about the targets)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.service_procs import ROOT


def test_quick_run_prints_every_measurement():
    result = subprocess.run([sys.executable, "-m", "bench.service_split", "--quick"], check=False, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"\d+ CPU cores .*torch \S+ with 2 threads in process and num_threads=2 on each server", out)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| measurement")]
    expected = [
        r"codec round trip, float32 \[64, 272\] .* GB/s \| >= 1 GB/s \| (pass|FAIL)",
        r"codec round trip, float32 \[64, 512\] .* GB/s \| >= 1 GB/s \| (pass|FAIL)",
        r"critic Infer 8 x 64: in-process forward .* ms",
        r"critic Infer 8 x 64: remote over loopback gRPC .* ms",
        r"critic Infer 8 x 64: the server.s forward within it .* ms",
        r"critic Infer 8 x 64: remote / in-process .*x \| <= 1.05x \| (pass|FAIL)",
        r"critic Infer 8 x 64: the split.s own cost, .*% \| <= 5% \| (pass|FAIL)",
        r"critic Infer 8 x 64: remote values vs in-process, largest difference \| \S+ \| <= 1e-4 \| pass",
    ]
    for rb, rs in ((1, 64), (1, 16)):
        what = rf"8 clients x \({rb} x {rs}\)"
        expected += [
            rf"in process, {what}: 8 forward passes .*x",
            rf"Infer throughput, {what}, batching on .* req/s",
            rf"Infer throughput, {what}, batching off .* req/s",
            rf"batching on, {what}: wall time a batch / the server.s compute time in it .* \| [\d.]+ / [\d.]+ ms",
            rf"Infer throughput gain of batching, {what} .*x \| >= 3x \| (pass|FAIL)",
            (rf"Infer throughput gain of batching, {what}, each client keeping 2 requests in flight \(median of 1 "
             r"rounds .* rows per batch\) \| [\d.]+x \([\d.]+ / [\d.]+ req/s\) \|  \|"),
        ]
    assert len(rows) == len(expected), out
    for row, pattern in zip(rows, expected, strict=True):
        assert re.search(pattern, row), (pattern, row)
    for row in rows:  # the server computes during part of each batch's wall time, never more
        if m := re.search(r"wall time a batch .* \| ([\d.]+) / ([\d.]+) ms", row):
            assert 0 < float(m[2]) <= float(m[1]), row
