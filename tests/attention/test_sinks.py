"""Attention sinks (gpt-oss): the reference against transformers' own gpt-oss eager attention,
every CPU path (C++ decode kernel, SDPA decode, fresh-prompt groups, padded context groups,
speculative rows) against the reference, with and without sliding windows, and bad sinks
refused. The Triton kernels' sinks are in tests/ops/test_triton_attention.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from kvserve.attention.paged import reference_paged_attention
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.ops import cpu_kernels
from tests.attention.test_window import QLEN, SEQ
from tests.attention.utils import CPU, HAS_COMPILER, backend, build_batch


class _EagerModule(nn.Module):
    """What transformers' gpt-oss ``eager_attention_forward`` reads from its attention."""

    def __init__(self, groups: int, sinks: torch.Tensor) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.sinks = nn.Parameter(sinks)
        self.eval()


@pytest.mark.parametrize("window", [None, 4])
def test_reference_equals_transformers_eager(window: int | None) -> None:
    """One request of 13 tokens, 5 of them queries after 8 cached, on scrambled blocks:
    gpt-oss's eager attention (float64) with its sinks and transformers' window mask."""
    q, kc, vc, md = build_batch([13], [5], 4, 8, 4, 2, 16, torch.float64, 5)
    sinks = torch.tensor([1.5, -0.5, 0.0, 3.0], dtype=torch.float64)
    pos = torch.arange(13)
    table = md.block_tables[0]
    k = kc[table[pos // 4], :, pos % 4].transpose(0, 1)[None]  # [1, 2, 13, 16]
    v = vc[table[pos // 4], :, pos % 4].transpose(0, 1)[None]
    q_pos, kv_pos = torch.arange(8, 13)[:, None], torch.arange(13)[None, :]
    if window is None:
        allowed = kv_pos <= q_pos  # [5, 13]
    else:
        allowed = sliding_window_causal_mask_function(window)(0, 0, q_pos, kv_pos)
    additive = torch.zeros(1, 1, 5, 13, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    expect, _ = eager_attention_forward(
        _EagerModule(2, sinks), q.transpose(0, 1)[None], k, v, additive, scaling=0.7
    )  # [1, 5, 4, 16]
    got = reference_paged_attention(q, kc, vc, md, 0.7, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, expect[0], atol=1e-6, rtol=1e-6)  # float32 inside
    plain = reference_paged_attention(q, kc, vc, md, 0.7, sliding_window=window)
    assert not torch.allclose(got, plain, atol=0.05)  # the sinks took weight


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_equals_reference(use_kernel: bool, dtype: torch.dtype) -> None:
    """Decode rows, speculative rows, a fresh-prompt group, a lone fresh prompt and padded
    context groups in one step, 8 heads over 2 KV heads (the kernel's GQA group of 4 reads
    its group's 4 sinks), with and without windows."""
    if use_kernel and not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    q, kc, vc, md = build_batch(SEQ, QLEN, 8, 400, 8, 2, 32, dtype, seed=7)
    md.spec_rows = frozenset({10, 11})
    sinks = torch.linspace(-2.0, 4.0, 8).to(dtype)  # some heads' sinks outweigh every key
    b = backend(use_kernel)
    b.build_metadata(md)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for window in (None, 5, 40):
        ref = reference_paged_attention(q, kc, vc, md, 0.2, sliding_window=window, sinks=sinks)
        fast = b.forward(q, kc, vc, md, 0.2, sliding_window=window, sinks=sinks)
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
        plain = b.forward(q, kc, vc, md, 0.2, sliding_window=window)
        assert not torch.allclose(fast, plain, atol=0.05)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_kernel_decode_with_sinks_equals_reference_directly() -> None:
    """The C++ kernel alone on decode rows (contexts of 1 to 77 tokens), float32."""
    q, kc, vc, md = build_batch([1, 9, 40, 77], [1, 1, 1, 1], 8, 40, 4, 2, 16, torch.float32, 3)
    sinks = torch.tensor([0.5, -1.0, 2.0, 8.0])  # 8: nearly all weight on the sink
    md.split_rows()
    assert md.decode is not None
    out = torch.empty_like(q)
    cpu_kernels.paged_decode_attention(
        out, q, kc, vc, md.decode.block_tables, md.decode.seq_lens, md.decode.seq_lens[:0],
        0.25, sinks=sinks,
    )  # fmt: skip
    want = reference_paged_attention(q, kc, vc, md, 0.25, sinks=sinks)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_bad_sinks_are_refused() -> None:
    q, kc, vc, md = build_batch([9], [9], 8, 4, 4, 2, 16, torch.float32, 1)
    b = TorchSDPABackend(CPU)
    for bad in (torch.zeros(3), torch.zeros(2, 2), torch.zeros(4, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"sinks must be a float tensor of one logit per "):
            b.forward(q, kc, vc, md, 0.2, sinks=bad)
