"""A load's parsed file headers, kept for the load only.

A GGUF load parses the file's headers where it needs them (the layers' plan, the dense
weights, the LM head): gguf's reader took 5 s and 368 MB for each parse of a file with a
151,936-token vocabulary, 15.5 s of a 24.7 s Qwen3-0.6B Q4_K_M load. Inside ``headers_held``
(``loader.load_model`` runs in it) ``gguf_names.open_gguf`` parses a file once; outside it
every call parses, so nothing lingers after a load. Per thread: concurrent loads do not share.
This module imports nothing heavy (no gguf), so every load can enter it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_held = threading.local()


@contextlib.contextmanager
def headers_held() -> Iterator[None]:
    """Within the block (nested blocks share the outer one's), ``held()`` is a dict."""
    outer = getattr(_held, "files", None)
    if outer is None:
        _held.files = {}
    try:
        yield
    finally:
        if outer is None:
            _held.files = None


def held() -> dict[Any, Any] | None:
    """This thread's headers by key inside ``headers_held``, else None (parse every time)."""
    files: dict[Any, Any] | None = getattr(_held, "files", None)
    return files
