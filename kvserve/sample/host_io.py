"""Moving a sampler step's small host data to the device and its results back, without a
host sync anywhere but the one read of the results.

On CUDA, ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the
stream (``torch.cuda.set_sync_debug_mode("error")`` refuses it); a pinned buffer with a
non-blocking copy only queues the copy. Reading results back is a sync by nature, so the
sampler does it once per call: every result tensor is flattened into one float64 tensor and
read with a single ``tolist``. float64 holds every float32 value and every integer below 2**53
exactly, so the values are the same as separate reads would give.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A 1-D (or nested) tensor of host ``values`` on ``device``, queued without a sync."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for CUDA goes through pinned memory."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def as_float32(values: Sequence[float]) -> list[float]:
    """``values`` rounded to float32 on the host, as a float32 tensor would hold them: a
    decision such as "p < 1" must be taken on the value the kernel will compare with."""
    return list(array("f", values))


def read_back(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """The values of ``tensors`` (any shapes), flattened, from one device-to-host read."""
    if not tensors:
        return []
    flat: list[float] = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out: list[list[float]] = []
    start = 0
    for t in tensors:
        out.append(flat[start : start + t.numel()])
        start += t.numel()
    return out
