"""A load parses a GGUF's headers once (``held_headers.headers_held``), and nothing lingers
after it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from kvserve.model import held_headers
from kvserve.model.gguf_names import open_gguf
from tests.quantization.test_lm_head import _write


def test_a_file_is_parsed_once_inside_and_every_time_outside(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", {"output.weight": (np.zeros((4, 32), np.float32), T.F32)})
    assert open_gguf(path) is not open_gguf(path)  # outside: nothing kept
    with held_headers.headers_held():
        first = open_gguf(path)
        assert open_gguf(tmp_path / "." / "m.gguf") is first  # the same file, another spelling
        with held_headers.headers_held():  # nested: the outer block's
            assert open_gguf(path) is first
        assert open_gguf(path) is first
        st = path.stat()  # the file changed: parsed again
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        assert open_gguf(path) is not first
        seen: list[object] = []
        other = threading.Thread(target=lambda: seen.append(open_gguf(path)))
        other.start()
        other.join()
        assert seen[0] is not open_gguf(path)  # another thread's loads do not share
    assert held_headers.held() is None
    assert [t.name for t in open_gguf(path).tensors] == ["output.weight"]
