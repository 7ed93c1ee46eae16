"""``python -m kvserve.ray.build_config [kvserve serve flags]``: a Serve config for them.

Prints (or writes with ``-o``) the YAML that ``serve run`` / ``serve deploy`` accept: the
HTTP address from ``--host``/``--port`` and one application whose ``import_path`` is
``kvserve.ray.app:build_openai_app`` and whose ``args`` are the flags given, by option name
(defaults left out). ``examples/ray_serve.yaml`` is such a file, annotated.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from kvserve.ray.options import serve_namespace

IMPORT_PATH = "kvserve.ray.app:build_openai_app"
# Flags that are about this process, not the application
_NOT_ARGS = {"command", "ray", "ray_address", "host", "port", "log_level", "no_access_log"}


def serve_config(argv: list[str]) -> dict[str, Any]:
    """The Serve config (a dict) for ``kvserve serve`` flags ``argv``."""
    from kvserve.server.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="python -m kvserve.ray.build_config")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *argv])
    defaults = vars(serve_namespace({}))
    given = {k: v for k, v in vars(args).items() if k not in _NOT_ARGS and defaults.get(k) != v}
    from kvserve.ray.app import build_from_namespace, ray_http_options

    build_from_namespace(args)  # every option checked now, not when Serve builds the app
    return {
        "proxy_location": "EveryNode",
        "http_options": ray_http_options(args),
        "applications": [
            {"name": "kvserve", "route_prefix": "/", "import_path": IMPORT_PATH, "args": given}
        ],
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "-o" in argv:
        i = argv.index("-o")
        out = argv[i + 1]
        del argv[i : i + 2]
    try:
        text = yaml.safe_dump(serve_config(argv), sort_keys=False)
    except ValueError as e:
        print(f"build_config: error: {e}", file=sys.stderr)
        return 2
    if out is None:
        sys.stdout.write(text)
    else:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
