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

Experts may carry biases (gpt-oss: ``gate_up_bias [E, 2I]`` added after the gate/up matmul,
``down_bias [E, H]`` after the down matmul, before the routing weight), and the activation
between the two matmuls is a policy (``GluActivation``): SiLU(gate) * up, or gpt-oss's
clamped SwiGLU.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.distributed.parallel_state import SINGLE, TPGroup, all_reduce, divide

logger = logging.getLogger(__name__)

# act(gate) * up for gate_up = [N, 2 * I] -> [N, I] (llama.ACTIVATIONS' PyTorch or C++ op)
ActAndMul = Callable[[torch.Tensor], torch.Tensor]
# (expert, rows [n, K]) -> [n, N]: one expert's projection, e.g. its quantized layer
ExpertLinear = Callable[[int, torch.Tensor], torch.Tensor]
# stacked dense weights [E, N, K], or a function per expert
ExpertWeights = torch.Tensor | ExpertLinear


_logged: set[str] = set()


def log_kernel_fallback(reason: str) -> None:
    """Say once per process and reason why MoE experts keep the PyTorch grouped path."""
    message = f"MoE experts on the PyTorch grouped path: the C++ op cannot run {reason}"
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _linear(w: ExpertWeights) -> ExpertLinear:
    if isinstance(w, torch.Tensor):
        return lambda e, rows: F.linear(rows, w[e])
    return w


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation (transformers' ``GptOssExperts._apply_gate``), on ``gate_up
    [N, 2I]`` with the gate half first (kvserve de-interleaves the checkpoint's alternating
    gate/up columns at load): ``gate`` clamped above at ``limit``, ``up`` to
    ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)`` -> ``[N, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GluKind(enum.Enum):
    SILU = "silu"  # silu(gate) * up (Qwen, Mixtral, OLMoE)
    GELU_TANH = "gelu_tanh"  # gelu(gate, approximate="tanh") * up (hidden_act gelu_pytorch_tanh)
    CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss: clamped, sigmoid(alpha * gate), (up + 1)


@dataclass(frozen=True)
class GluActivation:
    """The experts' act(gate, up) policy; ``alpha``/``limit`` only for ``CLAMPED_SWIGLU``
    (gpt-oss's ``swiglu_alpha`` 1.702 and ``swiglu_limit`` 7.0)."""

    kind: GluKind = GluKind.SILU
    alpha: float = 1.702
    limit: float = 7.0


def act_and_mul_for(act: GluActivation) -> ActAndMul:
    """The PyTorch function computing ``act``: ``gate_up [N, 2I]`` -> ``[N, I]``."""
    if act.kind is GluKind.SILU:
        return silu_and_mul
    if act.kind is GluKind.GELU_TANH:
        return gelu_tanh_and_mul
    return lambda gate_up: clamped_swiglu_and_mul(gate_up, act.alpha, act.limit)


def _biased(fn: ExpertLinear, bias: torch.Tensor | None) -> ExpertLinear:
    """``fn(e, rows) + bias[e]`` (None: ``fn``): the matmul, then the bias, as transformers'
    ``x @ W + b`` rounds."""
    if bias is None:
        return fn
    return lambda e, rows: fn(e, rows) + bias[e]


def grouped_experts(
    x: torch.Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_and_mul: ActAndMul = silu_and_mul,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, H]``; ``gate_up [E, 2I, H]`` (gate rows, then up rows); ``down [E, H, I]``;
    ``weights [T, k]`` and ``ids [T, k]`` from ``router.route`` -> ``[T, H]``, the weighted
    sum of each token's k experts' outputs. ``gate_up``/``down`` may be functions of
    ``(expert, rows)`` instead (quantized experts: ``FusedExperts.set_quantized``).
    ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]``: added to each expert's projections."""
    k = ids.shape[1]
    gate_up_fn = _biased(_linear(gate_up), gate_up_bias)
    down_fn = _biased(_linear(down), down_bias)
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
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``grouped_experts``' result computed one token and one routed expert at a time."""
    out = torch.zeros_like(x)  # [T, H]
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):  # expert order
            e = int(ids[t, j])
            if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
                g = gate_up[e] @ x[t]  # [2I] matrix-vector
                if gate_up_bias is not None:
                    g = g + gate_up_bias[e]
                h = act_and_mul(g.unsqueeze(0))[0]  # [I]
                y = down[e] @ h  # [H]
                if down_bias is not None:
                    y = y + down_bias[e]
            else:  # the expert's own layers, one row
                h = act_and_mul(_biased(_linear(gate_up), gate_up_bias)(e, x[t : t + 1]))
                y = _biased(_linear(down), down_bias)(e, h)[0]  # [H]
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
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        tp: TPGroup = SINGLE,
        bias: bool = False,
    ) -> None:
        """``bias``: each expert's projections carry biases (gpt-oss): ``gate_up_bias
        [E, 2I/N]`` (this rank's slice, as the rows) and ``down_bias [E, H]`` (whole on every
        rank, added by rank 0 only: the all-reduce sums the ranks' partial outputs)."""
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.intermediate = divide(intermediate, tp, "the experts' intermediate size")
        local = self.intermediate  # this rank's features of each expert
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local))
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * local))
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.act_and_mul: ActAndMul = silu_and_mul
        # what act_and_mul computes, for the C++ op (None: a function it does not know)
        self.glu: GluActivation | None = GluActivation()
        self.use_reference = False  # one token at a time (tests)
        # the C++ op (experts_kernel.py) instead of grouped_experts: enable_fused_ops sets it
        self.use_kernel = False
        # the Triton op (ops/triton/moe.py) on dense stacks: enable_fused_ops sets it on CUDA
        self.use_triton = False
        self._kernel: torch.ScriptObject | None = None  # built at the first forward
        # per-expert quantized layers (set_quantized); None: the stacked dense weights
        self.q_gate_up: nn.ModuleList | None = None
        self.q_down: nn.ModuleList | None = None
        # bf16 stacks packed for the C++ op (_pack_dense), then the experts' only copy:
        # [E, ceil(2I / 16), H, 16] and [E, ceil(H / 16), I, 16]; None: not packed
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None

    def set_quantized(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        """Run expert ``e`` through ``gate_up[e]`` / ``down[e]`` (e.g. ``QuantLinear``s of its
        ``[2I, H]`` / ``[H, I]`` weights) and free the dense stacked weights."""
        assert len(gate_up) == len(down) == self.num_experts
        self.q_gate_up, self.q_down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self._kernel = None  # the op holds the old weights
        # emptied in place, not replaced: the loader's parameter dict (``load_weights``) holds
        # these objects until every layer is in, and replaced ones kept every layer's dense
        # experts resident to the end (the OLMoE-1B-7B shape's int4 load: 14.5 GB and rising)
        for p in (self.gate_up_proj, self.down_proj):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.requires_grad_(False)

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
        if tensor.is_meta:  # not read: its quantized layer comes from elsewhere (a GGUF's
            return  # blocks), and the stacked weight's pages stay untouched
        dst.copy_(tensor.narrow(dim, r * i, i))

    @torch.no_grad()
    def load_bias(self, part: str, tensor: torch.Tensor) -> None:
        """Copy all experts' full ``gate`` or ``up`` bias ``[E, I]`` (this rank's slice) or
        ``down`` bias ``[E, H]`` (whole)."""
        if self.gate_up_bias is None or self.down_bias is None:
            raise ValueError("these experts have no biases (the checkpoint has some)")
        i, r = self.intermediate, self.tp.rank
        want = (
            self.num_experts,
            self.down_bias.shape[1] if part == "down" else i * self.tp.world_size,
        )
        if tuple(tensor.shape) != want:
            raise ValueError(f"{part} bias has shape {tuple(tensor.shape)}, expected {want}")
        if part == "down":
            self.down_bias.copy_(tensor)
        else:
            lo = 0 if part == "gate" else i
            self.gate_up_bias[:, lo : lo + i].copy_(tensor.narrow(1, r * i, i))

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

    def kernel(self) -> torch.ScriptObject | None:
        """The C++ op over this layer's experts (built once), or None with the reason logged
        once per process: ``grouped_experts`` then runs them."""
        from kvserve.moe.experts_kernel import ExpertsKernelRefused, experts_kernel

        if self._kernel is None and self.use_kernel:
            gate_up: Any = self.q_gate_up if self.q_gate_up is not None else self.gate_up_proj
            down: Any = self.q_down if self.q_down is not None else self.down_proj
            try:
                if self.glu is None:
                    raise ExpertsKernelRefused("an activation it does not implement")
                if self.q_gate_up is None and self.gate_up_proj.dtype == torch.bfloat16:
                    gate_up, down = self._pack_dense()
                down_bias = self.down_bias if self.tp.rank == 0 else None
                self._kernel = experts_kernel(gate_up, down, self.glu, self.gate_up_bias,
                                              down_bias)  # fmt: skip
            except ExpertsKernelRefused as e:
                self.use_kernel = False
                log_kernel_fallback(str(e))
        return self._kernel

    @torch.no_grad()
    def _pack_dense(self) -> tuple[list[Any], list[Any]]:
        """Pack the bf16 stacks for ``wide_linear_packed`` and free them (the packed ones are
        then the only copy). Measured on OLMoE-1B-7B's expert shapes, one thread, experts
        read from memory (AVX512-BF16 EPYC): 2.05x / 2.20x faster than the ``[N, K]`` path
        at one row (gate_up / down), 1.8x at two, 1.0-1.3x at 4-8 (docs/moe.md)."""
        from kvserve.model.wide_linear import pack_wide_weight
        from kvserve.moe.experts_kernel import PackedExpert

        if self.gate_up_packed is None or self.down_packed is None:
            packed = []
            for p in (self.gate_up_proj, self.down_proj):
                e, n, k = p.shape
                out = torch.empty(e, -(-n // 16), k, 16, dtype=p.dtype, device=p.device)
                for i in range(e):  # one expert at a time: no second whole stack at once
                    out[i].copy_(pack_wide_weight(p[i]))
                packed.append(out)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # in place (above)
            self.gate_up_packed, self.down_packed = packed
        n_gu, n_down = self._packed_rows()
        return ([PackedExpert(w, n_gu) for w in self.gate_up_packed],
                [PackedExpert(w, n_down) for w in self.down_packed])  # fmt: skip

    def _packed_rows(self) -> tuple[int, int]:
        """The packed experts' N: gate_up's 2I (this rank's), down's H (gate_up's K)."""
        assert self.gate_up_packed is not None
        return 2 * self.intermediate, self.gate_up_packed.shape[2]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        op = self.kernel() if self.use_kernel and not self.use_reference else None
        if op is not None and x.dtype in (torch.float32, torch.bfloat16):
            return all_reduce(op.run(x, weights, ids), self.tp)
        down_bias = self.down_bias if self.tp.rank == 0 else None  # added once over the ranks
        if self.use_triton and not self.use_reference and self._dense():
            from kvserve.ops.triton.moe import fused_experts

            out = fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids,
                                self.act_and_mul, self.gate_up_bias, down_bias)  # fmt: skip
            return all_reduce(out, self.tp)
        run = reference_experts if self.use_reference else grouped_experts
        gate_up: ExpertWeights = self.gate_up_proj
        down: ExpertWeights = self.down_proj
        if self.gate_up_packed is not None and self.down_packed is not None:
            n_gu, n_down = self._packed_rows()
            gate_up = self._unpacked(self.gate_up_packed, n_gu)
            down = self._unpacked(self.down_packed, n_down)
        if self.q_gate_up is not None and self.q_down is not None:
            q_gate_up, q_down = self.q_gate_up, self.q_down
            gate_up = lambda e, rows: q_gate_up[e](rows)  # noqa: E731
            down = lambda e, rows: q_down[e](rows)  # noqa: E731
        out = run(x, gate_up, down, weights, ids, self.act_and_mul, self.gate_up_bias, down_bias)
        return all_reduce(out, self.tp)

    def _dense(self) -> bool:
        """The experts are the dense stacked weights (neither quantized nor packed)."""
        return self.q_gate_up is None and self.gate_up_packed is None

    @staticmethod
    def _unpacked(packed: torch.Tensor, n: int) -> ExpertLinear:
        """The PyTorch paths over packed experts (the reference switch, fp16 inputs): each
        expert's ``[N, K]`` weight unpacked per call, the same numbers as the stack had."""
        from kvserve.model.wide_linear import unpack_wide_weight

        return lambda e, rows: F.linear(rows, unpack_wide_weight(packed[e], n))
