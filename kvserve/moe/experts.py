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

from kvserve.distributed.parallel_state import SINGLE, TPGroup, all_reduce, divide

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
    """One layer's ``E`` experts as two stacked weights (transformers 5's own layout):
    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; checkpoints load through
    ``load_expert`` (one expert's matrix) or ``load_stacked`` (all experts' at once).

    Under tensor parallelism (``tp``) every rank holds a slice of every expert, as the dense
    MLP is split: rows ``[r * I/N, (r + 1) * I/N)`` of its gate and of its up projection and
    the same columns of its down projection; the router runs on every rank (replicated), each
    rank's experts give partial sums, and ``forward`` all-reduces them once per layer."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.intermediate = divide(intermediate, tp, "the experts' intermediate size")
        local = self.intermediate  # this rank's features of each expert
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local))
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
        """Copy this rank's slice of one expert's full ``gate`` ``[I, H]``, ``up`` ``[I, H]``
        or ``down`` ``[H, I]``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the layer has {self.num_experts}")
        i, r = self.intermediate, self.tp.rank
        full_i = i * self.tp.world_size
        if part == "down":  # [H, I]: this rank's columns
            dst, want, dim = self.down_proj[expert], (self.down_proj.shape[1], full_i), 1
        else:  # [I, H]: this rank's rows, into the gate or the up half
            lo = 0 if part == "gate" else i
            dst, dim = self.gate_up_proj[expert, lo : lo + i], 0
            want = (full_i, self.gate_up_proj.shape[2])
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"expert {expert} {part} weight has shape {tuple(tensor.shape)}, expected {want}"
            )
        dst.copy_(tensor.narrow(dim, r * i, i))

    @torch.no_grad()
    def load_stacked(self, name: str, tensor: torch.Tensor) -> None:
        """Copy all experts' ``gate_up_proj [E, 2I, H]`` or ``down_proj [E, H, I]`` (full)."""
        if tensor.dim() != 3 or tensor.shape[0] != self.num_experts:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected "
                             f"[{self.num_experts}, ...]")  # fmt: skip
        full_i = self.intermediate * self.tp.world_size
        for e in range(self.num_experts):
            if name == "down_proj":
                self.load_expert(e, "down", tensor[e])
            else:
                if tensor.shape[1] != 2 * full_i:
                    raise ValueError(f"{name} has {tensor.shape[1]} rows per expert, expected "
                                     f"{2 * full_i}")  # fmt: skip
                self.load_expert(e, "gate", tensor[e, :full_i])
                self.load_expert(e, "up", tensor[e, full_i:])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        run = reference_experts if self.use_reference else grouped_experts
        gate_up: ExpertWeights = self.gate_up_proj
        down: ExpertWeights = self.down_proj
        if self.q_gate_up is not None and self.q_down is not None:
            q_gate_up, q_down = self.q_gate_up, self.q_down
            gate_up = lambda e, rows: q_gate_up[e](rows)  # noqa: E731
            down = lambda e, rows: q_down[e](rows)  # noqa: E731
        return all_reduce(run(x, gate_up, down, weights, ids, self.act_and_mul), self.tp)
