"""Pre-quantized Hugging Face checkpoints: the compressed-tensors format (llm-compressor's,
the one vLLM reads for its W4A16 / W8A16 models), AutoAWQ's int4 GEMM layout, and GPTQ
(``gptq.py``).

Weight-only integer schemes load into kvserve's quantized layers as they are:
``pack-quantized`` (int4 or int8 codes packed into int32, ``weight_packed``) and
``naive-quantized`` (int8 codes, ``weight``), symmetric or with a zero point, per channel or per
group, with ``weight_scale`` (and ``weight_zero_point``). A weight is
``(q - zero_point) * scale``; the compressed-tensors library itself unpacks the codes and
parses the config. Schemes that quantize activations (W8A8, FP8, NVFP4, ...) are refused.

AutoAWQ checkpoints (``quant_method: awq``, ``version: gemm``: ``qweight [K, N/8]`` and
``qzeros [K/g, N/8]`` int32 in AWQ's nibble order, ``scales [K/g, N]`` float16, a weight
``(q - zero) * scale``) go through the compressed-tensors library's own ``AutoAWQConverter``
into the pack-quantized tensors above, then load the same way. Its other layouts (GEMV,
Marlin) are refused, as vLLM's ``awq`` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from kvserve.config import Quantization
from kvserve.quantization import gptq
from kvserve.quantization.qweight import QuantizedWeight

FORMATS = ("pack-quantized", "naive-quantized")
AWQ = "awq"  # WeightScheme.format of an AutoAWQ GEMM checkpoint
_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight")


@dataclass(frozen=True)
class WeightScheme:
    """The one weight-only integer scheme a checkpoint uses."""

    format: str  # one of FORMATS, AWQ, or one of gptq.FORMATS
    bits: int  # 4 or 8
    group_size: int | None  # None: one scale per output channel
    symmetric: bool

    @property
    def method(self) -> Quantization:
        """The ``--quantization`` this checkpoint loads as (found without the flag)."""
        if self.format == AWQ:
            return Quantization.AWQ
        return Quantization.GPTQ if self.format in gptq.FORMATS else Quantization.COMPRESSED_TENSORS


def checkpoint_scheme(config: PretrainedConfig) -> WeightScheme | None:
    """The checkpoint's compressed-tensors scheme; None when its weights are not quantized.
    A quantization kvserve cannot run is a ValueError naming what it is."""
    raw: Any = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    method = raw.get("quant_method")
    if method == "awq":
        return _awq_scheme(raw)
    if method == "gptq":
        return WeightScheme(*gptq.gptq_config(raw))
    if method == "mxfp4" and getattr(config, "model_type", None) == "gpt_oss":
        # gpt-oss's MXFP4 experts are dequantized to the model dtype as they load
        # (kvserve/model/gpt_oss.py); the rest of the checkpoint is unquantized
        return None
    if method != "compressed-tensors":
        raise ValueError(
            f"the checkpoint is quantized with {method!r}; kvserve loads pre-quantized weights "
            "in the compressed-tensors (W4A16/W8A16), AutoAWQ (GEMM) and GPTQ formats only"
        )
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(raw)
    fmt = str(qc.format)
    schemes = list(qc.config_groups.values())
    if fmt not in FORMATS or len(schemes) != 1:
        raise ValueError(
            f"compressed-tensors format {fmt!r} with {len(schemes)} scheme groups: kvserve "
            f"loads one weight-only scheme in {FORMATS}"
        )
    scheme = schemes[0]
    w = scheme.weights
    if scheme.input_activations is not None or w is None:
        raise ValueError(
            "the checkpoint quantizes activations (e.g. W8A8); kvserve loads weight-only "
            "checkpoints (W4A16/W8A16) and quantizes activations itself, dynamically, per "
            "--quantization-activations"
        )
    strategy = str(getattr(w.strategy, "value", w.strategy))
    if str(getattr(w.type, "value", w.type)) != "int" or w.num_bits not in (4, 8):
        raise ValueError(f"compressed-tensors weights of type {w.type} with {w.num_bits} bits: "
                         "kvserve runs int4 and int8")  # fmt: skip
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors strategy {strategy!r}: kvserve runs group and "
                         "channel")  # fmt: skip
    if w.actorder not in (None, "static") and strategy == "group":
        raise ValueError(f"GPTQ activation ordering {w.actorder!r} (a g_idx per layer) is not "
                         "supported")  # fmt: skip
    group = w.group_size if strategy == "group" else None
    return WeightScheme(fmt, int(w.num_bits), group, bool(w.symmetric))


def _awq_converter(raw: dict[str, Any]) -> Any:
    """compressed-tensors' converter for an AutoAWQ config; a clear ValueError if it refuses."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    raw = {**raw, "version": str(raw.get("version", "gemm")).lower()}
    try:
        conv = AutoAWQConverter.from_autoawq_config(raw)
    except ValueError as e:
        raise ValueError(f"AutoAWQ checkpoint: {e}; kvserve loads 4-bit GEMM checkpoints "
                         "(version 'gemm')") from e  # fmt: skip
    conv.ignore = []  # every qweight in the file is converted (modules_to_not_convert are dense)
    return conv


