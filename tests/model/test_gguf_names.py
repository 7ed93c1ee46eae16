"""``gguf_names.HeaderReader``: gguf's own reader with plain-array reads gives the header
gguf's ``GGUFReader`` gives, field for field and tensor for tensor."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from kvserve.model.builtin import find_builtin_gguf
from kvserve.model.gguf_names import HeaderReader


def test_header_reader_reads_what_gguf_reads() -> None:
    """The built-in SmolLM2 GGUF (49,152 vocabulary strings and merges, 272 tensors): every
    field's name, types, parts and value, every tensor's name, type, shape, offsets and data
    (the first and last bytes of each) equal; and it is a plain ndarray, not a memmap."""
    path = find_builtin_gguf()
    want, got = GGUFReader(path), HeaderReader(path)
    assert list(got.fields) == list(want.fields) and len(want.fields) > 20
    for name, w in want.fields.items():
        g = got.fields[name]
        assert (g.offset, g.types, g.data) == (w.offset, w.types, w.data), name
        assert len(g.parts) == len(w.parts)
        for a, b in zip(g.parts, w.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert g.contents() == w.contents(), name
    assert len(got.tensors) == len(want.tensors) > 200
    for g, w in zip(got.tensors, want.tensors, strict=True):
        assert (g.name, g.tensor_type, g.data_offset, g.n_bytes, g.n_elements) == (
            w.name, w.tensor_type, w.data_offset, w.n_bytes, w.n_elements,
        )  # fmt: skip
        assert np.array_equal(g.shape, w.shape) and g.data.shape == w.data.shape
        assert np.array_equal(g.data.reshape(-1)[:64], w.data.reshape(-1)[:64])
        assert np.array_equal(g.data.reshape(-1)[-64:], w.data.reshape(-1)[-64:])
    assert type(got.tensors[0].data) is np.ndarray and isinstance(want.tensors[0].data, np.memmap)
    assert got.data_offset == want.data_offset and got.alignment == want.alignment


def test_transformers_gets_the_header_reader_for_one_call_only() -> None:
    """``gguf_metadata.write_tokenizer`` hands transformers' GGUF tokenizer builder the
    HeaderReader (it imports ``gguf.GGUFReader`` when called) and puts gguf's back after,
    even when the call fails."""
    import gguf

    from kvserve.model.gguf_metadata import _header_reader_for_transformers

    original = gguf.GGUFReader
    with _header_reader_for_transformers():
        from gguf import GGUFReader as seen  # what transformers' `from gguf import` gets

        assert seen is HeaderReader
    assert gguf.GGUFReader is original
    with pytest.raises(RuntimeError, match="boom"), _header_reader_for_transformers():
        raise RuntimeError("boom")
    assert gguf.GGUFReader is original
