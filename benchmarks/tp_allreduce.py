"""What tensor parallelism's communication costs per decode step over gloo (CPU).

Two (``--world-size``) processes joined in a gloo group time one all-reduce of a
``[rows, hidden]`` tensor (bf16 and float32), the collective each row-parallel layer ends
with, and the gather of ``[rows, vocab / world_size]`` logits on rank 0 that the LM head ends
with. A decode step of an L-layer model makes 2 L + 1 all-reduces (o_proj and down_proj of
each layer, plus the embedding) and one gather:

    per step = (2 L + 1) * all_reduce(rows, hidden) + gather(rows, vocab / world_size)

computed for SmolLM2-135M (the built-in model: hidden 576, 30 layers, vocabulary 49152) and
TinyLlama-1.1B (hidden 2048, 22 layers, vocabulary 32000). Prints, in microseconds on rank
0's clock, the median of single calls with the ranks aligned by a barrier before each (the
cost when both ranks are on a core) and the mean of back-to-back all-reduces (as a forward
makes them: on a machine with more runnable threads than cores, a rank that is descheduled
stalls the other, and this column shows it).

    python benchmarks/tp_allreduce.py
    python benchmarks/tp_allreduce.py --rows 1,8,64 --repeats 300
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.distributed.parallel_state import (
    TPGroup,
    all_reduce,
    destroy_process_group,
    gather_to_driver,
    init_process_group,
)

MODELS = {  # hidden -> (name, layers, vocabulary)
    576: ("SmolLM2-135M", 30, 49152),
    2048: ("TinyLlama-1.1B", 22, 32000),
}
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def median_us(tp: TPGroup, fn: Callable[[], object], repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=tp.group)  # every rank starts together: no skew in the timing
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def loop_us(tp: TPGroup, fn: Callable[[], object], repeats: int) -> float:
    dist.barrier(group=tp.group)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def bench(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    tp = init_process_group(rank, world_size, port, "cpu")
    rows_list = [int(r) for r in args.rows.split(",")]
    lines = []
    for hidden, (name, layers, vocab) in MODELS.items():
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for rows in rows_list:
                x = torch.randn(rows, hidden).to(dtype)  # [rows, hidden]
                logits = torch.randn(rows, vocab // world_size).to(dtype)  # [rows, V / tp]
                ar = median_us(tp, lambda x=x: all_reduce(x, tp), args.repeats)
                ga = median_us(tp, lambda lg=logits: gather_to_driver(lg, tp), args.repeats)
                loop = loop_us(tp, lambda x=x: all_reduce(x, tp), args.repeats)
                step = (2 * layers + 1) * ar + ga
                lines.append(
                    f"{name:15s} {hidden:6d} {dname:5s} {rows:5d} {ar:11.1f} {loop:11.1f} "
                    f"{ga:11.1f} {step / 1000:12.2f}"
                )
    if rank == 0:
        print(f"gloo, world size {world_size}, {args.threads} thread(s) per rank, "
              f"median of {args.repeats}")  # fmt: skip
        print(f"{'model':15s} {'hidden':>6s} {'dtype':5s} {'rows':>5s} {'allreduce':>11s} "
              f"{'back2back':>11s} {'gather':>11s} {'per step ms':>12s}")  # fmt: skip
        print("\n".join(lines))
    destroy_process_group(tp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", default="1,8,64", help="comma-separated batch rows")
    parser.add_argument("--dtypes", default="bf16,f32", help="bf16 and/or f32")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    args = parser.parse_args()
    port = args.port or _free_port()
    mp.spawn(bench, args=(args.world_size, port, args), nprocs=args.world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
