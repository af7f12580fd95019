"""Generates the Python code of protos/ into the package tree.

Called by the build (setup.py's build_py), by `make proto`, and on import from a
source checkout whose generated code is older than its .proto files, so the
generated code can never be stale. The stamp records the sha256 of every .proto.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTOS = REPO / "protos"
STAMP = REPO / "feeder" / "v1" / ".generated"


def _proto_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.proto"))


def digest(root: Path = PROTOS) -> str:
    h = hashlib.sha256()
    for p in _proto_files(root):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def generate(root: Path = PROTOS, out: Path = REPO) -> None:
    from grpc_tools import protoc  # build-time dependency only
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    files = [str(p) for p in _proto_files(root)]
    rc = protoc.main(["protoc", f"-I{root}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", *files])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} on {files}")
    (out / "feeder" / "v1").mkdir(parents=True, exist_ok=True)
    (out / "feeder" / "v1" / ".generated").write_text(digest(root) + "\n")


def ensure_fresh() -> None:
    """Regenerate when running from a checkout whose protos changed."""
    if not PROTOS.is_dir() or os.environ.get("FEEDER_NO_PROTOGEN"):
        return
    want = digest()
    have = STAMP.read_text().strip() if STAMP.exists() else ""
    if have != want:
        generate()


if __name__ == "__main__":
    generate()
    print(f"generated protos into {REPO}/feeder", file=sys.stderr)
