"""Swap a loaded model's linear layers for ``QuantLinear``s (``--quantization``).

Every ``nn.Linear`` but the LM head is quantized: the fused QKV, o, gate/up and down
projections of each layer. The embeddings stay in the model dtype, and by default the LM head
too: it is one matrix, often tied to the embeddings, and its rounding moves every logit.
``--quantization-lm-head`` quantizes it as well (``lm_head.py``). Round-to-nearest error is
recorded per layer (``QuantReport``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.config import (
    DEFAULT_INT4_GROUP_SIZE,
    ModelConfig,
    Quantization,
    QuantizedActivations,
)
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import (
    QuantizedWeight,
    check_group_size,
    concat_rows,
    quantize_rtn,
)

logger = logging.getLogger(__name__)

KEEP_UNQUANTIZED = ("lm_head",)


# Round-to-nearest from dense weights at load: the methods quantize_model runs, and the ones
# that shard (each rank rounds its own slice). GGUF and pre-quantized checkpoints bring codes
# for the whole matrix.
RTN_METHODS = (Quantization.INT8, Quantization.INT4)


@dataclass(frozen=True)
class QuantOptions:
    """What to quantize with: ``ModelConfig``'s quantization fields, as the loader needs them."""

    method: Quantization | None
    group_size: int | None = None
    gguf_file: str | None = None
    activations: QuantizedActivations = QuantizedActivations.AUTO  # int8 or the model dtype
    lm_head: bool | None = False  # quantize the LM head too (lm_head.py); None: auto

    @classmethod
    def of(cls, mc: ModelConfig) -> QuantOptions:
        """The options ``mc`` asks for."""
        return cls(mc.quantization, mc.quantization_group_size, mc.gguf_file,
                   activations=mc.quantization_activations,
                   lm_head=mc.quantization_lm_head)  # fmt: skip


@dataclass
class QuantReport:
    """What quantization did to a model: layers, bytes and round-to-nearest error."""

    method: str
    layers: int = 0
    weight_bytes: int = 0  # the quantized layers' codes and scales
    dense_bytes: int = 0  # the same layers in the model dtype
    errors: dict[str, float] = field(default_factory=dict)  # layer -> ||W - Q(W)|| / ||W||
    kernel: bool = True  # every layer runs the C++ kernel
    # the layers that quantize their input to int8 (blocks of 32); auto on AVX2 leaves byte
    # codes in the model dtype (a Q4_K_M file's Q6_K layers)
    int8_layers: int = 0
    # the LM head's quantization ("int8", a GGUF type such as "Q6_K"); None: model dtype
    lm_head: str | None = None

    @property
    def int8_activations(self) -> bool:
        """Every layer quantizes its input to int8; false if any keeps the dtype."""
        return self.layers > 0 and self.int8_layers == self.layers

    def activations(self) -> str:
        """What the layers multiply their weights with, for the load log."""
        if self.int8_activations:
            return "int8"
        if self.int8_layers:
            return f"int8 in {self.int8_layers} of {self.layers} layers, model dtype in the rest"
        return "model dtype"

    def summary(self) -> str:
        errs = list(self.errors.values())
        err = f", RTN error mean {sum(errs) / len(errs):.4f} max {max(errs):.4f}" if errs else ""
        return (
            f"{self.method}: {self.layers} layers, {self.weight_bytes / 2**20:.1f} MiB "
            f"(from {self.dense_bytes / 2**20:.1f} MiB){err}; kernel: {self.kernel}; "
            f"activations: {self.activations()}; "
            f"LM head: {self.lm_head or 'model dtype'}"
        )


