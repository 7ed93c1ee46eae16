"""The C++ decode loop (``kvserve/model/decode_loop.py``) against the Python layers it stands
for: the same tokens and the same KV cache bytes through the whole engine, for every kind of
linear it runs (prepacked bf16, plain float32/bf16, int8/int4 with int8 activations, int4 with
bf16 activations) and every Llama-family variant (q/k/v bias, q/k norms, sliding windows), with
KV integrity checked after every step and the exact number of steps it took."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.decode_loop import build_decode_loop
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import QuantLinear, _a8_avx2, _a8_kernel
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model, random_prompts
from tests.model.tiny_native import make_native_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

PROMPTS = random_prompts([3, 7, 12, 5, 20, 9, 1, 15])
MAX_TOKENS = 30
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# (quantization, its activations): the three linear kinds the loop runs
WEIGHTS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int4-bf16-activations": {"quantization": "int4", "quantization_activations": "none"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama (llama3 RoPE), Qwen2 (q/k/v bias), Qwen3 (q/k norms, a sliding layer, q/k/v
    and o biases) and Mistral (a window of 8 on every layer, shorter than most prompts plus
    outputs). Biases are random: transformers initialises them to 0, which would hide a
    dropped one."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "mistral"):
        out[arch] = path = tmp_path_factory.mktemp(arch)
        if arch in ("llama", "qwen2"):
            model = make_tiny_model(arch, path)
        else:
            model = make_native_model(arch, path, attention_bias=arch == "qwen3")
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        assert len(biases) == {"qwen2": 6, "qwen3": 8}.get(arch, 0)
        with torch.no_grad():
            for b in biases:
                b.copy_(torch.randn_like(b) * 0.5)
        model.save_pretrained(path)
    return out


def engine(path: Path, dtype: str = "bfloat16", **kw: object) -> LLMEngine:
    return LLMEngine(
        build_engine_config(str(path), dtype=dtype, block_size=4, num_kv_blocks=200, **kw)
    )


def run_staggered(e: LLMEngine) -> tuple[dict[str, list[int]], int]:
    """Four requests, two steps, four more (a step mixing prefills with decodes), then to
    the end with KV integrity checked after every step; returns the tokens and the steps."""
    done: dict[str, list[int]] = {}
    steps = 0
    for i, p in enumerate(PROMPTS):
        if i == 4:
            for _ in range(2):
                steps += 1
                assert not any(o.finished for o in e.step())
                e.kv.check_integrity()
        e.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
    while e.has_unfinished_requests():
        steps += 1
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        e.kv.check_integrity()
    return done, steps


def kv_bytes(e: LLMEngine) -> list[torch.Tensor]:
    assert e.runner is not None
    return [t.clone() for kv in e.runner.kv_caches for t in kv]


def assert_loop_equals_eager(
    path: Path, quant: dict[str, object], check: Callable[[nn.Module], None]
) -> None:
    """The engine with its C++ decode loop against the same engine with ``enforce_eager``
    (the Python layers): ``check(model)`` on the loop's model, then the same tokens, every
    step but the two with prefills in the loop, and the same KV cache bytes."""
    eager = engine(path, enforce_eager=True, **quant)
    assert eager.runner is not None and eager.runner.model.decode_loop is None
    want, want_steps = run_staggered(eager)

    e = engine(path, **quant)
    assert e.runner is not None and e.runner.info.decode_loop is True
    loop = e.runner.model.decode_loop
    assert loop is not None
    check(e.runner.model)
    got, steps = run_staggered(e)
    assert got == want and steps == want_steps == MAX_TOKENS + 2
    # Every step but the two with prefills (the first, and the third where four requests
    # joined four decoding ones) ran in C++.
    assert loop.steps == steps - 2
    for a, b in zip(kv_bytes(eager), kv_bytes(e), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_loop_equals_python_layers(models: dict[str, Path], arch: str, weights: str) -> None:
    quant = WEIGHTS[weights]

    def check(model: nn.Module) -> None:
        if not quant:
            return  # the linears really are the kind under test (auto's int8 activations: bf16
        # with VNNI, 4-bit codes on AVX2 without it; qlinear.a8_auto_supports)
        qkv = model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, QuantLinear)
        auto_a8 = _a8_kernel() or (qkv.bits == 4 and _a8_avx2())
        a8 = quant.get("quantization_activations") != "none" and auto_a8
        assert qkv.path == ("a8" if a8 else "kernel")

    assert_loop_equals_eager(models[arch], quant, check)


@pytest.mark.parametrize(
    ("arch", "wdtype"), [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")]
)
def test_float32_loop_equals_python_layers(models: dict[str, Path], arch: str, wdtype: str) -> None:
    """float32 (``dtype=auto`` on AVX2-only CPUs): plain q/k/v, o and down linears
    (``nn.Linear`` through at::linear) beside the prepacked gate/up, fused float32 ops; or
    every linear a ``WideLinear`` on packed bf16 weights (batches of 1-8 rows: every tile)."""
    eager = engine(models[arch], "float32", enforce_eager=True, weight_dtype=wdtype)
    want, want_steps = run_staggered(eager)
    e = engine(models[arch], "float32", weight_dtype=wdtype)
    assert e.runner is not None
    loop = e.runner.model.decode_loop
    assert loop is not None and e.runner.model.fused_ops_enabled
    got, steps = run_staggered(e)
    assert got == want and steps == want_steps == MAX_TOKENS + 2
    assert loop.steps == steps - 2
    for a, b in zip(kv_bytes(eager), kv_bytes(e), strict=True):
        assert torch.equal(a, b)


def test_loop_changes_nothing_but_speed_against_unfused(models: dict[str, Path]) -> None:
    """The loop's tokens are also the plain PyTorch path's (no fused ops, no packing): the
    fused path is held to that path elsewhere, so the three agree."""
    plain = engine(models["llama"], fused_ops=False, prepack_weights=False)
    assert plain.runner is not None and plain.runner.model.decode_loop is None
    e = engine(models["llama"])
    assert e.runner is not None and e.runner.model.decode_loop is not None
    assert run_staggered(e)[0] == run_staggered(plain)[0]


@pytest.mark.parametrize(
    "kw",
    [
        {"enforce_eager": True},
        {"fused_ops": False},
        {"dtype": "float32", "fused_ops": False},
    ],
)
def test_loop_off(models: dict[str, Path], kw: dict[str, object]) -> None:
    args = {"dtype": "bfloat16", "block_size": 4, "num_kv_blocks": 50, **kw}
    e = LLMEngine(build_engine_config(str(models["llama"]), **args))
    assert e.runner is not None
    assert e.runner.model.decode_loop is None
    assert e.runner.info.decode_loop is False


def test_sdpa_decode_steps_stay_in_python(models: dict[str, Path]) -> None:
    """With gather + SDPA decode attention the loop is built but takes no step."""
    e = engine(models["llama"], attention_backend="TORCH_SDPA")
    assert e.runner is not None
    loop = e.runner.model.decode_loop
    assert loop is not None and e.runner.info.decode_loop is True
    eager = engine(models["llama"], attention_backend="TORCH_SDPA", enforce_eager=True)
    assert run_staggered(e)[0] == run_staggered(eager)[0]
    assert loop.steps == 0


def test_gemma_keeps_its_python_layers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_native_model("gemma2", tmp_path)
    e = engine(tmp_path)
    assert e.runner is not None
    assert e.runner.model.decode_loop is None
    assert build_decode_loop(e.runner.model) is None
    assert "layer 0 is a GemmaDecoderLayer, not a Llama-family layer" in caplog.text


def test_a_layer_takes_four_linears() -> None:
    layers = torch.classes.kvserve.DecodeLayers(4, 2, 16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="a layer takes exactly 4 linears, got 0"):
        layers.add_layer(w, 1e-6, w, 1e-6, None, None, 1e-6, 0, 0.0, 0.25)
    with pytest.raises(RuntimeError, match="unknown linear kind 7"):
        layers.add_linear(7, w, w, w, None, 64, 8, 32, 0, 0, 0, False)


def test_no_kernel_build_off_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that is not on a CPU is refused before the C++ kernels are asked for (on a
    CUDA machine they would be compiled for nothing, and need g++)."""
    from kvserve.model.llama import LlamaForCausalLM
    from tests.model.tiny_native import native_config

    def no_build() -> bool:
        raise AssertionError("the C++ kernels were asked for")

    monkeypatch.setattr(cpu_kernels, "available", no_build)
    with torch.device("meta"):
        model = LlamaForCausalLM(native_config("qwen3"), 64)
    assert build_decode_loop(model) is None
