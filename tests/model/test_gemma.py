"""Native Gemma 1/2/3 (text): logits equal transformers' (float32: windows, soft-caps, local
and global RoPE), the (1 + w) RMSNorm and GeGLU kernels equal their PyTorch chains, and what
is not implemented is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

from kvserve.attention.paged import write_kv
from kvserve.model.gemma import GemmaForCausalLM, GemmaRMSNorm
from kvserve.model.llama import MLP, apply_rope
from kvserve.model.loader import load_model
from kvserve.ops import cpu_kernels
from tests.model.tiny_native import kvserve_logits, make_native_model, native_config

HAS_KERNELS = shutil.which("c++") is not None and cpu_kernels.available()
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="no C++ kernels")


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_logits_match_transformers(tmp_path: Path, arch: str, use_kernel: bool) -> None:
    """A 9-token prefill then 11 decode steps past the window of 6 (Gemma 2/3)."""
    if use_kernel and not HAS_KERNELS:
        pytest.skip("no C++ kernels")
    hf = make_native_model(arch, tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu", max_positions=64)
    assert isinstance(model, GemmaForCausalLM)
    assert model.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    ids = torch.randint(2, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0, 8:]  # [12, V]
    got = kvserve_logits(model, ids, prefill=9, use_kernel=use_kernel)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_per_layer_features() -> None:
    """What each tiny config turns on, layer by layer."""
    g2 = GemmaForCausalLM(native_config("gemma2", architectures=["Gemma2ForCausalLM"]), 64)
    assert [layer.self_attn.attn_kwargs for layer in g2.layers] == [
        {"sliding_window": 6, "soft_cap": 3.0},
        {"soft_cap": 3.0},
    ]
    assert g2.layers[0].self_attn.scale == 24**-0.5
    assert g2.final_logit_softcapping == 2.0
    g3 = GemmaForCausalLM(native_config("gemma3", architectures=["Gemma3ForCausalLM"]), 64)
    # Gemma 3 ignores attn_logit_softcapping, as transformers' Gemma3Attention does.
    assert [layer.self_attn.attn_kwargs for layer in g3.layers] == [{"sliding_window": 6}, {}]
    assert g3.rope_keys == ["sliding_attention", "full_attention"]
    local, full = g3.rotary.tables["sliding_attention"], g3.rotary.tables["full_attention"]
    assert not torch.equal(local.cos, full.cos)  # theta 100 vs 1e6 with linear scaling
    assert isinstance(g3.layers[0].self_attn.q_norm, GemmaRMSNorm)
    g1 = GemmaForCausalLM(native_config("gemma", architectures=["GemmaForCausalLM"]), 64)
    assert g1.layers[0].self_attn.attn_kwargs == {} and not g1.layers[0].sandwich


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_rms_norm_equals_transformers(dtype: torch.dtype) -> None:
    ours, ref = GemmaRMSNorm(300, 1e-6).to(dtype), HFGemmaRMSNorm(300, 1e-6).to(dtype)
    ours.weight.data = ref.weight.data = rand(300, dtype=dtype, seed=1, scale=0.5)
    x = rand(7, 300, dtype=dtype, seed=2)
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 1000), (128, 1152)])
def test_fused_unit_offset_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    """The C++ norm with unit_offset (and its add + norm) equals GemmaRMSNorm's chain up to
    the sum of squares' order: transformers' ``x.pow(2).mean(-1)`` is ATen's cascade sum, the
    kernel's a 16-lane running sum, so a row's float32 norm may differ in its last bit and a
    bf16 output by one ulp (measured: 1 of 147,456 outputs at 128 x 1152)."""
    norm = GemmaRMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = rand(hidden, dtype=dtype, seed=1, scale=0.5)
    x, residual = (
        rand(tokens, hidden, dtype=dtype, seed=2),
        rand(tokens, hidden, dtype=dtype, seed=3),
    )
    ref_sum, ref_out = norm.add_forward(x, residual)
    fused = residual.clone()
    got_sum = fused
    got_out = cpu_kernels.add_rms_norm(x, fused, norm.weight, 1e-6, unit_offset=True)
    got = cpu_kernels.rms_norm(x, norm.weight, 1e-6, unit_offset=True)
    torch.testing.assert_close(got_sum, ref_sum, atol=0, rtol=0)
    for out, ref in ((got, norm(x)), (got_out, ref_out)):
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            continue
        # bf16: within one ulp (2 roundings' worth of eps), in at most 1 of 10,000 outputs.
        bound = 2 * torch.finfo(torch.bfloat16).eps * ref.float().abs()
        assert ((out.float() - ref.float()).abs() <= bound).all()
        assert int((out != ref).sum()) <= max(1, tokens * hidden // 10_000)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "inter"), [(1, 40), (3, 100), (5, 2816), (128, 2816), (2, 6912)]
)
def test_gelu_tanh_and_mul(dtype: torch.dtype, tokens: int, inter: int) -> None:
    """GeGLU in one kernel: bf16 bit for bit with gelu(gate, approximate="tanh") * up, the
    vectorised body and the scalar tail alike (inter 40 and 100 are mostly tail)."""
    gate_up = rand(tokens, 2 * inter, dtype=dtype, seed=inter)
    gate, up = gate_up.split(inter, dim=-1)
    ref = torch.nn.functional.gelu(gate, approximate="tanh") * up
    got = cpu_kernels.gelu_tanh_and_mul(gate_up)
    tol = 0 if dtype == torch.bfloat16 else 1e-5  # float32: PyTorch's loop splits differently
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    mlp = MLP(8, inter, "gelu_pytorch_tanh")
    assert mlp.act_and_mul is cpu_kernels.gelu_tanh_and_mul  # what the fused MLP calls


@needs_kernels
def test_fused_gemma_qk_norm_rope_write_kv() -> None:
    """Gemma 3's (1 + w) q/k norms inside the RoPE + KV write kernel, bf16 bit for bit."""
    dtype, heads, kv_heads, d, tokens = torch.bfloat16, 4, 1, 64, 6
    qkv = rand(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, seed=4)
    q_norm, k_norm = GemmaRMSNorm(d, 1e-6).to(dtype), GemmaRMSNorm(d, 1e-6).to(dtype)
    q_norm.weight.data = rand(d, dtype=dtype, seed=5, scale=0.5)
    k_norm.weight.data = rand(d, dtype=dtype, seed=6, scale=0.5)
    freqs = torch.outer(torch.arange(tokens).float() * 5, 1 / (100 ** (torch.arange(0, d, 2) / d)))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.tensor([3, 0, 9, 4, 12, 7])
    shape = (4, kv_heads, 4, d)
    k_ref, v_ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_got, v_got = k_ref.clone(), v_ref.clone()
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref, k_rot = apply_rope(
        (cos.unsqueeze(1), sin.unsqueeze(1)),
        q_norm(q.reshape(tokens, heads, d)),
        k_norm(k.reshape(tokens, kv_heads, d)),
    )
    write_kv(k_rot, v.reshape(tokens, kv_heads, d), k_ref, v_ref, slots)
    norms = (q_norm.weight, k_norm.weight)
    q_got = cpu_kernels.rope_write_kv(
        qkv, cos, sin, k_got, v_got, slots, heads, kv_heads, norms, 1e-6, unit_offset=True
    )
    torch.testing.assert_close(q_got, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_got, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_got, v_ref, atol=0, rtol=0)


def test_bidirectional_refused() -> None:
    cfg = native_config("gemma3", architectures=["Gemma3ForCausalLM"])
    cfg.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM(cfg, 64)


def test_other_activation_refused() -> None:
    cfg = native_config("gemma2", architectures=["Gemma2ForCausalLM"])
    cfg.hidden_activation = "gelu_new"
    with pytest.raises(ValueError, match="unsupported hidden activation 'gelu_new'"):
        GemmaForCausalLM(cfg, 64)


def test_multimodal_gemma3_refused() -> None:
    cfg = native_config("gemma3", architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
        GemmaForCausalLM(cfg, 64)
