"""The int8-activation kernel's records for GGUF files: K-quants' two-level scales
(``SuperScales``, super-block records) and 5- and 6-bit codes (int4 nibbles plus bit planes).
The same float32 scales and zeros as gguf's dequantizer, and outputs bit-identical to the
per-group float32 records of 8-bit codes they replace, in fewer bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from kvserve.config import QuantizedActivations
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.quantization import qlinear
from kvserve.quantization.gguf_blocks import LAYOUTS
from kvserve.quantization.gguf_weights import _unpermute, tensor_to_qweight
from kvserve.quantization.lm_head import pad_rows
from kvserve.quantization.qlinear import (
    A8_NARROW,
    A8Scales,
    QuantLinear,
    a8_code_bits,
    a8_scale_format,
    exact_activations,
    pack_a8,
    pack_codes_a8,
    quantize_activations,
)
from kvserve.quantization.qweight import QuantizedWeight, concat_rows
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import run_engine_checked
from tests.model.llamacpp_kquant import DATA, prompts
from tests.quantization.test_gguf_weights import _F16_FIELDS
from tests.quantization.test_qlinear_a8 import needs_a8
from tests.quantization.test_qlinear_a8_avx2 import needs_avx2

CPU = torch.device("cpu")
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)


def k_blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """Random ``qtype`` blocks for ``n x k`` weights (any bit pattern is a valid block) with
    finite float16 d / dmin of either sign, some of them 0."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        d = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        d[::7] = 0  # a zero dmin gives zeros of -0.0: the kernel must flip the sign as numpy
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks


def k_weight(qtype: T, n: int = 96, k: int = 512, seed: int = 0) -> QuantizedWeight:
    return tensor_to_qweight("blk.0.ffn_up.weight", qtype, k_blocks(qtype, n, k, seed), n, k)


def flat(qw: QuantizedWeight) -> QuantizedWeight:
    """The same weight without its two levels (per-group float32 records)."""
    return QuantizedWeight(qw.codes, qw.scales, qw.zeros, qw.bits, qw.group_size, qw.in_perm)


def per_group_layer(qw: QuantizedWeight, bits: int = 8) -> QuantLinear:
    """``qw``'s layer on per-group float32 records of ``bits``-bit codes (8: the layout GGUF
    weights had before)."""
    layer = QuantLinear(flat(qw), None, CPU, torch.bfloat16, QuantizedActivations.INT8)
    layer.codes, layer.offset = pack_a8(flat(qw), A8Scales.FLOAT32, bits)
    layer.code_bits, layer.scale_format = bits, int(A8Scales.FLOAT32)
    return layer


def assert_near_exact(out: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight) -> None:
    """Within the int8-activation kernel's bound of the exact product (bf16 rounding plus
    float32 sums, as tests/quantization/test_qlinear_a8.py holds every layout to)."""
    q, d = quantize_activations(x)
    exact = exact_activations(q, d) @ qw.exact().t()
    bound = exact.abs() * 2.0**-8 + 1e-5 * float(exact.abs().max())
    assert bool(((out.double() - exact).abs() <= bound).all())


