"""Load a Hugging Face model folder (config.json + safetensors) into kvserve's model.

Only safetensors are read: pickle checkpoints (``*.bin``) and remote code are refused, since
loading them can execute arbitrary code.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from kvserve.config import CpuLinearKernel, ModelImpl, Quantization, QuantizedActivations
from kvserve.distributed.parallel_state import TPGroup
from kvserve.model.architectures import architecture_name, remote_code_error
from kvserve.model.base import CausalLM
from kvserve.model.held_headers import headers_held
from kvserve.model.registry import (
    num_routed_experts,
    on_transformers_backend,
    resolve_model_class,
)
from kvserve.model.wide_linear import bf16_kernel_linears, resolve_weight_dtype, widen_linears
from kvserve.ops.packed_linear import FLOAT32_PACKED, pack_linears, packing_supported
from kvserve.quantization.apply import RTN_METHODS, QuantOptions, QuantReport, quantize_model
from kvserve.quantization.checkpoint_linears import CheckpointLinears
from kvserve.quantization.compressed_tensors import (
    WeightScheme,
    checkpoint_scheme,
)
from kvserve.quantization.lm_head import quantize_lm_head, wants_quantized_head
from kvserve.quantization.streaming import PendingLinear, StreamingQuantizer


def load_hf_config(path: str | Path) -> PretrainedConfig:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model folder: config.json is missing")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except ValueError as e:
        # A model type transformers lacks, whose config points at its own code.
        refusal = remote_code_error(path)
        if refusal is None:
            raise
        raise refusal from e


def _safetensors_files(path: Path) -> list[Path]:
    """The folder's safetensors files (those its index names, if it has one)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise ValueError(f"{path} has only pickle checkpoints; kvserve loads safetensors only")
        raise ValueError(f"no *.safetensors weights in {path}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wanted = set(json.loads(index.read_text())["weight_map"].values())
        files = [f for f in files if f.name in wanted]
    return files


def _iter_safetensors(
    path: Path, skip: Container[str] = frozenset(), drop: Container[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors, one at a time; the ``skip`` ones as meta
    tensors of their shape and dtype (their data is never read), the ``drop`` ones not at
    all.

    Each tensor is read from its own ``safe_open`` of the file, closed when the consumer asks
    for the next one: a tensor ``safe_open`` returns is a view of its memory map, and the
    pages it touches stay in the process's RSS until the map closes. One map kept open for the
    whole file held all of it resident by the end (TinyLlama-1.1B-shaped bf16: 2.2 GB on top
    of the model's own 2.2 GB, ``benchmarks/load_memory.py``)."""
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            names = [n for n in f.keys() if n not in drop]  # noqa: SIM118 (not a dict)
        for name in names:
            with safe_open(str(file), framework="pt") as f:
                if name in skip:
                    sliced = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES[sliced.get_dtype()]
                    yield name, torch.empty(sliced.get_shape(), dtype=dtype, device="meta")
                else:
                    yield name, f.get_tensor(name)


def _iter_weights(
    path: Path, skip: Container[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's weights as :func:`_iter_safetensors` gives them, or, for a large GGUF's
    folder that keeps them in the file (``gguf_convert.GGUF_WEIGHTS_FILE``), dequantized
    from it one at a time."""
    if _weights_in_gguf(path):
        from kvserve.model.gguf_convert import iter_gguf_weights  # imports gguf: only here

        return iter_gguf_weights(path, skip)
    return _iter_safetensors(path, skip)


def _weights_in_gguf(path: Path) -> bool:
    """Whether a converted GGUF folder reads its weights from the GGUF (``gguf_convert``)."""
    return (path / "gguf_weights.json").is_file()


P = ParamSpec("P")
R = TypeVar("R")


def holding_gguf_headers(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` inside ``held_headers.headers_held``: a GGUF's headers parsed once per load."""

    @functools.wraps(fn)
    def held(*args: P.args, **kwargs: P.kwargs) -> R:
        with headers_held():
            return fn(*args, **kwargs)

    return held


# safetensors' dtype names of the float tensors a skipped (pre-quantized) weight can have
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16}  # fmt: skip


@holding_gguf_headers
def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    max_positions: int,
    prepack: bool = False,
    fused_ops: bool = False,
    model_impl: ModelImpl | str = ModelImpl.AUTO,
    quant: QuantOptions | None = None,
    tp: TPGroup | None = None,
    decode_loop: bool = False,
    weight_dtype: torch.dtype | None = None,
    linear_kernel: CpuLinearKernel | str = CpuLinearKernel.AUTO,
    batch_invariant: bool = False,
) -> CausalLM:
    """Build the model for ``max_positions`` tokens of context and load its weights: the
    native class or the transformers backend, as ``model_impl`` resolves (``registry.py``);
    ``quant`` swaps the linear layers (but the LM head) for quantized ones. ``tp``: this
    process's tensor-parallel rank; the model is then this rank's shard (every rank calls
    ``load_model`` with the same arguments but ``tp``). ``decode_loop``: with the fused ops,
    decode-only steps run the layers in one C++ call where the model allows it.
    ``weight_dtype``: 16-bit stored linear weights computed in float32 (``wide_linear.py``;
    None: auto, the checkpoint's 16-bit dtype where that applies). ``linear_kernel``: a bf16
    model's dense linears (``bf16_kernel_linears``; auto only with ``prepack`` or
    ``batch_invariant``: that mode turns oneDNN's packing off, and the bf16 packed layout's
    kernel sums each row in one fixed order, so it keeps it where auto picks it)."""
    path = Path(path)
    config = load_hf_config(path)
    cls = resolve_model_class(config, model_impl)
    scheme = checkpoint_scheme(config)  # a pre-quantized checkpoint (compressed-tensors, ...)
    quant = _checked_quant(path, scheme, quant)
    _check_mxfp4(path, config, quant)
    _check_moe_quant(path, config, cls, scheme, quant)
    check_shardable(path, cls, scheme, quant, tp.world_size if tp is not None else 1)
    model: CausalLM
    report: QuantReport | None = None  # what quantization did, once it has
    if on_transformers_backend(cls):
        if (
            scheme is not None
            or _weights_in_gguf(path)
            or (quant is not None and quant.method is Quantization.GGUF)
        ):
            raise ValueError(
                f"{path}: pre-quantized weights (GGUF, compressed-tensors, AWQ, GPTQ) load into "
                "kvserve's native models only, not the transformers backend; use int8 or "
                "int4 on an unquantized checkpoint"
            )
        if quant is not None and quant.lm_head:  # asked for (None: auto, off here)
            raise ValueError(
                f"{path}: quantization_lm_head (--quantization-lm-head) needs one of kvserve's "
                "native model classes, not the transformers backend"
            )
        from kvserve.model.transformers_backend import load_transformers_model

        model = load_transformers_model(path, config, dtype, device, max_positions)
    elif scheme is not None:
        # the checkpoint's own codes, one fused module at a time (checkpoint_linears.py)
        source = CheckpointLinears(_safetensors_files(path), scheme)
        acts = quant.activations if quant is not None else QuantizedActivations.AUTO
        head = quant.lm_head if quant is not None else None
        quant = QuantOptions(scheme.method, activations=acts, lm_head=head)
        model, streaming = _load_native(cls, config, dtype, device, max_positions, tp, quant,
                                        source)  # fmt: skip
        dense = _iter_safetensors(path, drop=source.checkpoint_names)
        model.load_weights(itertools.chain(dense, source.meta_weights()))
        assert streaming is not None
        report = streaming.finish()
    else:
        # int8/int4/gguf: each linear layer is quantized as soon as its weights are in
        model, streaming = _load_native(cls, config, dtype, device, max_positions, tp, quant)
        skip = streaming.skip if streaming is not None else frozenset()
        model.load_weights(_iter_weights(path, skip))
        if streaming is not None:
            report = streaming.finish()
    if quant is not None and quant.method is not None:
        if report is None:  # not quantized while loading: the whole model is swapped now
            report = quantize_model(model, quant, torch.device(device), dtype)  # type: ignore[arg-type]
        tp_size = tp.world_size if tp is not None else 1
        if wants_quantized_head(quant, not on_transformers_backend(cls), tp_size):
            quantize_lm_head(model, quant, torch.device(device), dtype, report)  # type: ignore[arg-type]
        model.quant_report = report  # type: ignore[attr-defined]
    where = {
        "native": not on_transformers_backend(cls),
        # mxfp4 quantizes gpt-oss's experts only: its linear layers stay dense (packable)
        "quantized": quant is not None and quant.method not in (None, Quantization.MXFP4),
        "tp": tp.world_size if tp is not None else 1,
    }
    wide = resolve_weight_dtype(
        weight_dtype, dtype, torch.device(device), getattr(config, "dtype", None), **where
    )
    kernel = CpuLinearKernel(linear_kernel)
    if kernel is CpuLinearKernel.AUTO and not prepack and not batch_invariant:
        kernel = CpuLinearKernel.ONEDNN  # no repacking: nn.Linear stays
    if wide is None and bf16_kernel_linears(kernel, dtype, torch.device(device), **where):
        wide = torch.bfloat16  # bf16 math on the packed layout (wide_linear.py)
    if wide is not None:  # before packing: the widened layers are packed no more
        widen_linears(model, wide)
    if prepack and packing_supported(torch.device(device), dtype):
        # Any nn.Linear packs, transformers' modules too (bf16: all; float32: the LM head).
        pack_linears(model, only=FLOAT32_PACKED if dtype == torch.float32 else None)  # type: ignore[arg-type]
    if fused_ops:
        model.enable_fused_ops()
        if decode_loop:
            model.enable_decode_loop()
    model.eval()
    return model


def _checked_quant(
    path: Path, scheme: WeightScheme | None, quant: QuantOptions | None
) -> QuantOptions | None:
    """``quant``, refused where it does not fit the checkpoint (pre-quantized or not)."""
    method = quant.method if quant is not None else None
    pre = (Quantization.COMPRESSED_TENSORS, Quantization.AWQ, Quantization.GPTQ)
    if scheme is None and method in pre:
        assert method is not None
        raise ValueError(f"quantization {method.value!r}: {path} is not a pre-quantized "
                         "checkpoint (no quantization_config)")  # fmt: skip
    if scheme is not None and method not in (None, scheme.method):
        assert method is not None
        raise ValueError(f"{path} is already quantized ({scheme.method.value}); load it "
                         f"without quantization {method.value!r}")  # fmt: skip
    return quant


def _check_mxfp4(path: Path, config: PretrainedConfig, quant: QuantOptions | None) -> None:
    """``--quantization mxfp4`` keeps a gpt-oss MXFP4 checkpoint's experts as stored
    (model/gpt_oss.py): refused for any other checkpoint."""
    if quant is None or quant.method is not Quantization.MXFP4:
        return
    raw: Any = getattr(config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict()
    stored = (raw or {}).get("quant_method")
    if getattr(config, "model_type", None) != "gpt_oss" or stored != "mxfp4":
        raise ValueError(
            f"quantization 'mxfp4': {path} is not a gpt-oss checkpoint with MXFP4 experts "
            f"(model_type {getattr(config, 'model_type', None)!r}, quant_method {stored!r}); "
            "kvserve keeps MXFP4 experts as stored, it does not quantize to MXFP4"
        )


def _check_moe_quant(
    path: Path,
    config: PretrainedConfig,
    cls: type[Any],
    scheme: WeightScheme | None,
    quant: QuantOptions | None,
) -> None:
    """Refuse a quantization an MoE class cannot apply to its experts (they would stay in
    the model dtype): the native class says which (``quantization_refusal``); transformers
    keeps experts as 3D parameters, not the ``nn.Linear``s the backend's quantization swaps."""
    method = scheme.method if scheme is not None else quant.method if quant is not None else None
    if method is None:
        return
    check = getattr(cls, "quantization_refusal", None)
    refusal = check(method) if check is not None else None
    if on_transformers_backend(cls) and num_routed_experts(config):
        refusal = ("its experts are not nn.Linear layers in transformers and would stay in the "
                   "model dtype")  # fmt: skip
    if refusal:
        raise ValueError(f"{path}: {architecture_name(config)} cannot be quantized "
                         f"({method.value}): {refusal}")  # fmt: skip


def check_shardable(
    path: Path,
    cls: type[Any],
    scheme: WeightScheme | None,
    quant: QuantOptions | None,
    size: int,
) -> None:
    """Refuse what cannot be sharded over ``size`` ranks yet: the transformers backend,
    quantized layers and native classes that do not take a ``TPGroup``."""
    if size == 1:
        return
    if on_transformers_backend(cls):
        raise ValueError(
            f"{path}: tensor_parallel_size {size} needs a native kvserve model; the "
            "transformers backend runs unsharded (tensor_parallel_size 1)"
        )
    method = quant.method if quant is not None else None
    if quant is not None and quant.lm_head:
        raise ValueError(
            "quantization_lm_head does not support tensor parallelism yet "
            f"(tensor_parallel_size {size}): the LM head is split by vocabulary"
        )
    used = method or (scheme.method if scheme is not None else None)
    if used is not None and (scheme is not None or used not in RTN_METHODS):
        raise ValueError(
            f"quantization {used.value!r} does not support tensor parallelism yet "
            f"(tensor_parallel_size {size}); use tensor_parallel_size 1"
        )
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"{cls.__name__} does not support tensor parallelism yet (tensor_parallel_size {size})"
        )


def _load_native(
    cls: type[Any],
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    max_positions: int,
    tp: TPGroup | None = None,
    quant: QuantOptions | None = None,
    source: CheckpointLinears | None = None,
) -> tuple[Any, StreamingQuantizer | None]:
    """A native class (``registry.NATIVE_ARCHITECTURES``) with real, uninitialised storage;
    the caller loads its weights. With ``quant`` (int8, int4, gguf), its linear layers to
    quantize are ``PendingLinear``s without storage, quantized as the weights load by the
    ``StreamingQuantizer`` returned."""
    # Build on the meta device: random init of weights that are overwritten anyway costs
    # seconds. Cast there too, then allocate real (uninitialised) storage for what loads:
    # casting real storage touched every page, the whole model resident before any weight
    # was read.
    with torch.device("meta"):
        model = cls(config, max_positions) if tp is None else cls(config, max_positions, tp=tp)
    model.to(dtype=dtype)
    streaming = None
    if quant is not None and quant.method is not None:
        streaming = StreamingQuantizer(model, quant, torch.device(device), dtype, source)
        if hasattr(model, "quantize_experts_with"):  # MoE experts: stacked, not nn.Linear
            model.quantize_experts_with(streaming)
    # a GGUF's own LM head replaces the dense one after loading: that one stays on meta
    size = tp.world_size if tp is not None else 1
    head = streaming is not None and streaming.head_from_file(size, model.tie_word_embeddings)
    for module in model.modules():
        if isinstance(module, PendingLinear):  # its storage comes as its weights do
            continue
        if not (head and module is model.lm_head):
            module.to_empty(device=device, recurse=False)
    model.rotary.to_device(device)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model, streaming


# Architectures whose native classes apply the config's sliding windows (layer_types).
def model_max_len(config: PretrainedConfig) -> int:
    """The context length the checkpoint supports. A sliding window does not cap it: the
    attention applies windows per layer (``attention.paged_attention``)."""
    return int(getattr(config, "max_position_embeddings", 2048))
