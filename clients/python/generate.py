#!/usr/bin/env python3
"""Regenerates (or, with ``--check``, verifies) the committed protobuf/gRPC stubs of
``kvpick_client`` from the repository's ``proto/kvpick/v1/selection.proto``.

The stubs are committed so that ``pip install clients/python`` needs no code generator; this script
is how they stay true. It copies the proto into the package (``_proto/selection.proto``, shipped
with it) and runs ``grpc_tools.protoc`` on that copy, so the generated modules import each other as
``kvpick_client._proto`` and the descriptor pool names the file
``kvpick_client/_proto/selection.proto`` (the protobuf package, ``kvpick.v1``, and so every gRPC
method path, is unchanged).

    python clients/python/generate.py          # rewrite the stubs after editing proto/
    python clients/python/generate.py --check  # exit 1 if a committed stub differs

``--check`` regenerates into a temporary directory and compares byte for byte (protoc's output is
deterministic for one ``grpcio-tools`` version: the one pinned in ``e2e/requirements.txt``).
``cargo test --test docs`` also fails when the proto copy differs from ``proto/``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SOURCE = REPO / "proto" / "kvpick" / "v1" / "selection.proto"
PACKAGE_DIR = Path("kvpick_client") / "_proto"
SRC = HERE / "src"
#: Every file the generator owns, relative to ``src/``.
OUTPUTS = ("selection.proto", "selection_pb2.py", "selection_pb2.pyi", "selection_pb2_grpc.py")


def generate(src_root: Path) -> None:
    """Writes the proto copy and its stubs below ``src_root/kvpick_client/_proto``."""
    from grpc_tools import protoc  # only the generator needs grpcio-tools

    out = src_root / PACKAGE_DIR
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SOURCE, out / "selection.proto")
    # protoc's own well-known types (none used today, but an import would need them).
    include = Path(protoc.__file__).resolve().parent / "_proto"
    argv = ["grpc_tools.protoc", f"-I{src_root}", f"-I{include}",
            f"--python_out={src_root}", f"--pyi_out={src_root}", f"--grpc_python_out={src_root}",
            str(PACKAGE_DIR / "selection.proto")]
    # protoc resolves the file against -I, not the working directory.
    code = protoc.main(argv)
    if code != 0:
        raise SystemExit(f"grpc_tools.protoc failed with exit code {code}")


def check() -> list[str]:
    """The committed files that differ from a fresh generation (empty when up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for name in OUTPUTS:
            fresh = (Path(tmp) / PACKAGE_DIR / name).read_bytes()
            committed = SRC / PACKAGE_DIR / name
            if not committed.exists() or committed.read_bytes() != fresh:
                stale.append(str(committed.relative_to(REPO)))
        return stale


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="verify the committed stubs instead of rewriting them")
    args = ap.parse_args()
    if args.check:
        stale = check()
        if stale:
            print("stale generated files (run `python clients/python/generate.py`):\n  "
                  + "\n  ".join(stale), file=sys.stderr)
            return 1
        print("kvpick_client stubs are up to date with proto/")
        return 0
    generate(SRC)
    print(f"regenerated {', '.join(OUTPUTS)} in {SRC / PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
