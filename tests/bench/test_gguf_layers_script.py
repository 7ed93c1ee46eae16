"""``benchmarks/gguf_layers.py`` on a small file of its own: a Q6_K tensor reads as narrow
codes and gets three timed paths, a Q4_K one two."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from benchmarks import gguf_layers
from tests.quantization.test_a8_gguf_records import k_blocks
from tests.quantization.test_qlinear_a8_avx2 import needs_avx2


@needs_avx2
def test_q6_k_layer_gets_its_narrow_and_sign_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "two.gguf"
    writer = GGUFWriter(str(path), "llama")
    for name, qtype in (("output.weight", T.Q6_K), ("blk.0.ffn_up.weight", T.Q4_K)):
        blocks = k_blocks(qtype, 32, 512, 1)  # [32 * 2, bytes per block]
        writer.add_tensor(name, blocks.reshape(32, -1), raw_dtype=qtype)  # 32 rows of 512
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    argv = ["gguf_layers.py", str(path), "output.weight", "blk.0.ffn_up.weight",
            "--rows", "1,3", "--repeats", "1", "--threads", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    gguf_layers.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "output.weight: Q6_K 32 x 512, narrow codes"
    assert lines[3] == "blk.0.ffn_up.weight: Q4_K 32 x 512, full-range or 4-bit"

    def labels(line: str) -> list[str]:  # "   1 rows: int8 0.1 ms, float32 0.2 ms"
        return [cell.rsplit(" ", 2)[0] for cell in line.split(": ", 1)[1].split(", ")]

    assert labels(lines[1]) == labels(lines[2]) == ["int8", "int8 sign trick", "float32"]
    assert labels(lines[4]) == labels(lines[5]) == ["int8", "float32"]
