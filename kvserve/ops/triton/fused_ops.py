"""Fused Triton kernels for a decoder layer's small op chains (issue 35 item 2), the GPU
counterparts of the C++ CPU kernels in ``kvserve/ops/cpu_kernels.py`` with the same
signatures:

- ``rms_norm`` / ``add_rms_norm``: (``residual += x``, then) Hugging Face's RMSNorm, or Gemma's
  ``(1 + w)`` form with ``unit_offset``; one program per row;
- ``silu_and_mul`` / ``gelu_tanh_and_mul``: ``act(gate) * up`` of ``gate_up = [T, 2 I]``;
- ``rope_write_kv``: (Qwen3 / Gemma3's per-head q/k RMSNorm, then) RoPE on q and k of the
  fused ``qkv`` projection, k and v stored into their paged-cache slots; rotate-half (NeoX,
  Llama) or, with ``interleaved``, GPT-J's pairs; one program per (token, head).

Each follows its PyTorch op chain's rounding: the chain rounds every intermediate to the model
dtype (``normed.to(x.dtype)``, ``silu(gate)``, ``x * cos``), so the kernels compute each step in
float32 and round where the chain does; in float32 only the order of RMSNorm's sum differs.
They are held to those chains by ``tests/ops/test_triton_fused.py`` (Triton's interpreter on
CPU CI; the bfloat16 cases need CUDA, the interpreter's bfloat16 being unreliable).
``tl.tanh`` does not exist in Triton 3.6/3.7: GELU's tanh uses ``exp`` as the attention
kernels' soft-cap does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ACT_BLOCK = 1024  # elements of ``act(gate) * up`` per program


@triton.jit
def _rms_norm_kernel(
    out_ptr, res_ptr, x_ptr, w_ptr, hidden, eps, stride_x, stride_r, stride_o,
    ADD: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # ``residual + x``, rounded
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        y = xf * inv * (1.0 + w)  # Gemma: every step in float32, rounded once
    else:
        y = w * (xf * inv).to(x.dtype).to(tl.float32)  # HF: ``w * normed.to(x.dtype)``
    tl.store(out_ptr + row * stride_o + cols, y.to(x.dtype), mask=mask)


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
) -> torch.Tensor:
    rows, hidden = x.shape
    out = torch.empty_like(x)
    res = x if residual is None else residual
    _rms_norm_kernel[(rows,)](
        out, res, x, weight, hidden, eps, x.stride(0), res.stride(0), out.stride(0),
        ADD=residual is not None, UNIT_OFFSET=unit_offset,
        BLOCK=triton.next_power_of_2(hidden),
    )  # fmt: skip
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm of ``[T, hidden]`` rows (``unit_offset``: Gemma's ``(1 + w)``)."""
    return _norm(x, None, weight, eps, unit_offset)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:
    """``residual += x`` (in place, rounded to its dtype), then returns RMSNorm(residual)."""
    return _norm(x, residual, weight, eps, unit_offset)


@triton.jit
def _tanh(z):
    """``tanh(z)`` in float32 from ``e^-2|z|`` in (0, 1]: nothing overflows."""
    t = tl.exp(-2.0 * tl.abs(z))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(z >= 0, th, -th)


