"""The quantized kernel with float32 activations (AVX2-only CPUs' path), against float32
``F.linear`` and the memory floor, optionally against another tree's kernel (``--baseline``).

Run through ``benchmarks/quant_kernels.py --float32``. Each case cycles through enough
copies of the layer's weights (``--stream-mb``, well over the L3) that they come from memory,
as in a decode step; times are per call, the median of ``--repeats`` passes. The floor is the
layer's bytes (codes + scales) over the read bandwidth measured here the same way (a sum over
``--stream-mb`` of float32). With ``--baseline TREE`` (a checkout, e.g. ``git archive main
kvserve | tar -x -C TREE``), worker processes with ``PYTHONPATH=TREE`` and with this tree
alternate ``--alternate`` times, and the medians of their medians are reported: a shared
machine's load moves between runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VARIANTS = [("int8 g32", 8, 32), ("int8 g128", 8, 128), ("int4 g32", 4, 32), ("int4 g128", 4, 128)]


# perf_counter (wall) or process_time (``--clock cpu``: this process's CPU seconds, which on a
# shared machine do not count the time other processes hold the cores; use with --threads 1,
# since with more an OpenMP barrier's spinning counts too).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def timed_cycle(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    return statistics.median(times)


def per_call_us(fns: list[Callable[[], object]], repeats: int) -> float:
    """Microseconds per call of a pass through ``fns`` (one per weight copy)."""
    return timed_cycle(lambda: [f() for f in fns], repeats) * 1e6 / len(fns)


def read_gbps(stream_mb: int, repeats: int) -> float:
    """Read bandwidth (GB/s) of a float32 sum over ``stream_mb`` MB: the memory floor's rate."""
    buf = torch.ones(stream_mb * 2**20 // 4)
    return buf.numel() * 4 / timed_cycle(buf.sum, repeats) / 1e9


def _forced(layer: Any, x: torch.Tensor, direct_rows: int) -> Callable[[], object]:
    out = x.new_empty(x.shape[0], layer.out_features)
    return lambda: torch.ops.kvserve.quant_linear(
        out, x, layer.codes, layer.scales_t, layer.zeros_t, layer.bits, layer.group_size,
        layer.offset, direct_rows,
    )  # fmt: skip


def worker(
    n: int, k: int, rows: list[int], repeats: int, stream_mb: int, forced: bool
) -> dict[str, Any]:
    """One process's medians (us per call) for every variant and row count; ``forced``: also
    each of the kernel's two float32 paths, forced (direct, tiles), and the AVX2 int8-activation
    path (``a8``: ``--quantization-activations int8``) where the build has it."""
    from kvserve.config import QuantizedActivations
    from kvserve.ops import cpu_kernels
    from kvserve.quantization.qlinear import QuantLinear
    from kvserve.quantization.qweight import quantize_rtn

    assert cpu_kernels.available(), "the C++ kernels did not build"
    isa_op = getattr(torch.ops.kvserve, "quant_linear_f32_isa", None)
    result: dict[str, Any] = {
        "kvserve": str(Path(sys.modules["kvserve"].__file__ or "").parent),
        "quant_linear_f32_isa": str(isa_op()) if isa_op is not None else "generic",
        "read_gbps": read_gbps(stream_mb, repeats),
        "times_us": {},
        "bytes": {},
    }
    cpu = torch.device("cpu")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    copies = max(2, stream_mb * 2**20 // (n * k * 4))
    dense = [w.clone() for _ in range(copies)]
    result["bytes"]["fp32 F.linear"] = n * k * 4
    times = result["times_us"]
    for m in rows:
        x = torch.randn(m, k)
        fns = [lambda x=x, d=d: F.linear(x, d) for d in dense]
        times[f"fp32 F.linear|{m}"] = per_call_us(fns, repeats)
    dense.clear()
    for name, bits, group in VARIANTS:
        qw = quantize_rtn(w, bits, group, True if bits == 4 else None)  # Q4_0-like: no zeros
        first = QuantLinear(qw, None, cpu, torch.float32)
        assert first.use_kernel
        copies = max(2, stream_mb * 2**20 // first.nbytes)
        layers = [first] + [QuantLinear(qw, None, cpu, torch.float32) for _ in range(copies - 1)]
        result["bytes"][name] = first.nbytes
        for m in rows:
            x = torch.randn(m, k)
            times[f"{name}|{m}"] = per_call_us([lambda x=x, q=q: q(x) for q in layers], repeats)
            for path, limit in (("direct", 1 << 30), ("tiles", 0)) if forced else ():
                fns = [_forced(q, x, limit) for q in layers]
                times[f"{name} {path}|{m}"] = per_call_us(fns, repeats)
        layers.clear()
        if forced and _has_a8_avx2():  # --quantization-activations int8: pack_a8's records
            acts = QuantizedActivations.INT8
            a8 = [QuantLinear(qw, None, cpu, torch.float32, acts) for _ in range(copies)]
            assert a8[0].path == "a8"
            for m in rows:
                x = torch.randn(m, k)
                times[f"{name} a8|{m}"] = per_call_us([lambda x=x, q=q: q(x) for q in a8], repeats)
            a8.clear()
    return result


def _has_a8_avx2() -> bool:
    """Whether this tree's kernels have the AVX2 int8-activation path (quant_linear_a8_avx2.h)."""
    isa = getattr(torch.ops.kvserve, "quant_linear_a8_isa", None)
    return isa is not None and str(isa()) == "avx2"


def lscpu_record() -> dict[str, str]:
    """lscpu's model name and flags (the CPU kind the numbers are from)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "Flags", "CPU family", "Model", "L3 cache", "CPU(s)"):
            fields[key.strip()] = value.strip()
    return fields


def compare(args: Any) -> dict[str, Any]:
    """Alternate worker processes of the baseline tree and this one; medians of medians."""
    here = str(Path(__file__).resolve().parents[1])
    trees = {"after": here}
    if args.baseline:
        trees = {"before": str(Path(args.baseline).resolve()), "after": here}
    spec = {"n": args.n, "k": args.k, "rows": args.rows, "repeats": args.repeats,
            "stream_mb": args.stream_mb, "threads": args.threads, "clock": args.clock}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    for i in range(args.alternate):
        for tree, path in trees.items():
            env = {**os.environ, "PYTHONPATH": path}
            code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
                   "from quant_kernels_f32 import worker_main; worker_main()"  # fmt: skip
            arg = json.dumps({**spec, "forced": tree == "after"})
            out = subprocess.run([sys.executable, "-c", code, arg], env=env, check=True,
                                 capture_output=True, text=True, cwd=path)  # fmt: skip
            runs[tree].append(json.loads(out.stdout.splitlines()[-1]))
            print(f"run {i + 1}/{args.alternate} {tree}: done", file=sys.stderr)
    summary = {}
    for tree, rs in runs.items():
        keys = rs[0]["times_us"].keys()
        summary[tree] = {
            "quant_linear_f32_isa": rs[0]["quant_linear_f32_isa"],
            "read_gbps": statistics.median(r["read_gbps"] for r in rs),
            "times_us": {c: statistics.median(r["times_us"][c] for r in rs) for c in keys},
            "bytes": rs[0]["bytes"],
        }
    return {"runs": runs, "summary": summary}


def worker_main() -> None:
    global _clock
    spec = json.loads(sys.argv[-1])
    torch.set_num_threads(spec["threads"])
    _clock = CLOCKS[spec["clock"]]
    res = worker(
        spec["n"], spec["k"], spec["rows"], spec["repeats"], spec["stream_mb"], spec["forced"]
    )
    print(json.dumps(res))


def table(summary: dict[str, Any], rows: list[int]) -> str:
    """Markdown: us per call for each tree, and the memory floor."""
    after = summary["after"]
    gbps = after["read_gbps"]
    head = " | ".join(f"{t} us" for t in summary)
    lines = [f"| weights | rows | {head} | direct us | tiles us | a8 us | floor us |",
             "|---|---|" + "---|" * (len(summary) + 4)]  # fmt: skip
    for name in ["fp32 F.linear"] + [v[0] for v in VARIANTS]:
        floor = after["bytes"][name] / gbps / 1e3
        for m in rows:
            cells = [f"{s['times_us'][f'{name}|{m}']:.0f}" for s in summary.values()]
            t = after["times_us"]
            extra = [
                f"{t.get(f'{name} {p}|{m}', float('nan')):.0f}" for p in ("direct", "tiles", "a8")
            ]
            lines.append(f"| {name} | {m} | " + " | ".join(cells + extra) + f" | {floor:.0f} |")
    return "\n".join(lines)
