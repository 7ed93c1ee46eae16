"""A decode step's decoder layers in one C++ call (``csrc/decode_layers.cpp``).

On a CPU a small model's decode step is mostly Python: the built-in 135M model spent 3.3 ms of
a 5.1 ms step in its ops and the rest in module calls and tensor bookkeeping around them (30
layers, ~10 kernel calls each; torch.profiler, AMD EPYC Zen 5, 2 threads). vLLM removes the
same overhead on GPUs by replaying decode steps as CUDA graphs; here the layer loop itself moves
to C++: ``DecodeLoop`` hands each layer's weights to a ``torch.classes.kvserve.DecodeLayers``
once, and a decode-only step then runs every layer with one call. It calls the very kernels the
Python layers call, in the same order, so the numbers are the same bit for bit; the Python
layers stay the reference (``enforce_eager=True`` keeps them for every step).

What it covers (``build_decode_loop`` says why when it does not): kvserve's Llama-family layers
(Llama, SmolLM, Qwen2 with q/k/v bias, Qwen3 with q/k norms, Mistral and Qwen sliding windows),
and the mixture-of-experts ones (Qwen2-MoE with its gated shared expert, Qwen3-MoE, Mixtral,
OLMoE with its q/k norms over the whole projections and ``clip_qkv``, gpt-oss with its
attention sinks: the router, the top-k routing and the layer's C++ experts op,
``moe/experts_kernel.py``),
with the fused C++ ops on (bfloat16 or float32), every linear a prepacked oneDNN weight, 16-bit
weights computed in float32 (``WideLinear``), batch-invariant mode's fixed-order linear
(``BatchInvariantLinear``), a plain ``nn.Linear`` (float32 layers packing
does not win on; bf16 where oneDNN cannot pack bf16, as on AVX2-only CPUs) or a quantized
kernel layer, one rank. Steps with prefill or speculative rows, or with an attention backend
other than ``CPU_KERNEL``, take the Python layers (``DecodeLoop.runs``). Steps with LoRA
adapters stay on the loop once the ``LoRAManager`` has handed it the slot weights
(``attach_lora``): each adapted linear then adds its delta with the same ``kvserve::lora_add``
call the Python layers make (``csrc/lora_ops.cpp``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.distributed.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvserve.lora.punica import LoRAKernel
from kvserve.model.base import ForwardBatch
from kvserve.model.batch_invariant import BatchInvariantLinear
from kvserve.model.wide_linear import WideLinear
from kvserve.moe.router import RouterConfig, Scoring
from kvserve.ops import cpu_kernels
from kvserve.ops.packed_linear import PackedLinear
from kvserve.quantization.qlinear import QuantLinear
from kvserve.worker.step_interrupt import StepInterrupted

if TYPE_CHECKING:
    from kvserve.lora.layers import LayerLoRA

logger = logging.getLogger(__name__)

# csrc/decode_layers.cpp's linear kinds
KIND_A8, KIND_QUANT, KIND_PACKED, KIND_DENSE, KIND_WIDE, KIND_INVARIANT = 0, 1, 2, 3, 4, 5

# Linears whose forward is nn.Linear's own F.linear call at one rank (the loop runs one rank
# only): the tensor-parallel classes add communication for world_size > 1 alone.
_DENSE = (nn.Linear, ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
          RowParallelLinear)  # fmt: skip


class DecodeLoop:
    """The C++ decode loop of one model: its layers' weights, and how many steps it ran."""

    def __init__(self, layers: torch.ScriptObject) -> None:
        self.layers = layers  # torch.classes.kvserve.DecodeLayers
        self.steps = 0  # decode steps run through it (the tests read it)
        self.lora_steps = 0  # of which with LoRA adapters
        self.has_lora = False  # the LoRA slot weights were handed over (attach_lora)

    def attach_lora(self, layers: Sequence[LayerLoRA]) -> None:
        """Hand the loop every layer's LoRA slot weights (the manager's tensors, shared: a
        slot loaded later is seen at once); they must use the C++ kernel, as the loop does."""
        for i, ll in enumerate(layers):
            for which, w in enumerate(ll.all()):
                assert w.kernel is LoRAKernel.CPU, "the decode loop adds deltas with lora_add"
                self.layers.add_lora(i, which, w.a, list(w.bts))
        self.has_lora = True

    def runs(self, batch: ForwardBatch) -> bool:
        """Whether this step is decode only (one query per row) on the C++ attention kernel
        (the loop calls that kernel itself), with adapters only once they are attached: the
        steps the loop takes."""
        md = batch.attn_metadata
        dec = md.decode
        return (
            (batch.lora is None or self.has_lora)
            and dec is not None
            and isinstance(batch.attn_backend, CpuKernelBackend)
            and dec.token_idx is None  # every row of the step is a one-token decode row
            and not md.prefill_groups
            and not md.context_groups
            and not md.prefill_rows
        )

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: ``[T, hidden]`` embeddings; rope: cos/sin ``[T, 1, D]``. Returns the last
        layer's output and the residual stream, as the Python layer loop does."""
        md, kv_caches = batch.attn_metadata, batch.kv_caches
        dec = md.decode
        assert dec is not None
        cos, sin = rope[0].squeeze(1), rope[1].squeeze(1)  # [T, D]
        out_res = self.layers.run(
            x, cos, sin, md.slot_mapping, dec.block_tables, dec.seq_lens,
            [k for k, _ in kv_caches], [v for _, v in kv_caches],
            None if batch.lora is None else batch.lora.token_slots,
            None if batch.interrupt is None else batch.interrupt.flag,
        )  # fmt: skip
        if batch.interrupt is not None and not out_res:
            raise StepInterrupted  # the flag was set between two layers
        out, residual = out_res
        self.steps += 1
        self.lora_steps += batch.lora is not None
        return out, residual