def bits_of(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_two_levels_give_the_scales_bit_for_bit(qtype: T) -> None:
    qw = k_weight(qtype)
    sup = qw.supers
    assert sup is not None and sup.d.dtype == torch.float16 and sup.sc.dtype == torch.int8
    assert sup.sc.shape == (96, 512 // LAYOUTS[qtype][0]) and sup.d.shape == (96, 2)
    assert (sup.dmin is not None) == (qtype in (T.Q2_K, T.Q4_K, T.Q5_K))
    assert torch.equal(bits_of(sup.scales()), bits_of(qw.scales))
    zeros = sup.zeros()
    assert (zeros is None) == (qw.zeros is None)
    if zeros is not None:  # signs of zero too (-0.0 where dmin or m is 0)
        assert torch.equal(bits_of(zeros), bits_of(qw.zeros))
        assert bool((qw.zeros.view(torch.int32) == -(2**31)).any())


def test_bad_two_levels_are_refused() -> None:
    qw = k_weight(T.Q4_K)
    sup = qw.supers
    assert sup is not None
    with pytest.raises(ValueError, match="expected"):
        QuantizedWeight(qw.codes, qw.scales, qw.zeros, 4, 32, supers=sup.rows(slice(0, 80)))
    with pytest.raises(ValueError, match="exactly when there are zeros"):
        QuantizedWeight(qw.codes, qw.scales, None, 4, 32, supers=sup)
    with pytest.raises(ValueError, match="blocks of 256"):
        QuantizedWeight(qw.codes[:, :160], qw.scales[:, :5], qw.zeros[:, :5], 4, 32,
                        supers=sup)  # fmt: skip


def test_pack_a8_super_records_layout() -> None:
    """One vector's record: d [16] f16, dmin [16], sc [8][16], m [8][16], 8 blocks' codes."""
    qw = k_weight(T.Q4_K, n=32, k=512)
    sup = qw.supers
    assert sup is not None and sup.dmin is not None and sup.m is not None
    packed, off = pack_a8(qw, A8Scales.SUPERS)
    header = 2 * 32 + 2 * 8 * 16
    assert packed.shape == (2, 2, header + 8 * 256) and off == 0
    rec = packed[1, 1]  # channels 16..31, K 256..511
    assert torch.equal(rec[:32].view(torch.float16), sup.d[16:, 1])
    assert torch.equal(rec[32:64].view(torch.float16), sup.dmin[16:, 1])
    sc = rec[64:192].view(torch.int8).reshape(8, 16)
    assert torch.equal(sc, sup.sc[16:, 8:].t())
    assert torch.equal(rec[192:320].view(torch.int8).reshape(8, 16), sup.m[16:, 8:].t())
    flat_codes, _ = pack_a8(flat(qw), A8Scales.FLOAT32)  # [2, 16 records, 128 + 256] bytes
    per_group = flat_codes.reshape(2, 16, -1)[:, :, 2 * 64 :]  # drop f32 scales and zeros
    assert torch.equal(rec[header:], per_group[1, 8:].reshape(-1))
    # 4.625 bits per weight, against 6 in float32 records
    assert packed.numel() * 8 / (32 * 512) == 4.625
    assert flat_codes.numel() * 8 / (32 * 512) == 6.0


def unpack_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_codes_a8``'s nibbles and bit planes back to the int8 layout's quads of u."""
    n16, nb, _ = packed.shape
    nib = packed[..., :256].reshape(n16, nb, 4, 64)
    u = torch.cat([nib & 15, nib >> 4], dim=2).to(torch.int32)  # [N/16, K/32, 8 quads, 64]
    for plane in range(bits - 4):
        masks = packed[..., 256 + 64 * plane : 320 + 64 * plane].reshape(n16, nb, 8, 8, 1)
        bit = (masks.to(torch.int32) >> torch.arange(8)) & 1  # [.., quad, byte, bit]
        u = u + (bit.reshape(n16, nb, 8, 64) << (4 + plane))
    return u


PLANE_CASES = [(T.Q5_0, 5, 16), (T.Q5_1, 5, 0), (T.Q5_K, 5, 0), (T.Q6_K, 6, 32)]


@pytest.mark.parametrize(("qtype", "bits", "offset"), PLANE_CASES)
def test_five_and_six_bit_codes_pack_into_nibbles_and_planes(
    qtype: T, bits: int, offset: int
) -> None:
    qw = tensor_to_qweight("w", qtype, k_blocks(qtype, 32, 512, 3), 32, 512)
    assert qw.bits == 8 and a8_code_bits(qw, vnni=True) == bits
    assert a8_code_bits(qw, vnni=False) == 8  # the AVX2 int8 path reads bytes
    packed, off = pack_codes_a8(qw.codes, bits)
    assert off == offset and packed.shape == (2, 16, 256 + 64 * (bits - 4))
    as_bytes, off8 = pack_codes_a8(qw.codes, 8)  # [N/16, K/32, 8, 16, 4]: u + 128 - offset
    want = as_bytes.reshape(2, 16, 8, 64).to(torch.int32) - off8 + offset
    assert torch.equal(unpack_planes(packed, bits), want)
    with pytest.raises(ValueError, match="more than 5 bits"):
        pack_codes_a8(k_weight(T.Q6_K, 32).codes, 5)
    q8 = tensor_to_qweight("w", T.Q8_0, k_blocks(T.Q8_0, 32, 512, 0), 32, 512)
    assert a8_code_bits(q8, vnni=True) == 8  # all 8 bits in use


@needs_a8
@pytest.mark.parametrize(  # IQ4_XS: table codes on per-group records (test_a8_table.py)
    "qtype", (*(q for q in K_QUANTS if q != T.IQ4_XS), T.Q5_0, T.Q5_1), ids=lambda t: t.name
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 17, 70])
def test_gguf_records_against_per_group_records(qtype: T, rows: int) -> None:
    """Super-block records give the per-group float32 records' outputs bit for bit (the same
    scales, the same sums); 5- and 6-bit codes sum u = c + o with their own o (0, 16 or 32,
    not 128), so another float32 rounding: held to the exact product's bound like every
    layout. N = 96 and 80: full tiles and 2- and 1-vector tails; 70 rows: two row chunks."""
    for n in (96, 80):
        qw = k_weight(qtype, n=n, seed=rows)
        new = QuantLinear(qw, None, CPU, torch.bfloat16, QuantizedActivations.INT8)
        fmt = A8Scales.SUPERS if qw.supers is not None else A8Scales.FLOAT16
        assert (new.path, new.scale_format) == ("a8", fmt)
        assert new.code_bits == {T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6}.get(qtype, qw.bits)
        assert new.nbytes < per_group_layer(qw).codes.numel()  # the bytes before
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(n)).bfloat16()
        out = new(x)
        same_codes = per_group_layer(qw, new.code_bits)
        assert torch.equal(out.view(torch.int16), same_codes(x).view(torch.int16))
        assert_near_exact(out, x, qw)


@needs_a8
def test_fused_k_quants_keep_their_two_levels() -> None:
    """A Q4_K_M file's fused QKV: Q4_K q and k (zeros, g 32) with a Q6_K v (g 16): groups
    refined to 16, dmin = m = 0 for v, the values unchanged, super records still exact."""
    q, k, v = k_weight(T.Q4_K, 64, seed=1), k_weight(T.Q4_K, 32, seed=2), k_weight(T.Q6_K, 32)
    fused = concat_rows([q, k, v])
    assert fused.supers is not None and (fused.group_size, fused.bits) == (16, 8)
    want = torch.cat([p.dequantize() for p in (q, k, v)])
    assert torch.equal(fused.dequantize(), want)
    layer = QuantLinear(fused, None, CPU, torch.bfloat16, QuantizedActivations.INT8)
    ref = per_group_layer(fused, 6)
    assert (layer.scale_format, layer.code_bits, layer.offset) == (A8Scales.SUPERS, 6, 32)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(layer(x).view(torch.int16), ref(x).view(torch.int16))
    # one part without two levels (a Q8_0 v): the fusion falls back to per-group records
    q8 = QuantizedWeight(v.codes, v.scales.half(), None, 8, 16)
    assert concat_rows([q, k, q8]).supers is None


def test_unpermuted_rows_keep_their_two_levels() -> None:
    """attn_q's rows in llama.cpp's rotary order, unpermuted with the scales' two levels."""
    qw = _unpermute(k_weight(T.Q4_K, 64), heads=2)
    assert qw.supers is not None
    assert torch.equal(bits_of(qw.supers.scales()), bits_of(qw.scales))
    assert torch.equal(bits_of(qw.supers.zeros()), bits_of(qw.zeros))


def test_super_records_on_both_kernels() -> None:
    """Both int8-activation kernels read super-block records (the AVX2 one since session 19:
    float32 activations, or no VNNI); ``supers=False`` (table codes) gives per-group ones;
    Q8_0 / Q4_0 keep their float16 scales."""
    qw = k_weight(T.Q5_K)
    assert a8_scale_format(qw) is A8Scales.SUPERS
    assert a8_scale_format(qw, supers=False) is A8Scales.FLOAT32
    assert a8_scale_format(flat(qw)) is A8Scales.FLOAT32
    q4 = tensor_to_qweight("w", T.Q4_0, k_blocks(T.Q4_0, 32, 512, 0), 32, 512)
    assert a8_scale_format(q4) is A8Scales.FLOAT16
    layer = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.INT8)
    if layer.path == "a8":  # the AVX2 int8 path: 8-bit codes (no bit planes) in super records,
        # read as 6-bit ones (c + 32 in [0, 63]: no sign trick)
        assert (layer.scale_format, layer.code_bits) == (A8Scales.SUPERS | A8_NARROW, 8)
        assert layer.offset == 32


