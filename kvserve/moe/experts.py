"""The experts of one MoE layer, stacked, and the step's tokens run through them.

``grouped_experts`` is the fast path: the step's ``T * k`` (token, expert) pairs are sorted by
expert (a stable sort, so each expert's rows keep token order), gathered once with
``index_select``, and each ACTIVE expert runs one gate/up matmul, the activation and one down
matmul over all of its rows; the rows are scaled by their routing weights and added back to
their tokens with one ``index_add_``. The Python loop is over the experts that got tokens this
step (at most ``min(E, T * k)``), never over tokens. ``reference_experts`` is the yardstick:
one token and one chosen expert at a time, matrix-vector products, nothing shared; the tests
hold the grouped path to it on skewed routings.

Rounding follows transformers' ``*Experts.forward`` so bf16 runs round where it does: each
expert's output is in the model dtype, multiplied by its weight (in the model dtype, or in
float32 for Mixtral, then rounded once), and the contributions are summed into zeros of the
model dtype in expert order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

# act(gate) * up for gate_up = [N, 2 * I] -> [N, I] (llama.ACTIVATIONS' PyTorch or C++ op)
ActAndMul = Callable[[torch.Tensor], torch.Tensor]
# (expert, rows [n, K]) -> [n, N]: one expert's projection, e.g. its quantized layer
ExpertLinear = Callable[[int, torch.Tensor], torch.Tensor]
# stacked dense weights [E, N, K], or a function per expert
ExpertWeights = torch.Tensor | ExpertLinear


def _linear(w: ExpertWeights) -> ExpertLinear:
    if isinstance(w, torch.Tensor):
        return lambda e, rows: F.linear(rows, w[e])
    return w


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_experts(
    x: torch.Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_and_mul: ActAndMul = silu_and_mul,
) -> torch.Tensor:
    """``x [T, H]``; ``gate_up [E, 2I, H]`` (gate rows, then up rows); ``down [E, H, I]``;
    ``weights [T, k]`` and ``ids [T, k]`` from ``router.route`` -> ``[T, H]``, the weighted
    sum of each token's k experts' outputs. ``gate_up``/``down`` may be functions of
    ``(expert, rows)`` instead (quantized experts: ``FusedExperts.set_quantized``)."""
    k = ids.shape[1]
    gate_up_fn, down_fn = _linear(gate_up), _linear(down)
    flat = ids.reshape(-1)  # [T * k] expert of each (token, slot) pair
    order = torch.argsort(flat, stable=True)  # [T * k] pairs sorted by expert
    tokens = torch.div(order, k, rounding_mode="floor")  # [T * k] each sorted pair's token
    counts = torch.bincount(flat)  # [max id + 1] pairs per expert
    xs = x.index_select(0, tokens)  # [T * k, H]
    ys = torch.empty_like(xs)  # [T * k, H] each pair's expert output
    start = 0
    active = torch.nonzero(counts).flatten().tolist()  # experts with tokens, ascending
    for e, n in zip(active, counts[active].tolist(), strict=True):
        rows = xs[start : start + n]  # [n, H] this expert's tokens
        h = act_and_mul(gate_up_fn(e, rows))  # [n, I]
        ys[start : start + n] = down_fn(e, h)
        start += n
    scaled = (ys * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)  # [T * k, H]
    out = torch.zeros_like(x)  # [T, H]
    return out.index_add_(0, tokens, scaled)


def reference_experts(
    x: torch.Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_and_mul: ActAndMul = silu_and_mul,
) -> torch.Tensor:
    """``grouped_experts``' result computed one token and one routed expert at a time."""
    out = torch.zeros_like(x)  # [T, H]
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):  # expert order
            e = int(ids[t, j])
            if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
                h = act_and_mul((gate_up[e] @ x[t]).unsqueeze(0))[0]  # [I] matrix-vector
                y = down[e] @ h  # [H]
            else:  # the expert's own layers, one row
                h = act_and_mul(_linear(gate_up)(e, x[t : t + 1]))  # [1, I]
                y = _linear(down)(e, h)[0]
            out[t] += (y * weights[t, j]).to(x.dtype)
    return out


class FusedExperts(nn.Module):
    """One layer's ``E`` experts as two stacked weights (transformers 5's own layout, so its
    fused checkpoints load by name): ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.
    Per-expert checkpoints (``experts.<e>.gate_proj``/``w1`` ...) load through
    ``load_expert``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act_and_mul: ActAndMul = silu_and_mul
        self.use_reference = False  # one token at a time (tests)
        # per-expert quantized layers (set_quantized); None: the stacked dense weights
        self.q_gate_up: nn.ModuleList | None = None
        self.q_down: nn.ModuleList | None = None

    def set_quantized(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        """Run expert ``e`` through ``gate_up[e]`` / ``down[e]`` (e.g. ``QuantLinear``s of its
        ``[2I, H]`` / ``[H, I]`` weights) and free the dense stacked weights."""
        assert len(gate_up) == len(down) == self.num_experts
        self.q_gate_up, self.q_down = nn.ModuleList(gate_up), nn.ModuleList(down)
        dtype = self.gate_up_proj.dtype
        self.gate_up_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    @torch.no_grad()
    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Copy one expert's ``gate`` ``[I, H]``, ``up`` ``[I, H]`` or ``down`` ``[H, I]``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the layer has {self.num_experts}")
        i = self.intermediate
        if part == "gate":
            dst = self.gate_up_proj[expert, :i]
        elif part == "up":
            dst = self.gate_up_proj[expert, i:]
        else:
            dst = self.down_proj[expert]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"expert {expert} {part} weight has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        run = reference_experts if self.use_reference else grouped_experts
        gate_up: ExpertWeights = self.gate_up_proj
        down: ExpertWeights = self.down_proj
        if self.q_gate_up is not None and self.q_down is not None:
            q_gate_up, q_down = self.q_gate_up, self.q_down
            gate_up = lambda e, rows: q_gate_up[e](rows)  # noqa: E731
            down = lambda e, rows: q_down[e](rows)  # noqa: E731
        return run(x, gate_up, down, weights, ids, self.act_and_mul)
