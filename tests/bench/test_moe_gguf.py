"""``benchmarks/moe_gguf.py``: the Qwen3-30B-A3B-shaped Q8_0 GGUF written tensor by tensor
holds what llama.cpp's converter writes for a Qwen3-MoE (the same architecture metadata,
tensor names and shapes as ``tests/model/test_gguf_moe.py``'s writer, which
``test_gguf_llamacpp.py`` holds to the converter), its tensors are the seeded draws in Q8_0,
and the shape counts Qwen3-30B-A3B's published 30.5B / 3.3B parameters."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks import moe_gguf
from tests.model.test_gguf_moe import EPS, write_moe_gguf
from tests.model.tiny_moe import make_moe_model


def test_qwen3_30b_a3b_parameters() -> None:
    total, active = moe_gguf.QWEN3_30B_A3B.parameters()
    # 48 layers of (q/o 2 x 4096 x 2048, k/v 2 x 512 x 2048, 128 x 3 x 768 x 2048 experts,
    # the router and norms), embeddings and head of 151,936 x 2048: 30.5B, 3.3B active
    assert (total, active) == (30_532_122_624, 3_353_032_704)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(the test writer's F32 GGUF of a tiny Qwen3-MoE, moe_gguf's Q8_0 GGUF of its shape,
    the tiny model's config)."""
    work = tmp_path_factory.mktemp("moe_gguf")
    make_moe_model("qwen3_moe", work / "hf", rms_norm_eps=EPS)
    c = json.loads((work / "hf" / "config.json").read_text())
    ref = write_moe_gguf(work / "hf", "qwen3moe", work / "ref.gguf")
    shape = moe_gguf.GgufMoeShape(
        "tiny", c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
        c["num_key_value_heads"], c["head_dim"], c["num_local_experts"], c["num_experts_per_tok"],
        c["moe_intermediate_size"], c["intermediate_size"], vocab_size=c["vocab_size"],
        rope_theta=c["rope_parameters"]["rope_theta"], rms_norm_eps=c["rms_norm_eps"],
        context_length=c["max_position_embeddings"],
    )  # fmt: skip
    ours = moe_gguf.write_q8_0(shape, work / "ours.gguf", tokenizer_gguf=ref)
    return ref, ours, c


def _metadata(reader: gguf.GGUFReader, prefix: str) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)}


def test_written_like_the_converter(pair: tuple[Path, Path, dict]) -> None:
    ref_path, ours_path, c = pair
    ref, ours = gguf.GGUFReader(ref_path), gguf.GGUFReader(ours_path)
    assert ours.fields["general.architecture"].contents() == "qwen3moe"
    assert ours.fields["general.file_type"].contents() == moe_gguf.Q8_0_FILE_TYPE
    assert _metadata(ours, "qwen3moe.") == _metadata(ref, "qwen3moe.")
    assert _metadata(ours, "tokenizer.") == _metadata(ref, "tokenizer.")
    want = {t.name: t for t in ref.tensors}
    layers = moe_gguf.GgufMoeShape("t", 1, c["num_hidden_layers"], 1, 1, 1, 1, 1, 1, 1)
    assert [t.name for t in ours.tensors] == [n for n, _, _ in moe_gguf.tensors(layers)]
    assert set(want) == {t.name for t in ours.tensors}
    for t in ours.tensors:
        assert list(t.shape) == list(want[t.name].shape), t.name
        matrix = len(t.shape) >= 2 and "ffn_gate_inp" not in t.name
        assert t.tensor_type == (T.Q8_0 if matrix else T.F32), t.name
    # the first tensor drawn: the seeded normal(0, 0.02), quantized by gguf-py as written
    embd = next(t for t in ours.tensors if t.name == "token_embd.weight")
    draw = torch.randn(
        c["vocab_size"], c["hidden_size"], generator=torch.Generator().manual_seed(0)
    )
    assert np.array_equal(embd.data, gguf.quantize(draw.mul_(0.02).numpy(), T.Q8_0))
    norm = next(t for t in ours.tensors if t.name == "blk.1.attn_k_norm.weight")
    assert np.array_equal(norm.data, np.ones(c["head_dim"], dtype=np.float32))
    experts = next(t for t in ours.tensors if t.name == "blk.0.ffn_down_exps.weight")
    w = gguf.quants.dequantize(experts.data, T.Q8_0)  # [experts, hidden, moe_intermediate]
    assert w.shape == (c["num_local_experts"], c["hidden_size"], c["moe_intermediate_size"])
    assert 0.015 < float(w.std()) < 0.025  # normal(0, 0.02)
    assert not np.array_equal(w[0], w[1])  # each expert drawn apart


def test_seeded(pair: tuple[Path, Path, dict], tmp_path: Path) -> None:
    ref_path, ours_path, c = pair
    shape = moe_gguf.GgufMoeShape(
        "tiny", c["hidden_size"], 1, c["num_attention_heads"], c["num_key_value_heads"],
        c["head_dim"], c["num_local_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
        c["intermediate_size"], vocab_size=c["vocab_size"],
    )  # fmt: skip
    a = gguf.GGUFReader(moe_gguf.write_q8_0(shape, tmp_path / "a.gguf", ref_path))
    b = gguf.GGUFReader(ours_path)  # the same seed, one layer more: the first tensors agree
    first = {t.name: t for t in b.tensors}
    for t in a.tensors[:8]:
        assert np.array_equal(t.data, first[t.name].data), t.name


def test_hf_config_is_qwen3_moe() -> None:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig.from_dict(moe_gguf.hf_config(moe_gguf.QWEN3_30B_A3B))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (48, 4, 128)
    assert cfg.norm_topk_prob and not cfg.tie_word_embeddings


def test_moe_part_serves_the_q4_0_file_on_both_engines() -> None:
    from benchmarks import moe

    assert [(s.key, s.engine, s.gguf_type) for s in moe.QWEN3_SETTINGS] == [
        ("kvserve-gguf-q4_0-lmhead", "kvserve", "Q4_0"),
        ("llamacpp-q4_0", "llamacpp", "Q4_0"),
    ]
    want = {("kvserve-gguf-q4_0-lmhead", "llamacpp-q4_0", 1, 1.0),
            ("kvserve-gguf-q4_0-lmhead", "llamacpp-q4_0", 32, 2.0)}  # fmt: skip
    assert want <= set(moe.TARGETS)
    args = moe.build_parser().parse_args(["--parts", "qwen3-30b", "--qwen3-layers", "2"])
    assert (args.parts, args.qwen3_layers, args.concurrency) == ("qwen3-30b", 2, [1, 8, 32])
