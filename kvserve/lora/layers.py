"""The stacked adapter weights of one fused linear layer, and attaching them to a model.

Each adapted linear of a native decoder (fused QKV, o_proj, fused gate/up, down_proj) gets a
``LoRASlotWeights``: ``max_loras`` device slots of zero-padded A and B. The layer adds the
delta to the base linear's output (dense or quantized alike: the delta never touches the
base weight). The ``LoRAManager`` owns these tensors and is the only writer
(``load_slot``/``clear_slot``); the layers only read them through ``add_delta``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.distributed.layers import row_parallel_with
from kvserve.lora.peft_loader import LoRAModel
from kvserve.lora.punica import LoRAKernel, LoRAMapping, lora_add, select_kernel


class LoRASlotWeights:
    """A: ``[S, n*R, K]`` (the slices' A stacked along the rank) and, per slice, B transposed:
    ``Bt [S, R, N_i]``; slice ``i`` is the i-th module of ``modules`` (q, k, v for a fused
    QKV). ``kernel``: what adds the delta (``punica.select_kernel`` for the device)."""

    def __init__(
        self,
        modules: tuple[str, ...],
        in_features: int,
        out_features: tuple[int, ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.modules = modules
        self.rank = max_rank
        n = len(modules)
        self.a = torch.zeros(num_slots, n * max_rank, in_features, dtype=dtype, device=device)
        self.bts = tuple(
            torch.zeros(num_slots, max_rank, o, dtype=dtype, device=device) for o in out_features
        )
        self.kernel: LoRAKernel = select_kernel(device)

    def load_slot(self, slot: int, layer: int, lora: LoRAModel) -> None:
        """Copy an adapter's weights of this layer into ``slot`` (modules it lacks: zeros)."""
        self.clear_slot(slot)
        r = self.rank
        for i, module in enumerate(self.modules):
            pair = lora.weights.get((layer, module))
            if pair is None:
                continue
            a, b = pair  # [r_a, K], [N_i, r_a]
            self.a[slot, i * r : i * r + a.shape[0]].copy_(a)
            self.bts[i][slot, : b.shape[1]].copy_(b.t())

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        for bt in self.bts:
            bt[slot].zero_()

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """``out`` [T, sum N_i] (the base output, a fresh tensor) plus each row's delta."""
        lora_add(self.kernel, x, self.a, self.bts, mapping, out)
        return out

    def add_row_parallel(
        self, layer: nn.Module, x: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        """``layer(x)`` plus each row's delta, for a row-parallel ``layer`` (o_proj,
        down_proj): under tensor parallelism ``x`` [T, K/world] and this slot's A are the
        rank's input slice, and the partial delta joins the partial sum before the layer's
        all-reduce (``row_parallel_with``); at one rank, ``add_delta(layer(x))``."""
        return row_parallel_with(layer, x, lambda y: self.add_delta(y, x, mapping))

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(bt.nbytes for bt in self.bts)


@dataclass(frozen=True)
class LayerLoRA:
    """One decoder layer's adapted linears (each None when no adapter could reach it)."""

    qkv: LoRASlotWeights
    o: LoRASlotWeights
    gate_up: LoRASlotWeights
    down: LoRASlotWeights

    def all(self) -> tuple[LoRASlotWeights, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


def attach_lora(
    model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> list[LayerLoRA]:
    """Give every layer of a native Llama-family model its slot weights (``Attention.lora_qkv``
    and ``lora_o``, ``MLP.lora_gate_up`` and ``lora_down``), and its C++ decode loop too
    where it has one (``DecodeLoop.attach_lora``); returns them per layer. Sizes are this
    rank's: under tensor parallelism its heads and intermediate features, and the input
    slice of o_proj and down_proj (``lora/sharding.py`` cuts the adapters to match; the C++
    decode loop runs one-rank models only, so TP ranks add deltas in the Python layers)."""
    if not getattr(model, "supports_lora", False):
        raise ValueError(
            f"LoRA adapters need a native Llama-family model (Llama, Qwen2, Mistral, Qwen3); "
            f"{type(model).__name__} does not run them"
        )
    layers = []
    for layer in model.layers:  # type: ignore[attr-defined]
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.q_size, attn.kv_size
        hidden = model.config.hidden_size  # type: ignore[attr-defined]
        inter = mlp.intermediate

        def make(mods: tuple[str, ...], k: int, outs: tuple[int, ...]) -> LoRASlotWeights:
            return LoRASlotWeights(mods, k, outs, num_slots, max_rank, dtype, device)

        ll = LayerLoRA(
            qkv=make(("q_proj", "k_proj", "v_proj"), hidden, (q, kv, kv)),
            o=make(("o_proj",), q, (hidden,)),
            gate_up=make(("gate_proj", "up_proj"), hidden, (inter, inter)),
            down=make(("down_proj",), inter, (hidden,)),
        )
        attn.lora_qkv, attn.lora_o = ll.qkv, ll.o
        mlp.lora_gate_up, mlp.lora_down = ll.gate_up, ll.down
        layers.append(ll)
    loop = getattr(model, "decode_loop", None)  # the C++ decode loop, when the model has one
    if loop is not None and layers and layers[0].qkv.kernel is LoRAKernel.CPU:
        loop.attach_lora(layers)  # steps with adapters stay on it
    return layers
