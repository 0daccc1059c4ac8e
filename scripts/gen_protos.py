"""Regenerate the Python stubs in ppo_services/ from proto/ (the one command: `make protos`).

`--check` regenerates into a temporary folder and exits 1 if the committed stubs differ.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = "ppo_services"
DESCRIPTORS = "descriptors.binpb"


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto under proto/ into out_dir; returns the generated files (relative paths)."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        # with the comments: server reflection hands these to grpcurl and friends (serving/server.py)
        f"--descriptor_set_out={out_dir / PACKAGE / 'v1' / DESCRIPTORS}",
        "--include_source_info",
        *(str(p) for p in protos),
    ]
    (out_dir / PACKAGE / "v1").mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for pkg_dir in {p.parent for p in out_dir.rglob("*_pb2.py")}:
        rel = pkg_dir.relative_to(out_dir)
        for d in [rel, *rel.parents[:-1]]:  # every package level, not out_dir itself
            (out_dir / d / "__init__.py").touch()
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        files = generate(ROOT)
        print("\n".join(str(f) for f in files if f.parts[0] == PACKAGE))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f for f in fresh if not (ROOT / f).exists() or not filecmp.cmp(Path(tmp) / f, ROOT / f, shallow=False)]
    if stale:
        print("stale generated stubs (run `make protos`):", *map(str, stale), sep="\n  ")
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
