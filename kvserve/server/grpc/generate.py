"""Regenerate ``kvserve_pb2.py``, ``kvserve_pb2.pyi`` and ``kvserve_pb2_grpc.py`` from
``kvserve.proto``: ``python -m kvserve.server.grpc.generate`` (needs ``pip install grpcio-tools``).

protoc runs from the repository root, so the generated modules import each other as
``kvserve.server.grpc.kvserve_pb2`` and reflection names the file by its package path. The
generated code refuses older grpcio / protobuf runtimes than the generator's: keep the floors
in ``pyproject.toml`` at the versions printed here.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the folder holding the kvserve package


def main() -> int:
    try:
        from grpc_tools import protoc
    except ImportError:
        print("needs grpcio-tools: pip install grpcio-tools", file=sys.stderr)
        return 1
    proto = (HERE / "kvserve.proto").relative_to(ROOT)
    include = Path(protoc.__file__).parent / "_proto"  # protoc's well-known types
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        str(proto),
    ]
    code = int(protoc.main(args))
    if code == 0:
        print(
            f"generated from {proto} with grpcio-tools {version('grpcio-tools')} "
            f"(protobuf {version('protobuf')})"
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
