"""Swap a loaded model's linear layers for ``QuantLinear``s (``--quantization``).

Every ``nn.Linear`` but the LM head is quantized: the fused QKV, o, gate/up and down
projections of each layer. The LM head and the embeddings stay in the model dtype: the LM
head is one matrix read once per step, often tied to the embeddings, and its rounding moves
every logit. Round-to-nearest error is recorded per layer (``QuantReport``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.config import DEFAULT_INT4_GROUP_SIZE, Quantization, QuantizedActivations
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import QuantizedWeight, quantize_rtn, relative_error

logger = logging.getLogger(__name__)

KEEP_UNQUANTIZED = ("lm_head",)


@dataclass(frozen=True)
class QuantOptions:
    """What to quantize with: ``ModelConfig``'s quantization fields, as the loader needs them."""

    method: Quantization | None
    group_size: int | None = None
    gguf_file: str | None = None
    # pre-quantized layers by module name (a compressed-tensors checkpoint), else None
    loaded: dict[str, QuantizedWeight] | None = None
    activations: QuantizedActivations = QuantizedActivations.AUTO  # int8 or the model dtype


@dataclass
class QuantReport:
    """What quantization did to a model: layers, bytes and round-to-nearest error."""

    method: str
    layers: int = 0
    weight_bytes: int = 0  # the quantized layers' codes and scales
    dense_bytes: int = 0  # the same layers in the model dtype
    errors: dict[str, float] = field(default_factory=dict)  # layer -> ||W - Q(W)|| / ||W||
    kernel: bool = True  # every layer runs the C++ kernel
    int8_activations: bool = False  # the layers quantize their inputs to int8 (blocks of 32)

    def summary(self) -> str:
        errs = list(self.errors.values())
        err = f", RTN error mean {sum(errs) / len(errs):.4f} max {max(errs):.4f}" if errs else ""
        return (
            f"{self.method}: {self.layers} layers, {self.weight_bytes / 2**20:.1f} MiB "
            f"(from {self.dense_bytes / 2**20:.1f} MiB){err}; kernel: {self.kernel}; "
            f"activations: {'int8' if self.int8_activations else 'model dtype'}"
        )


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(parent, attribute, dotted name)`` of every nn.Linear to quantize."""
    found = []
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            if isinstance(child, nn.Linear) and attr not in KEEP_UNQUANTIZED:
                found.append((module, attr, f"{name}.{attr}" if name else attr))
    return found


def quantize_model(
    model: nn.Module, quant: QuantOptions, device: torch.device, dtype: torch.dtype
) -> QuantReport:
    """Replace the model's linear layers in place; returns the report (also logged)."""
    method = quant.method
    assert method is not None
    tp = getattr(model, "tp", None)  # a tensor-parallel shard's TPGroup (kvserve.distributed)
    if tp is not None and tp.world_size > 1:
        raise ValueError(f"quantization {method.value!r} does not support tensor parallelism "
                         f"yet (tensor_parallel_size {tp.world_size})")  # fmt: skip
    report = QuantReport(method.value)
    loaded = quant.loaded
    if method is Quantization.GGUF:
        from kvserve.quantization.gguf_weights import load_gguf_linears

        assert quant.gguf_file is not None  # ModelConfig checks it
        loaded = load_gguf_linears(quant.gguf_file, model.config)  # type: ignore[arg-type]
    targets = _linears(model)
    if loaded is not None:
        unknown = sorted(set(loaded) - {name for _, _, name in targets})
        if unknown:
            raise ValueError(f"quantized weights for layers the model does not have: {unknown[:3]}")
    for parent, attr, name in targets:
        linear: nn.Linear = getattr(parent, attr)
        if loaded is not None:
            if name not in loaded:
                continue  # stored as floats in the file: stays an ordinary layer
            qw = loaded[name]
            if qw.shape != tuple(linear.weight.shape):
                raise ValueError(f"quantized weight {name} has shape {qw.shape}, the model "
                                 f"expects {tuple(linear.weight.shape)}")  # fmt: skip
        else:
            qw = _rtn(linear.weight, method, quant.group_size, name)
            report.errors[name] = relative_error(linear.weight, qw)
        try:
            layer = QuantLinear(qw, linear.bias, device, dtype, quant.activations)
        except ValueError as e:
            raise ValueError(f"cannot quantize {name}: {e}") from e
        report.layers += 1
        report.weight_bytes += qw.nbytes()
        report.dense_bytes += linear.weight.numel() * linear.weight.element_size()
        report.kernel &= layer.use_kernel
        report.int8_activations = layer.int8_activations
        setattr(parent, attr, layer)
    logger.info("quantized %s", report.summary())
    return report


def _rtn(
    w: torch.Tensor, method: Quantization, group_size: int | None, name: str
) -> QuantizedWeight:
    bits = 8 if method is Quantization.INT8 else 4
    g = group_size if group_size is not None or bits == 8 else DEFAULT_INT4_GROUP_SIZE
    try:
        return quantize_rtn(w, bits, g)
    except ValueError as e:
        raise ValueError(f"cannot quantize {name}: {e}") from e
