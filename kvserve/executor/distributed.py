"""The torch.distributed process group of a multi-rank model (tensor parallelism)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on this host now (the ranks' rendezvous, chosen by the driver)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_worker_distributed(
    rank: int, world_size: int, port: int, device: str | torch.device = "cpu"
) -> dist.ProcessGroup | None:
    """Join this worker to the ranks' process group: gloo on CPU, nccl on CUDA, rendezvous
    on ``127.0.0.1:port`` (one machine). Returns the group (torch's default group, which
    the tensor-parallel layers use); None with one rank (no group needed)."""
    if world_size <= 1:
        return None
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    return dist.group.WORLD
