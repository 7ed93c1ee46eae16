"""The fused Triton kernels (``kvserve/ops/triton/fused_ops.py``) against the PyTorch op
chains they replace, the same chains the C++ kernels are held to (tests/model/test_fused_ops.py).

Without CUDA they run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``),
~3 ms a program, so the shapes are tiny but still cross the padded tails (hidden 40, head_dim
40: a non-power-of-two half) and two programs of ``act(gate) * up`` per row (I = 1100).
Tolerances: float32 only RMSNorm's sum order and ``exp`` differ (a few ulps: 2e-6 relative);
float16 rounds each step as the chain does, one float16 ulp where the float32 step before the
rounding differs (2e-3); bfloat16 (CUDA only, the interpreter's bfloat16 is unreliable) one
bfloat16 ulp (1.6e-2).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention.paged import write_kv
from kvserve.model.gemma import GemmaRMSNorm
from kvserve.model.llama import RMSNorm, apply_rope
from kvserve.ops.triton import fused_ops

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.cuda, id="bfloat16"),
]


@pytest.fixture
def dev(dtype: torch.dtype) -> torch.device:
    if dtype == torch.bfloat16 or torch.cuda.is_available():
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def rand(*shape: int, dtype: torch.dtype, seed: int, dev: torch.device, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_and_add(dtype: torch.dtype, gemma: bool, dev: torch.device) -> None:
    norm = (GemmaRMSNorm if gemma else RMSNorm)(40, 1e-6).to(dtype).to(dev)
    norm.weight.data = rand(40, dtype=dtype, seed=1, dev=dev, scale=0.5)
    x, residual = (
        rand(3, 40, dtype=dtype, seed=2, dev=dev),
        rand(3, 40, dtype=dtype, seed=3, dev=dev),
    )
    close(fused_ops.rms_norm(x, norm.weight, 1e-6, gemma), norm(x), dtype)
    want_sum, want = norm.add_forward(x, residual)  # the op chain: residual untouched
    fused = residual.clone()
    got = fused_ops.add_rms_norm(x, fused, norm.weight, 1e-6, gemma)
    torch.testing.assert_close(fused, want_sum, atol=0, rtol=0)  # one rounded add: exact
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul(dtype: torch.dtype, act: str, dev: torch.device) -> None:
    inter = 1100  # two programs per row
    gate_up = rand(2, 2 * inter, dtype=dtype, seed=4, dev=dev)
    gate, up = gate_up.split(inter, dim=-1)
    if act == "silu":
        want, got = torch.nn.functional.silu(gate) * up, fused_ops.silu_and_mul(gate_up)
    else:
        want = torch.nn.functional.gelu(gate, approximate="tanh") * up
        got = fused_ops.gelu_tanh_and_mul(gate_up)
    close(got, want, dtype)


def _gptj_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotation (pairs 2i, 2i + 1) as its op chain; ``cos``/``sin`` ``[T, 1, D]``."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return x * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "norm", "interleaved"),
    [(16, None, False), (40, "qwen3", False), (16, "gemma", False), (16, None, True)],
)
def test_rope_write_kv(
    dtype: torch.dtype, head_dim: int, norm: str | None, interleaved: bool, dev: torch.device
) -> None:
    tokens, heads, kv_heads, block_size, blocks = 4, 4, 2, 4, 4
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5, dev=dev)
    pos = torch.tensor([3, 17, 250, 0])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(pos.float(), inv_freq)  # [T, D/2]
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype).to(dev), emb.sin().to(dtype).to(dev)  # [T, D]
    slots = torch.tensor([5, 0, 14, -1], device=dev)  # -1: a padded token, not stored
    shape = (blocks, kv_heads, block_size, head_dim)
    k_want = torch.full(shape, 7.0, dtype=dtype, device=dev)
    v_want = k_want.clone()
    k_got, v_got = k_want.clone(), v_want.clone()

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    weights = None
    if norm is not None:
        cls = GemmaRMSNorm if norm == "gemma" else RMSNorm
        q_norm, k_norm = (
            cls(head_dim, 1e-6).to(dtype).to(dev),
            cls(head_dim, 1e-6).to(dtype).to(dev),
        )
        q_norm.weight.data = rand(head_dim, dtype=dtype, seed=6, dev=dev, scale=0.3)
        k_norm.weight.data = rand(head_dim, dtype=dtype, seed=7, dev=dev, scale=0.3)
        q, k = q_norm(q), k_norm(k)
        weights = (q_norm.weight, k_norm.weight)
    rope = (cos.unsqueeze(1), sin.unsqueeze(1))
    if interleaved:
        q_want, k_rot = _gptj_rope(q, *rope), _gptj_rope(k, *rope)
    else:
        q_want, k_rot = apply_rope(rope, q, k)
    keep = slots >= 0
    write_kv(k_rot[keep], v.view(tokens, kv_heads, head_dim)[keep], k_want, v_want, slots[keep])

    q_got = fused_ops.rope_write_kv(
        qkv, cos, sin, k_got, v_got, slots, heads, kv_heads, weights, 1e-6,
        unit_offset=norm == "gemma", interleaved=interleaved,
    )  # fmt: skip
    close(q_got, q_want, dtype)
    close(k_got, k_want, dtype)
    torch.testing.assert_close(v_got, v_want, atol=0, rtol=0)  # a copy
    assert int((k_got != 7.0).any(dim=(1, 3)).sum()) == 3  # exactly the three real slots