@triton.jit
def _act_and_mul_kernel(
    out_ptr, in_ptr, inter, stride_in, stride_out,
    GELU: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(in_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(in_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU:
        # sqrt(2 / pi) as a literal: a jitted function reads only constexpr globals
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(gate.dtype).to(tl.float32)  # the chain rounds act(gate) before the product
    tl.store(out_ptr + row * stride_out + cols, (a * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _act_and_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    grid = (rows, triton.cdiv(inter, _ACT_BLOCK))
    _act_and_mul_kernel[grid](
        out, gate_up, inter, gate_up.stride(0), out.stride(0), GELU=gelu, BLOCK=_ACT_BLOCK
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [T, 2 * I]`` -> ``[T, I]``."""
    return _act_and_mul(gate_up, gelu=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for ``gate_up = [T, 2 * I]`` -> ``[T, I]``."""
    return _act_and_mul(gate_up, gelu=True)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, qkv_ptr, cos_ptr, sin_ptr, k_cache, v_cache, slot_ptr, qw_ptr, kw_ptr, eps,
    num_heads, num_kv_heads, block_size, stride_qkv, stride_cos, stride_qt, stride_qh,
    stride_cb, stride_ch, stride_ct,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)  # q heads, then k heads, then v heads: their order in ``qkv``
    i = tl.arange(0, HALF_PAD)
    m = i < HALF
    if INTERLEAVED:  # GPT-J: element pairs (2i, 2i + 1)
        i1 = 2 * i
        i2 = 2 * i + 1
    else:  # NeoX / Llama: halves (i, i + D/2)
        i1 = i
        i2 = i + HALF
    base = qkv_ptr + t * stride_qkv + h * HEAD_DIM
    x1 = tl.load(base + i1, mask=m, other=0.0)
    x2 = tl.load(base + i2, mask=m, other=0.0)
    slot = tl.load(slot_ptr + t)
    is_v = h >= num_heads + num_kv_heads
    if is_v:
        hv = h - num_heads - num_kv_heads
        dst = v_cache + (slot // block_size) * stride_cb + hv * stride_ch
        dst += (slot % block_size) * stride_ct
        tl.store(dst + i1, x1, mask=m & (slot >= 0))
        tl.store(dst + i2, x2, mask=m & (slot >= 0))
    else:
        dt = x1.dtype
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if NORM:  # per-head RMSNorm (Qwen3, Gemma3) before the rotation
            inv = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / HEAD_DIM + eps)
            w_ptr = qw_ptr if h < num_heads else kw_ptr
            w1 = tl.load(w_ptr + i1, mask=m, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + i2, mask=m, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                a = (a * inv * (1.0 + w1)).to(dt).to(tl.float32)
                b = (b * inv * (1.0 + w2)).to(dt).to(tl.float32)
            else:
                a = (w1 * (a * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                b = (w2 * (b * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_cos + i1, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_cos + i2, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_cos + i1, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_cos + i2, mask=m, other=0.0).to(tl.float32)
        # ``x * cos + rotate(x) * sin`` with each product rounded, as the chain rounds it
        y1 = (a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)
        y2 = (b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)
        if h < num_heads:
            dst = q_ptr + t * stride_qt + h * stride_qh
            tl.store(dst + i1, y1.to(dt), mask=m)
            tl.store(dst + i2, y2.to(dt), mask=m)
        else:
            hk = h - num_heads
            dst = k_cache + (slot // block_size) * stride_cb + hk * stride_ch
            dst += (slot % block_size) * stride_ct
            tl.store(dst + i1, y1.to(dt), mask=m & (slot >= 0))
            tl.store(dst + i2, y2.to(dt), mask=m & (slot >= 0))


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate q and k of ``qkv`` ``[T, (H + 2 Hkv) * D]`` with ``cos``/``sin`` ``[T, D]``,
    store k and v in their slots of ``k_cache``/``v_cache`` ``[blocks, Hkv, block, D]`` (a
    negative slot is padding: not stored); returns q ``[T, H, D]``. ``qk_norm``: the q and k
    norm weights ``[D]``; ``interleaved``: GPT-J's rotation of element pairs."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[3]
    q = qkv.new_empty(tokens, num_heads, head_dim)
    q_w, k_w = qk_norm if qk_norm is not None else (cos, cos)  # unused without NORM
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same layout")
    _rope_write_kv_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        q, qkv, cos, sin, k_cache, v_cache, slot_mapping, q_w, k_w, eps,
        num_heads, num_kv_heads, k_cache.shape[2], qkv.stride(0), cos.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2),
        NORM=qk_norm is not None, UNIT_OFFSET=unit_offset, INTERLEAVED=interleaved,
    )  # fmt: skip
    return q