def build_decode_loop(model: nn.Module) -> DecodeLoop | None:
    """The C++ decode loop for ``model``'s layers, or None (logged) where it does not apply."""
    reason = _unsupported(model)
    if reason is not None:
        logger.info("C++ decode loop off: %s", reason)
        return None
    attn0 = model.layers[0].self_attn
    layers = torch.classes.kvserve.DecodeLayers(attn0.num_heads, attn0.num_kv_heads, attn0.head_dim)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        moe = _moe_parts(mlp)
        for lin in (attn.qkv_proj, attn.o_proj):
            _add_linear(layers, lin)
        if moe is None:
            _add_linear(layers, mlp.gate_up_proj)
            _add_linear(layers, mlp.down_proj)
        else:
            router, cfg, op = moe
            shared = getattr(mlp, "shared_expert", None)
            layers.set_moe(op, cfg.top_k, cfg.scoring is Scoring.TOPK_SOFTMAX,
                           cfg.norm_topk_prob, cfg.float32_weights,
                           shared is not None)  # fmt: skip
            _add_router(layers, router)
            if shared is not None:  # Qwen2-MoE: a gated MLP and its [1, H] gate
                _add_linear(layers, shared.gate_up_proj)
                _add_linear(layers, shared.down_proj)
                _add_router(layers, mlp.shared_expert_gate)
        whole = not attn.per_head_qk_norm  # OLMoE: over the whole projections, set below
        q_norm = attn.q_norm.weight if attn.q_norm is not None and not whole else None
        k_norm = attn.k_norm.weight if attn.k_norm is not None and not whole else None
        layers.add_layer(
            layer.input_layernorm.weight, layer.input_layernorm.eps,
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
            q_norm, k_norm, attn.q_norm.eps if attn.q_norm is not None else 1e-6,
            int(attn.attn_kwargs.get("sliding_window", 0)),
            float(attn.attn_kwargs.get("soft_cap", 0.0)), float(attn.scale),
        )  # fmt: skip
        if whole:
            layers.set_whole_qk_norm(i, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
                                     attn.clip_qkv)  # fmt: skip
        if attn.sinks is not None:  # as cpu_kernels.paged_decode_attention hands them over
            layers.set_sinks(i, attn.sinks.detach().float().contiguous())
    return DecodeLoop(layers)


