"""Who this process is among the tensor-parallel ranks, and the collectives the layers use.

There is no global parallel state: a ``TPGroup`` is built once per worker process (from
``init_process_group``) and passed explicitly into the model's constructor, the same way
``AttentionMetadata`` is passed into ``forward``. At ``world_size == 1`` every collective is a
no-op that returns its input unchanged, so a single-process model runs exactly the ops it
ran before tensor parallelism existed.

Collectives are blocking calls of ``torch.distributed`` on the group: every rank of the group
must make the same calls in the same order with tensors of the same shape (the driver
broadcasts the step so that the ranks' forwards match).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# How long a collective may wait for the other ranks before raising instead of hanging (a
# dead rank otherwise blocks the others forever).
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks of one model.

    Built per process and never sent to another (a process group is a local handle).
    """

    rank: int  # 0 .. world_size - 1; rank 0 samples (the full logits are gathered there)
    world_size: int  # number of ranks the model is sharded over
    # the torch.distributed group the collectives run on; None at world_size 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise ValueError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"rank must be an int, got {self.rank!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")
        if self.world_size > 1 and self.group is None:
            raise ValueError(f"world_size {self.world_size} needs a process group")
        if self.world_size == 1 and self.group is not None:
            raise ValueError("world_size 1 runs without a process group (group=None)")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that receives the gathered logits and samples."""
        return self.rank == 0


# The unsharded model: one process, no communication.
SINGLE = TPGroup(rank=0, world_size=1)


def divide(total: int, tp: TPGroup, what: str) -> int:
    """``total / world_size``; a ``ValueError`` naming ``what`` when it does not divide."""
    if total % tp.world_size:
        raise ValueError(
            f"{what} ({total}) is not divisible by tensor_parallel_size ({tp.world_size})"
        )
    return total // tp.world_size


def backend_for(device: str | torch.device) -> str:
    """The torch.distributed backend for a device type: gloo on CPU, nccl on CUDA."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl"
    raise ValueError(f"tensor parallelism supports cpu (gloo) and cuda (nccl), not {kind!r}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now: the ranks' rendezvous, chosen by the driver."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_process_group(
    rank: int,
    world_size: int,
    port: int,
    device: str | torch.device = "cpu",
    host: str = "127.0.0.1",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> TPGroup:
    """Join the ranks of one model (every rank calls this with the same ``world_size``,
    ``port`` and ``host``: rank 0's address, where the TCP rendezvous runs) and return this
    rank's ``TPGroup``. At ``world_size`` 1 nothing is initialised (``SINGLE``).

    The device-specific setup lives here only: on CUDA, rank r uses GPU r of the node.
    """
    if world_size == 1:
        return TPGroup(rank=rank, world_size=1)
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return TPGroup(rank=rank, world_size=world_size, group=dist.group.WORLD)


def group_from_initialized() -> TPGroup:
    """The ``TPGroup`` of an already initialised default process group (a worker whose
    launcher called ``torch.distributed.init_process_group`` itself)."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised; call init_process_group")
    world = dist.get_world_size()
    if world == 1:
        return SINGLE
    return TPGroup(rank=dist.get_rank(), world_size=world, group=dist.group.WORLD)


def destroy_process_group(tp: TPGroup) -> None:
    """Leave the group (at shutdown); nothing at world_size 1."""
    if tp.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place; returns ``x`` itself at world_size 1."""
    if tp.world_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp.group)
    return x


def all_gather(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, on every rank."""
    if tp.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)


def gather_to_driver(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor | None:
    """Every rank's ``x`` concatenated along ``dim`` on rank 0 (``None`` on the others): the
    LM head's logits, which only rank 0 samples. Half the traffic of ``all_gather``."""
    if tp.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)] if tp.is_driver else None
    dst = dist.get_global_rank(tp.group, 0) if tp.group is not None else 0
    dist.gather(x, parts, dst=dst, group=tp.group)
    return torch.cat(parts, dim=dim) if parts is not None else None
