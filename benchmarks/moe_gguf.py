"""A random-weight Qwen3-30B-A3B-shaped GGUF for the MoE benchmark (issue 33), written tensor
by tensor, without a bf16 checkpoint.

Qwen3-30B-A3B has 30.5B parameters: its bf16 checkpoint (61 GB) and the BF16 GGUF llama.cpp's
converter writes from it do not fit this machine's disk (~45-55 GB free), but its Q4 files do
(~17 GB), and so do its int4 weights in 24 GB of memory. So :func:`write_q8_0` draws each
tensor alone from one seeded generator (float32 normal(0, 0.02), transformers' init; norms at
one) and writes it as GGUF Q8_0 (32.4 GB, gguf-py's quantizer: the blocks ggml's
``quantize_row_q8_0`` makes), with the metadata llama.cpp's ``convert_hf_to_gguf.py``
writes for ``Qwen3MoeForCausalLM`` (its keys checked against a converted tiny model in
``tests/bench/test_moe_gguf.py``) and the tokenizer of the Qwen3-0.6B-shaped benchmark
model's GGUF (SmolLM2's BPE padded to Qwen3's 151,936 tokens, as the converter wrote it).
llama.cpp's own ``llama-quantize --allow-requantize`` then makes the Q4_0 file both engines
serve (its default recipe: the LM head Q6_K, the router kept as written), and the Q8_0 file
is deleted. The router (``ffn_gate_inp``) is written float32, as llama-quantize keeps it.

    python benchmarks/moe_gguf.py               # bench-models/gguf/qwen3-30b-a3b-random
    python benchmarks/moe_gguf.py --layers 2    # the same shape, 2 layers: a smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.moe_model import INIT_STD  # noqa: E402
from benchmarks.peers import llamacpp  # noqa: E402

ARCH = "qwen3moe"
Q8_0_FILE_TYPE = 7  # llama_ftype MOSTLY_Q8_0


@dataclass(frozen=True)
class GgufMoeShape:
    """A Qwen3-MoE layout: every layer sparse, GQA attention with per-head q/k norms."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # config's dense size (unused: every layer is sparse)
    vocab_size: int = 151936
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    context_length: int = 40960
    seed: int = 0

    def parameters(self) -> tuple[int, int]:
        """(total, active per token) parameters, embeddings and LM head included."""
        total = active = 0
        for _, dims, _ in tensors(self):
            n = int(np.prod(dims))
            total += n
            active += n // self.num_experts * self.top_k if len(dims) == 3 else n
        return total, active


# Qwen/Qwen3-30B-A3B's config.json: 48 layers, 32 query / 4 KV heads of 128, 128 experts of 768
QWEN3_30B_A3B = GgufMoeShape("qwen3-30b-a3b", 2048, 48, 32, 4, 128, 128, 8, 768, 6144)


