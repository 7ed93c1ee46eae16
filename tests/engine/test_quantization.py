"""Quantized models through the whole engine: the same tokens as their dequantized weights,
under preemption and prefix caching, with KV integrity checked after every step."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.quantization.lm_head import QuantLMHead
from kvserve.quantization.qlinear import QuantLinear, _a8_kernel, reference_linear_a8
from kvserve.quantization.qweight import quantize_rtn
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import random_prompts, run_engine_checked

PROMPTS = random_prompts([3, 7, 12, 5, 20, 9, 1, 15])
PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4, **kw))


def dequantized_copy(
    src: Path, dst: Path, bits: int, group: int | None, lm_head: bool = False
) -> Path:
    """``src`` with every projection (and with ``lm_head`` the LM head, int8 per row)
    replaced by its round-to-nearest dequantized weight.

    Groups run along each row, so quantizing q, k and v apart equals quantizing the fused
    QKV the engine builds: this folder holds exactly the weights the quantized engine uses.
    """
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    for name, w in state.items():
        if name.split(".")[-2] in PROJ:
            state[name] = quantize_rtn(w, bits, group).dequantize(torch.float32)
        if lm_head and name == "lm_head.weight":
            state[name] = quantize_rtn(w, 8, None).dequantize(torch.float32)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("method", "bits", "group"), [("int8", 8, None), ("int4", 4, 32)])
def test_quantized_engine_equals_its_dequantized_weights(
    tiny_llama: Path, tmp_path: Path, method: str, bits: int, group: int | None
) -> None:
    want = run_engine_checked(
        engine(dequantized_copy(tiny_llama, tmp_path / "dq", bits, group), num_kv_blocks=200),
        PROMPTS, PARAMS,
    )  # fmt: skip
    # exact products with the dequantized weights: float activations (auto would quantize
    # int4's to int8 on an AVX2 CPU without VNNI)
    e = engine(tiny_llama, num_kv_blocks=200, quantization=method,
               quantization_activations="none")  # fmt: skip
    layer = e.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, QuantLinear) and layer.bits == bits and layer.use_kernel
    assert run_engine_checked(e, PROMPTS, PARAMS) == want
    # and quantization did change the model: the unquantized tokens differ
    assert run_engine_checked(engine(tiny_llama, num_kv_blocks=200), PROMPTS, PARAMS) != want


@pytest.mark.parametrize(("policy", "mode"), [("preempt", "recompute"), ("preempt", "swap")])
def test_quantized_engine_under_preemption(tiny_llama: Path, policy: str, mode: str) -> None:
    roomy = run_engine_checked(engine(tiny_llama, num_kv_blocks=200, quantization="int4"),
                               PROMPTS, PARAMS)  # fmt: skip
    e = engine(tiny_llama, num_kv_blocks=14, kv_policy=policy, preemption_mode=mode,
               quantization="int4")  # fmt: skip
    assert run_engine_checked(e, PROMPTS, PARAMS) == roomy
    assert e.stats()["num_preemptions"] > 0


def test_quantized_engine_with_prefix_caching(tiny_llama: Path) -> None:
    shared = random_prompts([24], seed=7)[0]
    prompts = [shared + p for p in random_prompts([3, 5, 8, 2], seed=8)]
    off = run_engine_checked(
        engine(tiny_llama, num_kv_blocks=200, quantization="int8", enable_prefix_caching=False),
        prompts, PARAMS,
    )  # fmt: skip
    e = engine(tiny_llama, num_kv_blocks=200, quantization="int8")
    first = run_engine_checked(e, prompts[:1], PARAMS)
    rest = run_engine_checked(e, prompts[1:], PARAMS)
    assert first["0"] == off["0"]
    assert [rest[str(i)] for i in range(3)] == [off[str(i)] for i in range(1, 4)]
    assert e.stats()["prefix_cache_hits"] >= 3 * 24


def test_bad_quantization_options(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        build_engine_config(str(tiny_llama), quantization="fp8")
    with pytest.raises(ValueError, match=r"needs a \.gguf model file"):
        build_engine_config(str(tiny_llama), quantization="gguf")
    with pytest.raises(ValueError, match="goes with --quantization int8 or int4"):
        build_engine_config(str(tiny_llama), quantization_group_size=32)
    with pytest.raises(ValueError, match=r"cannot quantize layers\.0\.self_attn\.qkv_proj: .*"
                                         r"group size 48 must be even and divide"):  # fmt: skip
        engine(tiny_llama, quantization="int4", quantization_group_size=48)


def test_transformers_backend_quantizes_the_same_weights(tiny_llama: Path) -> None:
    """int4 on transformers' own Llama (unfused q/k/v) gives the native int4 tokens: groups
    run along rows, so quantizing the parts equals quantizing their fusion."""
    native = run_engine_checked(engine(tiny_llama, num_kv_blocks=200, quantization="int4"),
                                PROMPTS, PARAMS)  # fmt: skip
    e = engine(tiny_llama, num_kv_blocks=200, quantization="int4", model_impl="transformers")
    assert sum(isinstance(m, QuantLinear) for m in e.runner.model.modules()) == 2 * 7
    assert run_engine_checked(e, PROMPTS, PARAMS) == native


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.mark.skipif(not _a8_kernel(), reason="needs AVX512-VNNI and AVX512-BF16")
def test_int8_activation_kernel_gives_its_reference_tokens(tiny_llama: Path) -> None:
    """bf16 int4 with int8 activations (the default on VNNI CPUs) through the whole engine:
    the same tokens as the same engine whose quantized layers run the pure-PyTorch reference
    (quantize x per 32, float64 product) on the checkpoint's weights quantized apart; and
    --quantization-activations none takes the other kernel."""

    def bf16(**kw: object) -> LLMEngine:
        cfg = build_engine_config(str(tiny_llama), dtype="bfloat16", block_size=4,
                                  quantization="int4", num_kv_blocks=200, **kw)  # fmt: skip
        return LLMEngine(cfg)

    fast = bf16()
    assert fast.runner.model.quant_report.int8_activations is True
    want = run_engine_checked(fast, PROMPTS, PARAMS)
    ref = bf16()
    state = load_file(str(tiny_llama / "model.safetensors"))
    patched = 0
    for name, module in ref.runner.model.named_modules():
        if isinstance(module, QuantLinear):
            assert module.path == "a8"
            prefix, attr = name.rsplit(".", 1)
            w = torch.cat([state[f"model.{prefix}.{p}.weight"] for p in FUSED.get(attr, (attr,))])
            qw = quantize_rtn(w.bfloat16(), 4, 32)
            module.forward = functools.partial(reference_linear_a8, qw=qw)  # type: ignore[method-assign]
            patched += 1
    assert patched == 2 * 4
    assert run_engine_checked(ref, PROMPTS, PARAMS) == want
    none = bf16(quantization_activations="none")
    assert none.runner.model.layers[0].mlp.down_proj.path == "kernel"
    assert none.runner.model.quant_report.int8_activations is False


def _a8_avx2() -> bool:
    from kvserve.quantization.qlinear import _a8_avx2

    return _a8_avx2()


@pytest.mark.skipif(not _a8_avx2(), reason="needs the AVX2 build of the kernels")
def test_float32_int8_activations_give_their_reference_tokens(tiny_llama: Path) -> None:
    """float32 int4 with --quantization-activations int8 (the AVX2 vpmaddubsw path) through
    the whole engine, C++ decode loop included where it runs: the tokens of the same engine
    whose quantized layers run reference_linear_a8. auto takes it on a CPU without VNNI (int4
    codes there), keeps float32 activations beside the VNNI kernel; none keeps them always
    (other tokens)."""

    def f32(**kw: object) -> LLMEngine:
        cfg = build_engine_config(str(tiny_llama), dtype="float32", block_size=4,
                                  quantization="int4", num_kv_blocks=200, **kw)  # fmt: skip
        return LLMEngine(cfg)

    fast = f32(quantization_activations="int8")
    assert fast.runner.model.quant_report.int8_activations is True
    want = run_engine_checked(fast, PROMPTS, PARAMS)
    ref = f32(quantization_activations="int8")
    state = load_file(str(tiny_llama / "model.safetensors"))
    for name, module in ref.runner.model.named_modules():
        if isinstance(module, QuantLinear):
            assert module.path == "a8"
            prefix, attr = name.rsplit(".", 1)
            w = torch.cat([state[f"model.{prefix}.{p}.weight"] for p in FUSED.get(attr, (attr,))])
            qw = quantize_rtn(w.float(), 4, 32)
            module.forward = functools.partial(reference_linear_a8, qw=qw)  # type: ignore[method-assign]
    assert run_engine_checked(ref, PROMPTS, PARAMS) == want
    none = f32(quantization_activations="none")
    assert none.runner.model.quant_report.int8_activations is False
    assert none.runner.model.quant_report.int8_layers == 0
    # the 8-bit activations' rounding shows in the tokens: the test sees which path ran
    assert run_engine_checked(none, PROMPTS, PARAMS) != want
    auto = f32()
    avx2_only = not _a8_kernel()
    report = auto.runner.model.quant_report
    assert report.int8_activations is avx2_only
    assert report.int8_layers == (report.layers if avx2_only else 0)
    assert (run_engine_checked(auto, PROMPTS, PARAMS) == want) is avx2_only


def test_quantized_lm_head_engine_equals_its_dequantized_weights(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """--quantization-lm-head: an int4 engine whose LM head is int8 gives the tokens of its
    dequantized weights, LM head included, through preemption-free batching with KV integrity
    checked; the head's rounding is seen in the tokens (they differ from int4 alone)."""
    copy = dequantized_copy(tiny_llama, tmp_path / "dq", 4, 32, lm_head=True)
    want = run_engine_checked(engine(copy, num_kv_blocks=200), PROMPTS, PARAMS)
    exact = {"quantization_activations": "none"}  # auto: int8 for int4 on AVX2 without VNNI
    e = engine(tiny_llama, num_kv_blocks=200, quantization="int4", quantization_lm_head=True,
               **exact)  # fmt: skip
    assert isinstance(e.runner.model.lm_head, QuantLMHead)
    assert run_engine_checked(e, PROMPTS, PARAMS) == want
    int4 = engine(tiny_llama, num_kv_blocks=200, quantization="int4", **exact)
    assert run_engine_checked(int4, PROMPTS, PARAMS) != want


