"""Regenerate rota-core's gRPC stubs from packages/core/proto.

The generated code is committed so that installing rota-core needs no compiler.
It is reproducible: the generator is pinned (GRPCIO_TOOLS below, also pinned in the
root pyproject's dev extra) and `tests/test_wire_names.py` checks the committed
stubs equal a fresh generation.

Usage: python scripts/gen_protos.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.metadata
import pathlib
import shutil
import sys
import tempfile

GRPCIO_TOOLS = "1.71.2"
ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "packages/core/proto"
OUT_ROOT = ROOT / "packages/core/src"
PACKAGE = "rota/_generated"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on every .proto under PROTO_ROOT into out_root; return the files made."""
    from grpc_tools import protoc  # dev-only dependency

    found = importlib.metadata.version("grpcio-tools")
    if found != GRPCIO_TOOLS:
        sys.exit(f"grpcio-tools {found} found, {GRPCIO_TOOLS} required: pip install grpcio-tools=={GRPCIO_TOOLS}")
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    return sorted((out_root / PACKAGE).glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs differ from a fresh generation")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp))
        stale = []
        for path in fresh:
            target = OUT_ROOT / PACKAGE / path.name
            if ns.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(target.name)
            else:
                shutil.copyfile(path, target)
        if stale:
            sys.exit(f"generated stubs are stale: {', '.join(stale)}; run python scripts/gen_protos.py")
    print("stubs up to date" if ns.check else f"wrote {len(fresh)} files under {OUT_ROOT / PACKAGE}")


if __name__ == "__main__":
    main()