def tensors(shape: GgufMoeShape) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, numpy shape: [experts,] rows, cols, is_norm) in the converter's names."""
    h, v, hd = shape.hidden_size, shape.vocab_size, shape.head_dim
    q, kv, e, f = shape.num_attention_heads * hd, shape.num_key_value_heads * hd, \
        shape.num_experts, shape.moe_intermediate_size  # fmt: skip
    yield "token_embd.weight", (v, h), False
    yield "output_norm.weight", (h,), True
    yield "output.weight", (v, h), False
    for i in range(shape.num_hidden_layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (h,), True
        yield p + "attn_q.weight", (q, h), False
        yield p + "attn_k.weight", (kv, h), False
        yield p + "attn_v.weight", (kv, h), False
        yield p + "attn_output.weight", (h, q), False
        yield p + "attn_q_norm.weight", (hd,), True
        yield p + "attn_k_norm.weight", (hd,), True
        yield p + "ffn_norm.weight", (h,), True
        yield p + "ffn_gate_inp.weight", (e, h), False
        yield p + "ffn_gate_exps.weight", (e, f, h), False
        yield p + "ffn_up_exps.weight", (e, f, h), False
        yield p + "ffn_down_exps.weight", (e, h, f), False


def is_q8_0(name: str, dims: tuple[int, ...]) -> bool:
    """Matrices are Q8_0; norms and the router float32 (llama-quantize keeps the router)."""
    return len(dims) >= 2 and "ffn_gate_inp" not in name


def tokenizer_fields(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array sub-type) of every ``tokenizer.*`` field of a GGUF."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, field in GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def write_q8_0(shape: GgufMoeShape, out: Path, tokenizer_gguf: Path) -> Path:
    """Write ``shape`` as a Q8_0 GGUF at ``out`` (under a temporary name, then renamed)."""
    import gguf
    import torch

    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    w.add_name(f"{shape.name} random")
    w.add_file_type(Q8_0_FILE_TYPE)
    w.add_block_count(shape.num_hidden_layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.hidden_size)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_attention_heads)
    w.add_head_count_kv(shape.num_key_value_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_expert_count(shape.num_experts)
    w.add_expert_used_count(shape.top_k)
    w.add_expert_feed_forward_length(shape.moe_intermediate_size)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        w.add_key_value(key, value, vtype, sub_type=sub)
    plan = list(tensors(shape))
    for name, dims, _ in plan:
        if is_q8_0(name, dims):
            byte_dims = gguf.quant_shape_to_byte_shape(dims, Q8_0)
            w.add_tensor_info(name, byte_dims, np.dtype(np.uint8), int(np.prod(byte_dims)), Q8_0)
        else:
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(shape.seed)
    for name, dims, is_norm in plan:
        if is_norm:
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        if not is_q8_0(name, dims):
            x = torch.randn(dims, generator=gen).mul_(INIT_STD)
            w.write_tensor_data(x.numpy())
            continue
        data = np.empty(gguf.quant_shape_to_byte_shape(dims, Q8_0), dtype=np.uint8)
        if len(dims) == 2:
            data[:] = gguf.quantize(torch.randn(dims, generator=gen).mul_(INIT_STD).numpy(), Q8_0)
        for e in range(dims[0] if len(dims) == 3 else 0):  # one expert at a time
            x = torch.randn(dims[1:], generator=gen).mul_(INIT_STD)
            data[e] = gguf.quantize(x.numpy(), Q8_0)
        w.write_tensor_data(data)
    w.close()
    tmp.rename(out)
    return out


def hf_config(shape: GgufMoeShape) -> dict[str, Any]:
    """config.json as ``Qwen3MoeConfig`` writes it: the benchmark sizes KV space from it."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        num_experts=shape.num_experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True,
        rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps,
        max_position_embeddings=shape.context_length, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg.to_dict()


def ensure_q4_0(
    build: llamacpp.LlamaCppBuild, shape: GgufMoeShape, tokenizer_gguf: Path, tokenizer_dir: Path
) -> tuple[Path, Path]:
    """(folder, the Q4_0 GGUF) of ``shape``, made once: the Q8_0 file is written,
    llama-quantize'd to Q4_0, and deleted. The folder also holds config.json and the
    tokenizer files of ``tokenizer_dir`` (the benchmark client's and KV sizing's)."""
    folder = llamacpp.bench_models_dir() / "gguf" / f"{shape.name}-random"
    folder.mkdir(parents=True, exist_ok=True)
    q4 = folder / "model-Q4_0.gguf"
    if not q4.is_file():
        build.check()
        q8 = folder / "model-Q8_0.gguf"
        if not q8.is_file():
            write_q8_0(shape, q8, tokenizer_gguf)
        llamacpp.quantize(build, q8, q4, "Q4_0", pure=False, requantize=True)
        q8.unlink()
    (folder / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, folder / name)
    return folder, q4


def main(argv: list[str] | None = None) -> int:
    from benchmarks import quantization as q

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke test)")
    ap.add_argument("--llamacpp-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    shape = QWEN3_30B_A3B
    if args.layers:
        shape = replace(shape, name=f"{shape.name}-{args.layers}l", num_hidden_layers=args.layers)
    total, active = shape.parameters()
    print(f"{shape.name}: {total / 1e9:.2f}B total, {active / 1e9:.2f}B active", flush=True)
    build = llamacpp.LlamaCppBuild(args.llamacpp_dir or llamacpp.DEFAULT_ROOT)
    qwen3 = q.resolve_model("qwen3-0.6b", None)
    tok = llamacpp.ensure_ggufs(build, qwen3.path, ("Q4_K_M",), pre_tokenizer=qwen3.pre_tokenizer)
    print(ensure_q4_0(build, shape, tok["Q4_K_M"], qwen3.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