def linears(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
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
    """Replace a loaded model's linear layers in place; returns the report (also logged).
    The transformers backend's path, and the whole-model reference of the streamed load
    (tests): the loader quantizes native models while their weights load instead
    (``streaming.StreamingQuantizer``)."""
    method = quant.method
    assert method is not None
    check_unsharded(model, method)
    report = QuantReport(method.value)
    loaded: dict[str, QuantizedWeight] | None = None  # pre-quantized layers by module name
    if method is Quantization.GGUF:
        from kvserve.quantization.gguf_weights import load_gguf_linears

        assert quant.gguf_file is not None  # ModelConfig checks it
        loaded = load_gguf_linears(quant.gguf_file, model.config)  # type: ignore[arg-type]
    targets = linears(model)
    if loaded is not None:
        check_known(loaded, targets)
    for parent, attr, name in targets:
        linear: nn.Linear = getattr(parent, attr)
        if loaded is not None and name not in loaded:
            continue  # stored as floats in the file: stays an ordinary layer
        qw, err = layer_weight(quant, name, linear.weight, loaded[name] if loaded else None)
        setattr(parent, attr, quantized_layer(report, name, linear.weight, linear.bias, qw, err,
                                              device, dtype, quant.activations))  # fmt: skip
    logger.info("quantized %s", report.summary())
    return report


def check_unsharded(model: nn.Module, method: Quantization) -> None:
    """Refuse ``method`` on a tensor-parallel shard unless it is one of RTN_METHODS."""
    tp = getattr(model, "tp", None)  # a tensor-parallel shard's TPGroup (kvserve.distributed)
    if tp is not None and tp.world_size > 1 and method not in RTN_METHODS:
        raise ValueError(f"quantization {method.value!r} does not support tensor parallelism "
                         f"yet (tensor_parallel_size {tp.world_size})")  # fmt: skip


def check_known(loaded: Iterable[str], targets: list[tuple[nn.Module, str, str]]) -> None:
    """Refuse quantized weights for layers the model does not have."""
    unknown = sorted(set(loaded) - {name for _, _, name in targets})
    if unknown:
        raise ValueError(f"quantized weights for layers the model does not have: {unknown[:3]}")


def layer_weight(
    quant: QuantOptions, name: str, weight: torch.Tensor, qw: QuantizedWeight | None
) -> tuple[QuantizedWeight, float | None]:
    """Layer ``name``'s quantized weight and its round-to-nearest error: ``qw`` when
    pre-quantized (``weight`` then only gives the shape it must have: it may be on the meta
    device; no error), else ``weight`` rounded to nearest."""
    assert quant.method is not None
    if qw is None:
        return rtn_weight(weight, quant.method, quant.group_size, name)
    if qw.shape != tuple(weight.shape):
        raise ValueError(f"quantized weight {name} has shape {qw.shape}, the model "
                         f"expects {tuple(weight.shape)}")  # fmt: skip
    return qw, None


def quantized_layer(
    report: QuantReport,
    name: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    qw: QuantizedWeight,
    error: float | None,
    device: torch.device,
    dtype: torch.dtype,
    activations: QuantizedActivations,
) -> QuantLinear:
    """The ``QuantLinear`` of ``qw`` for layer ``name``, counted in ``report`` (``weight``:
    the dense layer's, for its shape and size only)."""
    layer = new_quant_layer(name, qw, bias, device, dtype, activations)
    count_layer(report, weight, layer, error, name)
    return layer


def load_workers() -> int:
    """Threads that build quantized layers side by side at load (MoE experts): one per
    intra-op thread, at most 4 (each holds a few bytes a weight of one expert's temporaries).
    Measured on 2 cores: see docs/moe.md, "Load time"."""
    return max(1, min(4, torch.get_num_threads()))


def new_quant_layer(
    name: str,
    qw: QuantizedWeight,
    bias: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    activations: QuantizedActivations,
) -> QuantLinear:
    """The ``QuantLinear`` of ``qw`` for layer ``name`` (its packing; nothing shared is
    touched, so several can be built at once: ``moe.py``'s experts)."""
    try:
        return QuantLinear(qw, bias, device, dtype, activations)
    except ValueError as e:
        raise ValueError(f"cannot quantize {name}: {e}") from e


def count_layer(
    report: QuantReport, weight: torch.Tensor, layer: QuantLinear, error: float | None, name: str
) -> None:
    """Count ``layer`` (``weight``: the dense layer's, for its shape and size) in ``report``."""
    report.int8_layers += int(layer.int8_activations)
    if error is not None:
        report.errors[name] = error
    report.layers += 1
    report.weight_bytes += layer.nbytes  # as packed for its kernel
    report.dense_bytes += weight.numel() * weight.element_size()
    report.kernel &= layer.use_kernel


# Round-to-nearest works row by row (groups run along K), so quantizing a few rows at a time
# gives the very codes and scales of the whole matrix while its float32 temporaries stay
# small. Whole, a TinyLlama-1.1B gate/up weight ([11264, 2048]) took ~400 MB of them, which
# was most of the int8 load's peak above its final RSS (benchmarks/load_memory.py).
RTN_CHUNK_BYTES = 16 * 2**20  # float32 bytes of the rows quantized at once


def rtn_weight(
    w: torch.Tensor, method: Quantization, group_size: int | None, name: str
) -> tuple[QuantizedWeight, float]:
    """``w`` rounded to nearest, a chunk of rows at a time, and its relative error
    ``||W - Q(W)|| / ||W||`` (``relative_error``'s figure, summed over the chunks)."""
    bits, g = _rtn_scheme(method, group_size)
    rows = max(1, RTN_CHUNK_BYTES // (4 * w.shape[1]))
    parts, err2, ref2 = [], 0.0, 0.0
    for chunk in w.detach().split(rows):
        try:
            qw = quantize_rtn(chunk, bits, g)
        except ValueError as e:
            raise ValueError(f"cannot quantize {name}: {e}") from e
        ref = chunk.float()
        err2 += float((ref - qw.dequantize()).norm()) ** 2
        ref2 += float(ref.norm()) ** 2
        parts.append(qw)
    # the chunks share group size and code range: concatenated exactly as they are
    return concat_rows(parts), math.sqrt(err2 / ref2) if ref2 else 0.0


def _rtn_scheme(method: Quantization, group_size: int | None) -> tuple[int, int | None]:
    """(bits, group size; None: per output channel) of kvserve's round-to-nearest."""
    bits = 8 if method is Quantization.INT8 else 4
    return bits, group_size if group_size is not None or bits == 8 else DEFAULT_INT4_GROUP_SIZE


def check_rtn_groups(quant: QuantOptions, targets: list[tuple[nn.Module, str, str]]) -> None:
    """Refuse, before any weight loads, a group size that does not fit a layer to quantize
    with round-to-nearest (the error ``rtn_weight`` would raise on the first such layer)."""
    assert quant.method is not None
    _, g = _rtn_scheme(quant.method, quant.group_size)
    for parent, attr, name in targets:
        k = getattr(parent, attr).weight.shape[1]
        try:
            check_group_size(k if g is None else g, k)
        except ValueError as e:
            raise ValueError(f"cannot quantize {name}: {e}") from e