def _routing(mlp: nn.Module) -> tuple[nn.Module, RouterConfig] | None:
    """A mixture-of-experts block's router layer and routing rule (None: not a MoE block the
    loop knows): ``SparseMoeBlock`` names them ``gate`` / ``router``, ``GptOssMoeBlock``
    ``router`` / ``route_config``."""
    from kvserve.model.gpt_oss import GptOssMoeBlock  # llama imports us; they import llama
    from kvserve.model.moe import SparseMoeBlock

    if type(mlp) is SparseMoeBlock:
        return mlp.gate, mlp.router
    if type(mlp) is GptOssMoeBlock:
        return mlp.router, mlp.route_config
    return None


def _moe_parts(mlp: nn.Module) -> tuple[nn.Module, RouterConfig, torch.ScriptObject] | None:
    """A mixture-of-experts MLP's router layer, routing rule and C++ experts op (None: a
    dense MLP). ``_unsupported`` has checked that the op exists."""
    routing = _routing(mlp)
    if routing is None:
        return None
    op = mlp.experts.kernel()
    assert op is not None
    return *routing, op


def _add_router(layers: torch.ScriptObject, router: nn.Module) -> None:
    """A ``RouterLinear`` (kept in the model dtype, ``F.linear``'s own call): a dense linear."""
    empty = torch.empty(0)
    bias = None if router.bias is None else router.bias.detach()
    layers.add_linear(KIND_DENSE, router.weight.detach(), empty, empty, bias,
                      router.weight.shape[0], 0, 0, 0, 0, 0, False)  # fmt: skip


def _add_linear(layers: torch.ScriptObject, lin: nn.Module) -> None:
    """Append one linear layer's weights as its module holds them (see ``_linear_kind``)."""
    empty = torch.empty(0)
    if type(lin) in _DENSE:  # F.linear's own call, in C++: the same numbers
        layers.add_linear(KIND_DENSE, lin.weight.detach(), empty, empty,
                          None if lin.bias is None else lin.bias.detach(), lin.out_features,
                          0, 0, 0, 0, 0, False)  # fmt: skip
        return
    if type(lin) is WideLinear:
        layers.add_linear(KIND_WIDE, lin.packed_weight, empty, empty, lin.bias,
                          lin.out_features, 0, 0, 0, lin.direct_rows, 0, False)  # fmt: skip
        return
    if type(lin) is BatchInvariantLinear:  # invariant_linear's very calls
        bias = None if lin.bias is None else lin.bias.detach().float()
        layers.add_linear(KIND_INVARIANT, lin.weight.detach().contiguous(), empty, empty, bias,
                          lin.out_features, 0, 0, 0, 0, 0, False)  # fmt: skip
        return
    if isinstance(lin, PackedLinear):
        layers.add_linear(KIND_PACKED, lin.packed_weight, empty, empty, lin.bias,
                          lin.out_features, 0, 0, 0, 0, 0, False)  # fmt: skip
        return
    assert isinstance(lin, QuantLinear)
    if lin.path == "a8":
        layers.add_linear(KIND_A8, lin.codes, empty, empty, lin.bias, lin.out_features,
                          lin.code_bits, lin.group_size, lin.offset, 0, lin.scale_format,
                          lin.has_zeros)  # fmt: skip
    else:
        layers.add_linear(KIND_QUANT, lin.codes, lin.scales_t, lin.zeros_t, lin.bias,
                          lin.out_features, lin.code_bits, lin.group_size, lin.offset,
                          lin.direct_rows, 0, False)  # fmt: skip


