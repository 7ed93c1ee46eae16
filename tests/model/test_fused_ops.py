"""The C++ fused ops equal the PyTorch op chains they replace in the decoder layer."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvserve.attention.paged import write_kv
from kvserve.model.llama import RMSNorm, apply_rope
from kvserve.ops import cpu_kernels

# bf16: every intermediate of the chain is rounded to bf16, so the kernels must match bit for
# bit (the model uses them only in bf16). float32: RMSNorm sums its squares in another order
# and SiLU's scalar tail uses another exp, so allow float rounding there.
EXACT = {torch.bfloat16: True, torch.float32: False}
# The kernel sums RMSNorm's squares 16 floats at a time, in ATen's AVX-512 order. Where torch
# dispatches to AVX2 (8-wide; seen on an AMD EPYC Milan VM) ATen sums in another order, and a
# row's float32 norm can differ in its last bit: 3 of 131,072 bf16 outputs then differ by one
# bf16 ulp of x * rsqrt(mean). There that is allowed for RMSNorm; everything else stays exact.
AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")

# With a compiler the kernels must build: a broken build fails here instead of skipping.
HAS_COMPILER = shutil.which("c++") is not None
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if HAS_COMPILER:
        assert cpu_kernels.available(), "the C++ CPU kernels failed to build"


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 1000), (128, 1024)])
def test_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = rand(hidden, dtype=dtype, seed=1, scale=1.0)
    x = rand(tokens, hidden, dtype=dtype, seed=2)
    ref = norm(x)
    got = cpu_kernels.rms_norm(x, norm.weight, 1e-5)
    if EXACT[dtype] and not AVX512:
        # One ulp of the bf16 intermediate x * rsqrt(mean), scaled by the weight: within two
        # bf16 roundings of the reference, and in at most 1 of 10,000 outputs.
        bound = 2 * torch.finfo(torch.bfloat16).eps * ref.float().abs()
        assert ((got.float() - ref.float()).abs() <= bound).all()
        assert int((got != ref).sum()) <= tokens * hidden // 10_000
    elif EXACT[dtype]:
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm(dtype: torch.dtype) -> None:
    """The skip connection's add and the next norm in one pass; the sum lands in residual."""
    norm = RMSNorm(1000, 1e-6).to(dtype)
    norm.weight.data = rand(1000, dtype=dtype, seed=7, scale=1.0)
    x, residual = rand(9, 1000, dtype=dtype, seed=8), rand(9, 1000, dtype=dtype, seed=9)
    ref_sum, ref_out = norm.add_forward(x, residual)  # PyTorch path: residual untouched
    fused = residual.clone()
    got = cpu_kernels.add_rms_norm(x, fused, norm.weight, 1e-6)
    torch.testing.assert_close(fused, ref_sum, atol=0, rtol=0)
    tol = 0 if EXACT[dtype] else 1e-5
    torch.testing.assert_close(got, ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 40), (5, 2816), (128, 2816)])
def test_silu_and_mul(dtype: torch.dtype, tokens: int, inter: int) -> None:
    gate_up = rand(tokens, 2 * inter, dtype=dtype, seed=3)
    gate, up = gate_up.split(inter, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    tol = 0 if EXACT[dtype] else 1e-6  # float32 tails: PyTorch's scalar exp, ours vectorised
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (16, 8, 64), (6, 1, 40)])
def test_rope_write_kv(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    tokens, block_size, num_blocks = 11, 4, 8
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    positions = torch.randint(0, 500, (tokens,), generator=torch.Generator().manual_seed(5))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(6))
    slots = slots[:tokens]
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_ref, v_ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_got, v_got = k_ref.clone(), v_ref.clone()

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_rot = apply_rope(
        (cos.unsqueeze(1), sin.unsqueeze(1)),
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
    )
    write_kv(k_rot, v.view(tokens, kv_heads, head_dim), k_ref, v_ref, slots)
    q_got = cpu_kernels.rope_write_kv(qkv, cos, sin, k_got, v_got, slots, heads, kv_heads)
    torch.testing.assert_close(q_got, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_got, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_got, v_ref, atol=0, rtol=0)
    assert int((k_got != 0).any(dim=(1, 3)).sum()) == tokens  # exactly the written slots


def test_bad_input_raises() -> None:
    x = torch.randn(3, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        cpu_kernels.rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-5)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.kvserve.silu_and_mul(torch.empty(3, 5), torch.randn(3, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 37, 32000])
def test_argmax_rows_equals_torch_max(dtype: torch.dtype, vocab: int) -> None:
    x = rand(9, vocab, dtype=dtype, seed=vocab)
    x[1] = x[1].round()  # many ties: the first maximum must win
    x[2] = float("-inf")  # all -inf: index 0
    x[3, vocab // 2] = float("nan")  # a NaN is the maximum
    x[4] = 7.0  # all equal
    if vocab > 20:
        x[5, [3, 19]] = 100.0  # a tie across vector lanes, and one in the tail
        x[6, -1] = 100.0
    ref = x.max(dim=-1).indices
    assert cpu_kernels.argmax_rows(x).tolist() == ref.tolist()