def _awq_scheme(raw: dict[str, Any]) -> WeightScheme:
    conv = _awq_converter(raw)
    group = int(conv.group_size) if conv.group_size and conv.group_size > 0 else None
    return WeightScheme(AWQ, int(conv.bits), group, not conv.zero_point)


def _qweight(params: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scale = params["weight_scale"].float()  # [N, K / g] (or [N, 1])
    if scheme.format in ("pack-quantized", AWQ):  # AWQ: as the converter repacked it
        shape = torch.Size(params["weight_shape"].tolist())
        codes = unpack_from_int32(params["weight_packed"], scheme.bits, shape)  # [N, K] int8
    else:
        codes = params["weight"].to(torch.int8)
    k = codes.shape[1]
    zeros = None
    if not scheme.symmetric:
        zp = params["weight_zero_point"]
        if scheme.format in ("pack-quantized", AWQ) and zp.dtype == torch.int32:
            zp = unpack_from_int32(zp, scheme.bits, torch.Size(scale.shape), packed_dim=0)
        zeros = -(zp.float() * scale)  # (q - z) s = q s - z s
    return QuantizedWeight(
        codes.contiguous(), scale.contiguous(), zeros, scheme.bits, k // scale.shape[1]
    )


AWQ_SUFFIXES = ("qweight", "qzeros", "scales")


def quantized_tensors(names: set[str], scheme: WeightScheme) -> dict[str, dict[str, str]]:
    """The checkpoint's quantized modules (``model.layers.0.self_attn.q_proj``) -> their
    tensors' leaf names -> full names, among tensor ``names``."""
    if scheme.format in gptq.FORMATS:
        suffixes = gptq.SUFFIXES
    else:
        suffixes = AWQ_SUFFIXES if scheme.format == AWQ else _SUFFIXES[:4]
    out: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf in suffixes or (leaf == "weight" and f"{module}.weight_scale" in names):
            out.setdefault(module, {})[leaf] = name
    return out


def part_weight(
    params: dict[str, torch.Tensor], scheme: WeightScheme, name: str
) -> QuantizedWeight:
    """One quantized module's checkpoint tensors (by leaf name) as a ``QuantizedWeight``."""
    if scheme.format in gptq.FORMATS:
        return gptq.gptq_weight(params, scheme.format, scheme.bits, name)
    if scheme.format == AWQ:  # qweight/qzeros/scales -> weight_packed/weight_scale/...
        conv = _awq_converter({"quant_method": "awq", "bits": scheme.bits, "version": "gemm",
                               "group_size": scheme.group_size or -1,
                               "zero_point": not scheme.symmetric})  # fmt: skip
        out = conv.process({f"m.{leaf}": t for leaf, t in params.items()})
        params = {k.removeprefix("m."): v for k, v in out.items()}
    return _qweight(params, scheme)
