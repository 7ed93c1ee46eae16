"""The Triton LoRA kernels (``kvserve/ops/triton/lora.py``) against the gathered PyTorch
reference (``kvserve.lora.punica.lora_delta_reference``), under Triton's interpreter on CPU CI
(tests/conftest.py sets ``TRITON_INTERPRET=1``; ~3 ms a program: tiny shapes that still cross
the padded tails: K 36 over blocks of 64, a rank block of 3 slices, 130 channels over blocks
of 128), or on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.lora.punica import LoRAMapping, lora_delta_reference
from kvserve.ops.triton import lora as triton_lora


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"]
)
def test_triton_lora_add_equals_reference(dtype: torch.dtype, tol: float) -> None:
    dev, g = _device(), torch.Generator().manual_seed(0)
    k, rank, outs, slots = 36, 4, (24, 8, 130), 3
    row_slots, counts = [0, -1, 2, 1, 2], [1, 2, 1, 1, 1]  # three adapters and the base
    a = torch.randn(slots, len(outs) * rank, k, generator=g) * 0.5  # [S, n*R, K]
    bts = [torch.randn(slots, rank, n, generator=g) * 0.5 for n in outs]  # [S, R, N_i]
    mapping = LoRAMapping.from_rows(row_slots, counts, torch.device("cpu"))
    t = int(mapping.token_slots.shape[0])
    x = torch.randn(t, k, generator=g)
    base = torch.randn(t, sum(outs), generator=g)
    out = base.to(dtype).to(dev).clone()
    triton_lora.lora_add(
        out, x.to(dtype).to(dev), a.to(dtype).to(dev), [b.to(dtype).to(dev) for b in bts],
        mapping.token_slots.to(dev),
    )  # fmt: skip
    ref = lora_delta_reference(
        x.to(dtype).double(), a.to(dtype).double(), [b.to(dtype).double() for b in bts],
        mapping.token_slots,
    )  # fmt: skip
    want = (base.to(dtype).double() + ref).to(dtype)
    torch.testing.assert_close(out.cpu(), want, rtol=tol, atol=tol)
    base_rows = mapping.token_slots == -1
    assert torch.equal(out.cpu()[base_rows], base.to(dtype)[base_rows])  # untouched
