"""Every registered backend that runs here against ``reference_paged_attention``, on steps
holding every kind of row: fresh prefills (grouped and lone), prefills after cached context
(prefix-cache hits and chunks), decode rows and speculative verification rows, on scattered
block tables padded with block 0, with GQA, sliding windows and soft-caps.

The backends come from the selector's registry: a new backend that supports the CPU (the
Triton one under ``TRITON_INTERPRET=1``) is tested here without an edit.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.paged import AttentionMetadata, reference_paged_attention
from kvserve.attention.selector import BACKENDS, BackendUnavailable, backend_class
from tests.attention.utils import CPU, build_batch


def runnable(dtype: torch.dtype, head_size: int = 16) -> list[type[AttentionBackend]]:
    """The registered backends that run on this machine's CPU in ``dtype``."""
    found = []
    for name in BACKENDS:
        try:
            cls = backend_class(name)
        except BackendUnavailable:
            continue
        if cls.supports(CPU, dtype, head_size, sliding_window=True, soft_cap=True) is None:
            found.append(cls)
    return found


BACKEND_IDS = [cls.name.value for cls in runnable(torch.float32)]

# Rows: 0 decode; 1, 2 fresh prompts of one length (a group); 3 a lone fresh prompt;
# 4 a prefix-cache hit (40 cached, 24 new); 5 a verification row (4 queries); 6 a middle
# chunk of a long prompt (300 cached, 37 new, past one SDPA key block); 7 decode at 1 token;
# 8 a verification row of 2 queries at a block boundary.
SEQ = [57, 9, 9, 14, 64, 30, 337, 1, 16]
QLEN = [1, 9, 9, 14, 24, 4, 37, 1, 2]
SPEC = frozenset({5, 8})


def _step(
    h: int, hkv: int, d: int, dtype: torch.dtype, seed: int, block_size: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    q, kc, vc, md = build_batch(SEQ, QLEN, block_size, 200, h, hkv, d, dtype, seed)
    md.spec_rows = SPEC
    return q, kc, vc, md


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("cls", runnable(torch.float32), ids=BACKEND_IDS)
@pytest.mark.parametrize(("h", "hkv"), [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (7, None), (None, 3.0), (20, 2.5)])
def test_every_row_kind_equals_reference(
    cls: type[AttentionBackend], h: int, hkv: int, window: int | None, soft_cap: float | None
) -> None:
    q, kc, vc, md = _step(h, hkv, 16, torch.float32, seed=h + hkv)
    opts = {"sliding_window": window, "soft_cap": soft_cap}
    ref = reference_paged_attention(q, kc, vc, md, 0.25, **opts)
    backend = cls(CPU)
    assert backend.build_metadata(md) is md
    out = backend.forward(q, kc, vc, md, 0.25, **opts)
    assert out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", runnable(torch.bfloat16), ids=lambda c: c.name.value)
@pytest.mark.parametrize("block_size", [4, 16])
def test_bfloat16_equals_reference(cls: type[AttentionBackend], block_size: int) -> None:
    q, kc, vc, md = _step(8, 2, 32, torch.bfloat16, seed=block_size, block_size=block_size)
    backend = cls(CPU)
    backend.build_metadata(md)
    for window, cap in ((None, None), (5, 4.0)):
        ref = reference_paged_attention(q, kc, vc, md, 0.2, sliding_window=window, soft_cap=cap)
        out = backend.forward(q, kc, vc, md, 0.2, sliding_window=window, soft_cap=cap)
        torch.testing.assert_close(out, ref, atol=_tol(torch.bfloat16), rtol=_tol(torch.bfloat16))


@pytest.mark.parametrize("cls", runnable(torch.float32), ids=BACKEND_IDS)
def test_unused_slots_are_never_read(cls: type[AttentionBackend]) -> None:
    """Every cache slot outside the rows' contexts holds NaN (the padding entries of the
    block tables point at block 0, which holds some row's K/V or garbage): no output row
    may see one."""
    q, kc, vc, md = _step(8, 2, 16, torch.float32, seed=11)
    used = torch.zeros(200 * 8, dtype=torch.bool)  # per slot: in some row's context
    for i, length in enumerate(SEQ):
        pos = torch.arange(length)
        used[md.block_tables[i, pos // 8] * 8 + pos % 8] = True
    unused = ~used.view(200, 8)  # [num_blocks, bs]
    kc.masked_fill_(unused[:, None, :, None], float("nan"))
    vc.masked_fill_(unused[:, None, :, None], float("nan"))
    ref = reference_paged_attention(q, kc, vc, md, 0.25)
    backend = cls(CPU)
    out = backend.forward(q, kc, vc, backend.build_metadata(md), 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", runnable(torch.float32), ids=BACKEND_IDS)
def test_write_kv_then_attend_over_one_step(cls: type[AttentionBackend]) -> None:
    """The backend's own ``write_kv`` stores the step's K/V where its ``forward`` reads them:
    a fresh prompt of 11 tokens equals dense causal attention over its K/V."""
    g = torch.Generator().manual_seed(2)
    kc, vc = torch.zeros(6, 2, 4, 16), torch.zeros(6, 2, 4, 16)
    table = [4, 1, 5]  # scattered blocks
    md = AttentionMetadata(
        slot_mapping=torch.tensor([table[p // 4] * 4 + p % 4 for p in range(11)]),
        query_start_loc=[0, 11],
        seq_lens=[11],
        block_tables=torch.tensor([table]),
        block_size=4,
    )
    q, k, v = (torch.randn(11, n, 16, generator=g) for n in (4, 2, 2))  # [T, H or Hkv, D]
    backend = cls(CPU)
    backend.write_kv(k, v, kc, vc, md)
    out = backend.forward(q, kc, vc, backend.build_metadata(md), 0.25)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=0.25, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", runnable(torch.float32), ids=BACKEND_IDS)
def test_metadata_serves_every_layer(cls: type[AttentionBackend]) -> None:
    """One step's metadata, built once, serves layers with different windows and caps in any
    order (Gemma 2 alternates them), as the reference does per call."""
    q, kc, vc, md = _step(8, 2, 16, torch.float32, seed=5)
    backend = cls(CPU)
    backend.build_metadata(md)
    for window, cap in [(5, None), (None, None), (11, 3.0), (5, None), (None, 3.0)]:
        ref = reference_paged_attention(q, kc, vc, md, 0.3, sliding_window=window, soft_cap=cap)
        out = backend.forward(q, kc, vc, md, 0.3, sliding_window=window, soft_cap=cap)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
