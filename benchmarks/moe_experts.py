"""One MoE layer's routed experts: the PyTorch grouped path vs the C++ experts op.

OLMoE-1B-7B's layer shape by default (hidden 2048, expert intermediate 1024, 64 experts,
top-8), random weights and router logits (a new routing per call, cycling through 8, so the
experts' weights come from memory as in a real step). Three weight kinds:

* ``bf16``: dense bf16 experts, bf16 activations (``grouped_experts``: F.linear per expert;
  the op: ``wide_linear`` on the ``[N, K]`` stacks, float32 sums of the widened weights);
* ``bf16-packed``: the same experts, the op on the packed layout ``FusedExperts`` packs bf16
  stacks into (``wide_linear_packed`` with bf16 tokens: ``vdpbf16ps`` where the kernels have
  AVX512-BF16), what a bf16 MoE model runs;
* ``int4``: int4 g32 ``QuantLinear`` experts (``--quantization int4``), float32 activations
  (what ``dtype=auto`` is on AVX2-only CPUs).

Both paths use the C++ SiLU*up kernel (the fused ops). Prints the median ms per layer call.

    python benchmarks/moe_experts.py --tokens 1,8,32 --threads 1,2 --kinds bf16,bf16-packed,int4
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvserve.model.wide_linear import pack_wide_weight
from kvserve.moe.experts import GluActivation, grouped_experts
from kvserve.moe.experts_kernel import PackedExpert, experts_kernel
from kvserve.moe.router import RouterConfig, route
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import quantize_rtn

ROUTINGS = 8  # distinct routings cycled through


def timed(fn: Callable[[int], object], repeats: int) -> float:
    """Median seconds of ``fn(i)`` over ``repeats`` calls, after two warm-up calls."""
    for i in range(2):
        fn(i)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def weights(kind: str, e: int, h: int, inter: int) -> tuple[object, object, torch.dtype]:
    """(gate_up, down, activation dtype): stacked bf16 tensors, or lists of int4 layers."""
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) * 0.02).bfloat16()  # [E, 2I, H]
    down = (torch.randn(e, h, inter, generator=g) * 0.02).bfloat16()  # [E, H, I]
    if kind in ("bf16", "bf16-packed"):
        return gate_up, down, torch.bfloat16
    cpu = torch.device("cpu")

    def layers(w: torch.Tensor) -> list[QuantLinear]:
        return [QuantLinear(quantize_rtn(w[i].float(), 4, 32), None, cpu, torch.float32)
                for i in range(e)]  # fmt: skip

    return layers(gate_up), layers(down), torch.float32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,32", help="tokens per step (decode rows)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kinds", default="bf16,bf16-packed,int4")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    assert cpu_kernels.available(), "the C++ kernels did not build"
    e, h, inter, k = args.experts, args.hidden, args.intermediate, args.top_k
    print(f"H {h}, I {inter}, E {e}, top-{k}; median ms per layer call ({args.repeats} calls)")
    print("kind  tokens threads  grouped (PyTorch)  C++ op  speedup")
    for kind in args.kinds.split(","):
        gate_up, down, dtype = weights(kind, e, h, inter)
        # bf16-packed: the op on the layout FusedExperts packs bf16 stacks into (bf16 tokens
        # through wide_linear_packed: vdpbf16ps where built); the grouped path on the stacks
        op_parts = (packed(gate_up), packed(down)) if kind == "bf16-packed" else (gate_up, down)
        for t in (int(s) for s in args.tokens.split(",")):
            for threads in (int(s) for s in args.threads.split(",")):
                torch.set_num_threads(threads)
                a, b = compare(gate_up, down, op_parts, dtype, t, k, args.repeats)
                print(f"{kind:5} {t:6} {threads:7} {a * 1e3:18.2f} {b * 1e3:7.2f} {a / b:7.2f}x",
                      flush=True)  # fmt: skip


def packed(stack: object) -> list[PackedExpert]:
    """Each expert of a stacked ``[E, N, K]`` bf16 tensor on the packed layout."""
    assert isinstance(stack, torch.Tensor)
    return [PackedExpert(pack_wide_weight(w), w.shape[0]) for w in stack]


@torch.inference_mode()
def compare(
    gate_up: object, down: object, op_parts: tuple[object, object], dtype: torch.dtype, t: int,
    k: int, repeats: int,
) -> tuple[float, float]:  # fmt: skip
    """Median seconds per call of the grouped path and of the op (on ``op_parts``' weights),
    ``t`` tokens routed top-k."""
    op = experts_kernel(*op_parts, GluActivation())  # type: ignore[arg-type]
    fn_gate_up, fn_down = gate_up, down
    if isinstance(gate_up, list) and isinstance(down, list):
        fn_gate_up = lambda i, rows: gate_up[i](rows)  # noqa: E731
        fn_down = lambda i, rows: down[i](rows)  # noqa: E731
    h = op_hidden(gate_up)
    e = len(gate_up)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(t)
    xs = [torch.randn(t, h, generator=g).to(dtype) for _ in range(ROUTINGS)]
    routes = [route(torch.randn(t, e, generator=g).to(dtype), RouterConfig(e, k))
              for _ in range(ROUTINGS)]  # fmt: skip

    def old(i: int) -> object:
        w, ids = routes[i % ROUTINGS]
        return grouped_experts(xs[i % ROUTINGS], fn_gate_up, fn_down, w, ids,  # type: ignore[arg-type]
                               cpu_kernels.silu_and_mul)  # fmt: skip

    def new(i: int) -> object:
        w, ids = routes[i % ROUTINGS]
        return op.run(xs[i % ROUTINGS], w, ids)

    return timed(old, repeats), timed(new, repeats)


def op_hidden(gate_up: object) -> int:
    """H: the input size of the stacked tensor, or of the first expert's layer."""
    if isinstance(gate_up, torch.Tensor):
        return gate_up.shape[2]
    return gate_up[0].in_features  # type: ignore[index]


if __name__ == "__main__":
    main()