def _linear_ok(lin: nn.Module) -> bool:
    """Exactly the classes whose forward the C++ loop reproduces (no tensor-parallel
    subclasses, no reference path, no input permutation: GPTQ act-order)."""
    if type(lin) in (PackedLinear, WideLinear, BatchInvariantLinear) or type(lin) in _DENSE:
        return True
    return type(lin) is QuantLinear and lin.use_kernel and lin.in_perm is None


def _unsupported(model: nn.Module) -> str | None:
    """Why the C++ loop cannot run ``model``'s layers (None: it can)."""
    from kvserve.model.llama import MLP, Attention, DecoderLayer, RMSNorm  # llama imports us
    from kvserve.model.moe import OlmoeAttention

    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":  # before the kernels: no build off a CPU
        return "the model is not on a CPU"
    if not cpu_kernels.available():
        return "the C++ kernels are not built"
    layers = getattr(model, "layers", None)
    if not layers or getattr(getattr(model, "tp", None), "world_size", 1) != 1:
        return "not a one-rank kvserve decoder"
    for i, layer in enumerate(layers):
        if type(layer) is not DecoderLayer:
            return f"layer {i} is a {type(layer).__name__}, not a Llama-family layer"
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        if type(attn) not in (Attention, OlmoeAttention) or any(
            type(n) is not RMSNorm for n in norms
        ):
            return f"layer {i} has attention or norms of its own"
        if not attn.per_head_qk_norm and (attn.q_norm is None or attn.k_norm is None):
            return f"layer {i} has one of OLMoE's whole-projection q/k norms only"
        if not (attn.fused and all(n.fused for n in norms)):
            return "the fused C++ ops are off"
        refusal = _gated_mlp_refusal(mlp) if type(mlp) is MLP else _moe_refusal(mlp)
        if refusal is not None:
            return f"layer {i}'s {refusal}"
        linears = (attn.qkv_proj, attn.o_proj)
        bad = [type(lin).__name__ for lin in linears if not _linear_ok(lin)]
        if bad:
            return (f"layer {i} has {bad[0]} linears (not plain, prepacked nor a quantized "
                    "kernel without an input permutation)")  # fmt: skip
    return None


def _gated_mlp_refusal(mlp: nn.Module) -> str | None:
    """Why the loop cannot run this gated MLP, a dense layer's or Qwen2-MoE's shared expert
    (None: it can)."""
    if not mlp.fused:
        return "MLP runs without the fused C++ ops"
    if mlp.act_and_mul is not cpu_kernels.silu_and_mul:
        return "MLP is not SiLU-gated"
    bad = [type(lin).__name__ for lin in (mlp.gate_up_proj, mlp.down_proj) if not _linear_ok(lin)]
    if bad:
        return f"MLP has {bad[0]} linears (not plain, prepacked nor a quantized kernel)"
    return None


def _moe_refusal(mlp: nn.Module) -> str | None:
    """Why the loop cannot run this non-Llama MLP (None: a MoE block it runs whole)."""
    from kvserve.model.llama import MLP
    from kvserve.model.moe import RouterLinear

    routing = _routing(mlp)
    if routing is None:
        return f"MLP is a {type(mlp).__name__}"
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:  # Qwen2-MoE: a gated MLP as the dense layers', and its gate
        refusal = _gated_mlp_refusal(shared) if type(shared) is MLP else "is not an MLP"
        if refusal is not None:
            return f"shared expert's {refusal}"
        if type(mlp.shared_expert_gate) is not RouterLinear:
            return "shared expert's gate is not a plain RouterLinear"
    router, experts = routing[0], mlp.experts
    if type(router) is not RouterLinear or experts.tp.world_size != 1:
        return "router or experts are not one rank's plain modules"
    if not experts.use_kernel or experts.use_reference or experts.kernel() is None:
        return "experts do not run as the C++ experts op"
    return None