@needs_avx2
@pytest.mark.parametrize(
    ("qtype", "avx2_int8"),
    [(T.Q4_0, True), (T.Q4_K, True), (T.Q5_0, True), (T.Q5_K, True), (T.Q6_K, True),
     (T.Q8_0, False), (T.IQ4_NL, False), (T.IQ4_XS, False)],
)  # fmt: skip
def test_auto_activations_by_gguf_type(qtype: T, avx2_int8: bool) -> None:
    """auto on float32 layers (qlinear.a8_auto_supports): without VNNI, int8 for 4-bit codes
    and byte codes that span 6 bits (Q5_0, Q5_K, Q6_K: narrow, no sign trick); Q8_0's full
    bytes and the table codes keep float32; beside the VNNI kernel, float32 for all."""
    qw = tensor_to_qweight("w", qtype, k_blocks(qtype, 32, 512, 3), 32, 512)
    layer = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.AUTO)
    want = avx2_int8 and not qlinear._a8_kernel()
    assert layer.int8_activations is want
    assert layer.path == ("a8" if want else "kernel")
    if want and qtype in (T.Q4_K, T.Q5_K, T.Q6_K):  # the two levels of scales kept on AVX2
        assert layer.scale_format & ~A8_NARROW == A8Scales.SUPERS
    assert bool(layer.scale_format & A8_NARROW) is (want and qtype != T.Q4_0 and qtype != T.Q4_K)


