"""Helpers for engine tests: tiny random-weight models saved as Hugging Face folders."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvserve.engine.llm_engine import LLMEngine
from kvserve.quantization.compressed_tensors import WeightScheme, part_weight, quantized_tensors
from kvserve.quantization.fusion import fuse_projections
from kvserve.quantization.qweight import QuantizedWeight
from kvserve.sampling_params import SamplingParams

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def make_tiny_model(arch: str, path: Path) -> PreTrainedModel:
    """A random tiny model of the given architecture, saved to ``path``, in float32."""
    torch.manual_seed(0)
    if arch == "llama":
        # Non-default theta and llama3 rope scaling exercise the config's rope parameters.
        cfg = LlamaConfig(
            **TINY,
            rope_theta=5000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model: PreTrainedModel = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY))
    elif arch == "qwen3":  # q/k norms, a head_dim that is not hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True))
    else:
        raise ValueError(arch)
    model.eval()
    model.save_pretrained(path)
    return model


def random_prompts(lengths: list[int], seed: int = 1, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 2 up: 0 and 1 are BOS/EOS of the tiny models.
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def run_engine_checked(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> dict[str, list[int]]:
    """Drive an engine to completion, checking KV integrity after every step (``params``:
    one for every prompt, or one per prompt)."""
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    for i, (p, sp) in enumerate(zip(prompts, each, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.kv.check_integrity()
    return done


class StubEngine:
    """What a ``RequestStream`` needs of its async engine: somewhere to send aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self._orphans: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Quantizer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor | None]]


def rewrite_projections(src: Path, dst: Path, quantize: Quantizer, qconfig: dict) -> dict:
    """``src``'s checkpoint copied to ``dst`` with every projection's ``weight`` replaced by
    the tensors ``quantize`` gives for it (named ``<module>.<key>``) and ``qconfig`` as its
    ``quantization_config``; returns each replaced weight's dequantized value (if given)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    out, weights = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module, leaf = name.rsplit(".", 1)
        if leaf == "weight" and module.split(".")[-1] in PROJ:
            tensors, weights[name] = quantize(t)
            out |= {f"{module}.{k}": v for k, v in tensors.items()}
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(cfg))
    return weights


def check_runs_as_dequantized(src: Path, path: Path, weights: dict, method: str) -> None:
    """The pre-quantized checkpoint at ``path`` (made from ``src``) gives exactly the tokens of
    ``src`` with ``weights`` (its dequantized projections) in place, with and without
    ``quantization=method``, through preemption, KV integrity checked at every step."""
    from kvserve.engine.llm import build_engine_config
    from kvserve.quantization.qlinear import QuantLinear

    dense_dir = path.parent / f"{path.name}-dense"
    dense_dir.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dense_dir / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors")) | weights
    save_file(state, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts([5, 9, 14, 3])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(p: Path, **kw: object) -> dict[str, list[int]]:
        cfg = build_engine_config(str(p), dtype="float32", block_size=4, num_kv_blocks=9, **kw)
        engine = LLMEngine(cfg)  # 9 blocks of 4 tokens for 4 requests: preemption
        out = run_engine_checked(engine, prompts, params)
        assert engine.stats()["num_preemptions"] > 0
        model = engine.runner.model
        quantized = isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
        assert quantized == (p == path)
        if quantized:
            assert model.quant_report.method == method
        return out

    dense = run(dense_dir)
    exact = "none"  # products with the dequantized weights (auto: int8 for 4-bit on AVX2)
    assert run(path, quantization_activations=exact) == dense
    assert run(path, quantization=method, quantization_activations=exact) == dense


def split_checkpoint(
    weights: dict[str, torch.Tensor], scheme: WeightScheme
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """A whole pre-quantized checkpoint in memory, split: (its dense weights, with every
    quantized module as its dequantized weight; the quantized projections fused as kvserve's
    modules name them). The loader streams instead (``CheckpointLinears``), through the same
    ``part_weight``; this whole-dict view is what tests compare with."""
    quantized = quantized_tensors(set(weights), scheme)
    taken = {name for leaves in quantized.values() for name in leaves.values()}
    dense = {name: t for name, t in weights.items() if name not in taken}
    found: dict[str, QuantizedWeight] = {}
    for module, leaves in quantized.items():
        qw = part_weight({leaf: weights[name] for leaf, name in leaves.items()}, scheme, module)
        dense[f"{module}.weight"] = qw.dequantize(torch.float32)
        if not module.endswith("lm_head"):
            found[module.removeprefix("model.")] = qw
    return dense, fuse_projections(found)
