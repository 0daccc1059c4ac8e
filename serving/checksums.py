"""CRC-32 of a checkpoint's files, recorded as they are written and checked before a resume loads them.

Neither safetensors nor torch.load checks what it reads: a weight or optimizer file changed on disk (a bad sector, a
partial copy, a stray write) loads as it is, and the run then fails steps later for another reason (a corrupted
weight reads as a diverged model, a corrupted Adam moment as a learning-rate problem). The actor's and the critic's
checkpoints therefore record the CRC-32 of their weight and optimizer files (`CRC32_KEY` in their state JSON) and
compare them before loading. A checkpoint written before the sums were recorded is not checked.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

CRC32_KEY = "weights_crc32"  # kept from when only the weight files were summed: older checkpoints still check
_CHUNK = 1 << 24


def file_crc32(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def sums(directory: Path, patterns: tuple[str, ...]) -> dict[str, str]:
    """CRC-32 of every file under `directory` matching one of the glob `patterns`, by path relative to it."""
    files = sorted({p for pattern in patterns for p in directory.glob(pattern) if p.is_file()})
    return {str(p.relative_to(directory)): file_crc32(p) for p in files}


class _Crc32Writer:
    """A write-only file object that computes the CRC-32 of what passes through it (torch.save writes to any
    object with `write`), so a file just written need not be read back to sum it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.crc = f, 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_summed(obj: Any, path: Path) -> str:
    """torch.save(obj, path), returning the CRC-32 of the bytes written."""
    with path.open("wb") as f:
        writer = _Crc32Writer(f)
        torch.save(obj, writer)
    return f"{writer.crc:08x}"


def first_changed(directory: Path, wrote: object) -> str | None:
    """Of the files a checkpoint recorded (`wrote`: relative path -> CRC-32, as `sums` returns), the first that is
    missing or differs now, said in words; None when all match or nothing usable was recorded."""
    if not isinstance(wrote, dict):
        return None
    for name, crc in wrote.items():
        if Path(str(name)).is_absolute() or ".." in Path(str(name)).parts:
            return f"{name} is not a file inside the checkpoint"
        path = directory / str(name)
        found = file_crc32(path) if path.is_file() else None
        if found != crc:
            now = "is missing" if found is None else f"has CRC-32 {found}, where {crc} was written"
            return f"{name} is not the file the checkpoint wrote (it {now}): damaged on disk or changed since"
    return None


def recorded_change(directory: Path, state_file: str) -> str | None:
    """`first_changed` against the sums recorded in the checkpoint's own state JSON (`state_file`, under CRC32_KEY);
    None where that file cannot be read or records none (a checkpoint written before the sums were recorded: the
    caller's own reading of the state reports a broken file)."""
    try:
        wrote = json.loads((directory / state_file).read_text()).get(CRC32_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return first_changed(directory, wrote)