def per_group_f32_layer(qw: QuantizedWeight) -> QuantLinear:
    """``qw``'s float32-activation layer on per-group float32 records (the AVX2 path's layout
    before super records)."""
    layer = QuantLinear(flat(qw), None, CPU, torch.float32, QuantizedActivations.INT8)
    layer.codes, layer.offset = pack_a8(flat(qw), A8Scales.FLOAT32, layer.code_bits)
    layer.scale_format = int(A8Scales.FLOAT32)
    return layer


@needs_avx2
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 17, 70])
def test_avx2_super_records_against_per_group_records(qtype: T, rows: int) -> None:
    """The AVX2 path (float32 activations) on super-block records gives the per-group float32
    records' outputs bit for bit: d * sc and -(dmin * m) computed as gguf does, each group's
    zero term before its block. In fewer bytes (Q4_K: 4.6 bits a weight instead of 6; the
    8-bit codes of Q2_K, Q3_K, Q5_K, Q6_K and IQ4_XS's levels 8.6 instead of 10). N = 96 and
    80; 1-70 rows: 4-row passes (2-row for Q5_K's and Q6_K's narrow codes) and their tails
    (one block of rows: 256 at K = 512)."""
    for n in (96, 80):
        qw = k_weight(qtype, n=n, seed=rows)
        new = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.INT8)
        assert (new.path, new.scale_format & ~A8_NARROW) == ("a8", A8Scales.SUPERS)
        # Q5_K and Q6_K read as 6-bit codes; the per-group layer below takes the sign trick
        assert bool(new.scale_format & A8_NARROW) is (qtype in (T.Q5_K, T.Q6_K))
        old = per_group_f32_layer(qw)
        assert new.nbytes < old.codes.numel()
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(n))
        out = new(x)
        assert torch.equal(out, old(x))
        q, d = quantize_activations(x)
        exact = exact_activations(q, d) @ qw.exact().t()
        torch.testing.assert_close(out.double(), exact, rtol=1e-5,
                                   atol=1e-5 * float(exact.abs().max()))  # fmt: skip


@needs_a8
def test_the_op_refuses_super_records_it_cannot_read() -> None:
    qw = k_weight(T.Q4_K, n=32)
    packed, off = pack_a8(qw, A8Scales.SUPERS)
    out = torch.empty(1, 32, dtype=torch.bfloat16)
    x = torch.randn(1, 512).bfloat16()
    with pytest.raises(RuntimeError, match="scale_format is 0"):
        torch.ops.kvserve.quant_linear_a8(out, x, packed, 4, 32, off, 3, True)
    with pytest.raises(RuntimeError, match="g 16 or 32"):
        torch.ops.kvserve.quant_linear_a8(out, x, packed, 4, 64, off, 2, True)
    six, off6 = pack_a8(k_weight(T.Q6_K, n=32), A8Scales.FLOAT32, 6)
    with pytest.raises(RuntimeError, match="AVX512-VNNI only"):
        torch.ops.kvserve.quant_linear_a8(out.float(), x.float(), six, 6, 16, off6, 0, False)
    with pytest.raises(RuntimeError, match="bits must be 4, 5, 6 or 8"):
        torch.ops.kvserve.quant_linear_a8(out, x, six, 7, 16, off6, 0, False)


