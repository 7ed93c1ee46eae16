"""Native Qwen3: logits equal transformers' (float32, windowed layer included), the fused
q/k norm inside the RoPE + KV write kernel equals the PyTorch chain, bad configs refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvserve.attention.paged import write_kv
from kvserve.model.llama import LlamaForCausalLM, RMSNorm, apply_rope
from kvserve.model.loader import load_model, model_max_len
from kvserve.ops import cpu_kernels
from tests.model.tiny_native import kvserve_logits, make_native_model, native_config

HAS_KERNELS = shutil.which("c++") is not None and cpu_kernels.available()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3")
    return path, make_native_model("qwen3", path)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_logits_match_transformers(qwen3: tuple[Path, torch.nn.Module], use_kernel: bool) -> None:
    """A 9-token prefill then 11 decode steps: layer 1's window (6) drops keys at every one."""
    if use_kernel and not HAS_KERNELS:
        pytest.skip("no C++ kernels")
    path, hf = qwen3
    model = load_model(path, torch.float32, "cpu", max_positions=64)
    assert [layer.self_attn.attn_kwargs for layer in model.layers] == [{}, {"sliding_window": 6}]
    assert model.head_dim == 32 and model.layers[0].self_attn.q_size == 128  # != hidden 64
    ids = torch.randint(2, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0, 8:]  # [12, V]
    got = kvserve_logits(model, ids, prefill=9, use_kernel=use_kernel)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_windows_lift_the_context_cap() -> None:
    """Windowed layers are applied in attention, so the context is not capped at the window
    (Mistral's window included)."""
    cfg = native_config("qwen3", architectures=["Qwen3ForCausalLM"])
    assert model_max_len(cfg) == 512
    mistral = native_config("qwen3", architectures=["MistralForCausalLM"])
    assert mistral.sliding_window == 6 and model_max_len(mistral) == 512


@pytest.mark.skipif(not HAS_KERNELS, reason="no C++ kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_qk_norm_rope_write_kv(dtype: torch.dtype) -> None:
    """q_norm/k_norm per head, then RoPE and the KV write, in one kernel: bf16 bit for bit."""
    heads, kv_heads, d, tokens = 4, 2, 32, 9
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    q_norm, k_norm = RMSNorm(d, 1e-6).to(dtype), RMSNorm(d, 1e-6).to(dtype)
    q_norm.weight.data = torch.randn(d, generator=g).to(dtype)
    k_norm.weight.data = torch.randn(d, generator=g).to(dtype)
    pos = torch.arange(tokens) * 7
    freqs = torch.outer(pos.float(), 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d)))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [T, D]
    slots = torch.randperm(32, generator=g)[:tokens]
    shape = (8, kv_heads, 4, d)
    k_ref, v_ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_got, v_got = k_ref.clone(), v_ref.clone()

    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = q_norm(q.reshape(tokens, heads, d))
    k = k_norm(k.reshape(tokens, kv_heads, d))
    q_ref, k_rot = apply_rope((cos.unsqueeze(1), sin.unsqueeze(1)), q, k)
    write_kv(k_rot, v.reshape(tokens, kv_heads, d), k_ref, v_ref, slots)
    q_got = cpu_kernels.rope_write_kv(
        qkv, cos, sin, k_got, v_got, slots, heads, kv_heads, (q_norm.weight, k_norm.weight), 1e-6
    )
    tol = 0 if dtype == torch.bfloat16 else 1e-5  # float32: the sum of squares' order
    torch.testing.assert_close(q_got, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k_got, k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(v_got, v_ref, atol=0, rtol=0)


def test_unknown_layer_type_refused() -> None:
    cfg = native_config("qwen3", architectures=["Qwen3ForCausalLM"])
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        LlamaForCausalLM(cfg, max_positions=64)


def test_unknown_activation_refused() -> None:
    cfg = native_config("qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="relu")
    with pytest.raises(ValueError, match="unsupported hidden activation 'relu'"):
        LlamaForCausalLM(cfg, max_positions=64)