def test_quantized_lm_head_needs_quantization(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="quantization_lm_head quantizes the LM head"):
        build_engine_config(str(tiny_llama), quantization_lm_head=True)


@pytest.mark.skipif(not _a8_kernel(), reason="needs AVX512-VNNI and AVX512-BF16")
def test_int8_activation_lm_head_gives_its_reference_tokens(tiny_llama: Path) -> None:
    """bf16, int8 activations: the quantized LM head's kernel gives the tokens of the same
    engine whose head runs the pure-PyTorch reference on the checkpoint's head rounded apart."""

    def bf16() -> LLMEngine:
        cfg = build_engine_config(str(tiny_llama), dtype="bfloat16", block_size=4,
                                  quantization="int4", quantization_lm_head=True,
                                  num_kv_blocks=200)  # fmt: skip
        return LLMEngine(cfg)

    fast = bf16()
    want = run_engine_checked(fast, PROMPTS, PARAMS)
    ref = bf16()
    head = ref.runner.model.lm_head
    assert isinstance(head, QuantLMHead) and head.layer.path == "a8"
    w = load_file(str(tiny_llama / "model.safetensors"))["lm_head.weight"]
    qw = quantize_rtn(w.bfloat16(), 8, None)
    head.layer.forward = functools.partial(reference_linear_a8, qw=qw)  # type: ignore[method-assign]
    assert run_engine_checked(ref, PROMPTS, PARAMS) == want
