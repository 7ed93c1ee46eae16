"""The CPU_KERNEL backend: the C++ decode kernel against the reference and the SDPA path."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.attention.paged import reference_paged_attention
from kvserve.attention.torch_sdpa import TorchSDPABackend
from tests.attention.utils import CPU, HAS_COMPILER, build_batch

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("h", "hkv", "d", "block_size"),
    [(4, 2, 16, 8), (8, 8, 32, 4), (8, 2, 64, 16), (12, 3, 16, 1), (4, 1, 128, 16), (8, 2, 64, 24)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_kernel_equals_reference(
    dtype: torch.dtype, h: int, hkv: int, d: int, block_size: int, seed: int
) -> None:
    """The C++ decode kernel on random block tables, mixed with prefill rows, and alone."""
    seq_lens = [1, 17, 33, 5, 64, 40, 9, 70]
    query_lens = [1, 1, 1, 5, 1, 8, 9, 1]
    q, kc, vc, md = build_batch(seq_lens, query_lens, block_size, 400, h, hkv, d, dtype, seed)
    ref = reference_paged_attention(q, kc, vc, md, scale=d**-0.5)
    kernel = CpuKernelBackend(CPU)
    kernel.build_metadata(md)
    fast = kernel.forward(q, kc, vc, md, scale=d**-0.5)
    assert md.decode is not None and md.decode._mask is None  # the kernel needs no mask
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    # A single decode row: the kernel splits its heads across threads instead of rows.
    q1, kc1, vc1, md1 = build_batch([45], [1], block_size, 64, h, hkv, d, dtype, seed)
    ref1 = reference_paged_attention(q1, kc1, vc1, md1, scale=0.3)
    fast1 = kernel.forward(q1, kc1, vc1, kernel.build_metadata(md1), 0.3)
    torch.testing.assert_close(fast1, ref1, atol=tol, rtol=tol)


def test_cpu_kernel_matches_sdpa_path_across_thread_counts() -> None:
    """Many rows (whole rows per thread) and few rows (heads per thread), 1 and 2 threads."""
    seq_lens = [
        int(x) for x in torch.randint(1, 90, (24,), generator=torch.Generator().manual_seed(3))
    ]
    q, kc, vc, md = build_batch(seq_lens, [1] * 24, 16, 400, 8, 4, 32, torch.float32, 4)
    ref = reference_paged_attention(q, kc, vc, md, scale=0.2)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            kernel = CpuKernelBackend(CPU)
            torch.testing.assert_close(
                kernel.forward(q, kc, vc, kernel.build_metadata(md), 0.2), ref
            )
    finally:
        torch.set_num_threads(threads)


def test_cpu_kernel_rejects_bad_input() -> None:
    q, kc, vc, md = build_batch([5], [1], 4, 8, 2, 1, 4, torch.float32, 0)  # head_dim 4
    kernel = CpuKernelBackend(CPU)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple"):
        kernel.forward(q, kc, vc, kernel.build_metadata(md), 0.5)
    q, kc, vc, md = build_batch([5], [1], 4, 8, 2, 1, 16, torch.float32, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.forward(q.to(torch.bfloat16), kc, vc, kernel.build_metadata(md), 0.5)


def test_cpu_kernel_bf16_is_at_least_as_accurate_as_sdpa() -> None:
    """In bf16 the two paths round differently (SDPA rounds probabilities to bf16 before P@V,
    the kernel keeps them in float32), so they are not bit-equal; against a float64 reference
    the kernel's error is the smaller one."""
    lens = [
        int(x) for x in torch.randint(20, 200, (32,), generator=torch.Generator().manual_seed(0))
    ]
    q, kc, vc, md = build_batch(lens, [1] * 32, 16, 600, 16, 8, 64, torch.bfloat16, 0)
    exact = reference_paged_attention(q.double(), kc.double(), vc.double(), md, 0.125)
    sdpa, kernel = TorchSDPABackend(CPU), CpuKernelBackend(CPU)
    sdpa_out = sdpa.forward(q, kc, vc, sdpa.build_metadata(md), 0.125)
    kernel_out = kernel.forward(q, kc, vc, kernel.build_metadata(md), 0.125)
    sdpa_err = (sdpa_out.double() - exact).abs().mean()
    kernel_err = (kernel_out.double() - exact).abs().mean()
    assert kernel_err < sdpa_err
