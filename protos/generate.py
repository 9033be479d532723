"""Regenerate (or check) the Python code for protos/meshrl/v1/*.proto.

    python protos/generate.py          # write meshrl/v1/*_pb2*.py beside the protos
    python protos/generate.py --check  # exit 1 if the committed code is stale

Pinned to grpcio-tools 1.84.0: its stubs load with grpcio >= 1.84 (the GPU
machines run 1.84.0; stubs from 1.85 refuse to load there).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PINNED_GRPCIO_TOOLS = "1.84.0"
PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "meshrl" / "v1"


def generate(out_dir: Path) -> list[Path]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("grpcio-tools")
    except PackageNotFoundError:
        installed = "not"
    if installed != PINNED_GRPCIO_TOOLS:
        sys.exit(f"grpcio-tools {installed} installed; pip install grpcio-tools=={PINNED_GRPCIO_TOOLS} "
                 "(or the project's test extra: pip install -e '.[test]')")

    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(p) for p in protos]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    return sorted((out_dir / "meshrl" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code differs")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(PACKAGE_DIR.glob("*_pb2*.py*"))
        stale = [f.name for f in fresh if not (PACKAGE_DIR / f.name).exists()
                 or not filecmp.cmp(f, PACKAGE_DIR / f.name, shallow=False)]
        extra = sorted({c.name for c in committed} - {f.name for f in fresh})
        if check:
            if stale or extra:
                sys.exit(f"generated code is stale: {stale + extra}; run python protos/generate.py")
            print(f"generated code is fresh ({len(fresh)} files)")
            return
        for name in extra:
            (PACKAGE_DIR / name).unlink()
        for f in fresh:
            shutil.copy(f, PACKAGE_DIR / f.name)
        print(f"wrote {len(fresh)} files to {PACKAGE_DIR}")


if __name__ == "__main__":
    main()