@needs_a8
@pytest.mark.parametrize("key", ["llama-Q4_K_M", "qwen3-Q5_K_M"])
def test_llamacpp_files_in_the_decode_loop(key: str) -> None:
    """Files llama.cpp's converter and llama-quantize wrote (tests/model/llamacpp_kquant.py),
    in bf16 with their own Q6_K LM head: every projection and the head on the new records
    (K-quant super-blocks; Q5_K 5 bits; Q6_K, and q/k/v fused with a Q6_K v, 6 bits), and the
    C++ decode loop's tokens and KV bytes equal the Python layers' (KV checked every step)."""
    kw = {"dtype": "bfloat16", "quantization": "gguf", "quantization_lm_head": True,
          "block_size": 4, "num_kv_blocks": 200}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for eager in (True, False):
        e = LLMEngine(build_engine_config(str(DATA / f"{key}.gguf"), enforce_eager=eager, **kw))
        assert e.runner is not None
        model = e.runner.model
        assert (model.decode_loop is None) == eager
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == 5  # qkv, o, gate_up, down and the head
        assert {(m.scale_format, m.code_bits) for m in linears} == {
            (A8Scales.SUPERS, 4 if "Q4" in key else 5),
            (A8Scales.SUPERS, 6),
        }
        done = run_engine_checked(e, prompts()[:6], params)  # KV integrity after every step
        runs.append((done, [t.clone() for kv in e.runner.kv_caches for t in kv]))
    (want, want_kv), (got, got_kv) = runs
    assert got == want and sorted(got) == [str(i) for i in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(want_kv, got_kv, strict=True))


def test_a_padded_head_keeps_its_two_levels() -> None:
    """An LM head of 40 rows padded to the kernels' 48 (lm_head.pad_rows): zero rows in both
    levels, so the head still streams super-block records."""
    qw = k_weight(T.Q6_K, n=40)
    padded = pad_rows(qw)
    assert padded.shape == (48, 512) and padded.supers is not None
    assert torch.equal(bits_of(padded.supers.scales()), bits_of(padded.scales))
    assert torch.equal(padded.dequantize()[:40], qw.dequantize())
    assert not padded.dequantize()[40:].any()


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_codes_pack_a_block_of_rows_at_a_time(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pack_codes_a8`` in blocks of ``PACK_ROWS`` rows (its temporaries stay small) gives
    the whole matrix's bytes, with one offset for all of it."""
    codes = k_weight(T.Q6_K if bits != 4 else T.Q4_K, n=96).codes
    whole, off = pack_codes_a8(codes, bits)
    monkeypatch.setattr(qlinear, "PACK_ROWS", 32)
    blocks, off_blocks = pack_codes_a8(codes, bits)
    assert off_blocks == off and torch.equal(blocks, whole)


@needs_avx2
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_1, T.Q8_0, *K_QUANTS], ids=lambda t: t.name)
def test_avx2_many_rows_equal_each_row_alone(qtype: T) -> None:
    """A call of more than one pass of rows decodes each vector's scales once, in its first
    pass, and the later passes read them back (csrc/quant_linear_a8_avx2.h, a8_vec_avx2's
    cache); a call of one pass decodes in registers. Both give each row the same float32
    operations, so every row of a 70-row call (K = 512: one block of rows, 17 or 35 passes and
    a tail) equals that row alone bit for bit, zero terms (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) and
    narrow codes (Q5_1, Q5_K, Q6_K) included."""
    qw = k_weight(qtype, n=80, seed=7)
    layer = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.INT8)
    assert layer.path == "a8"
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(3))  # [70, K]
    out = layer(x)  # [70, N]
    for r in (0, 1, 4, 5, 33, 69):
        assert torch.equal(out[r : r + 1], layer(x[r : r + 1])), r
