"""Quantize a native model's linear layers while its checkpoint loads, one layer at a time.

Loading the whole model in the model dtype and then quantizing it (``apply.quantize_model``)
held every dense weight at once: a TinyLlama-1.1B-shaped model peaked at 4.6 GB of RSS for
int4 weights of 0.6 GB (``benchmarks/load_memory.py``). Here each linear layer to quantize
is replaced, before loading, by a ``PendingLinear`` whose weight has no storage until the
checkpoint's first tensor for it arrives; once every part of it (fused q/k/v or gate/up) and
its bias are in, it is quantized, a ``QuantLinear`` takes its place, the dense weight is freed
and the C heap trimmed. Checkpoints store a layer's tensors together (safetensors orders them
by name), so about one layer's dense weights exist at a time (int4: peak 1.6 GB).

The model's own ``load_weights`` runs unchanged: it copies through ``load_weight``, which
calls the layer's ``weight_loader``; ``PendingLinear.weight_loader`` wraps the original
one. Pre-quantized layers (a GGUF's, ``gguf_weights.GGUFLinears``) never get dense storage:
the loader hands ``load_weights`` meta tensors for them (shapes only, nothing read), which
the wrapped loader shape-checks and copies into the meta weight as a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.config import Quantization
from kvserve.distributed.layers import RowParallelLinear, RowParallelShard, default_weight_loader
from kvserve.distributed.parallel_state import TPGroup
from kvserve.ops.malloc_tuning import trim_heap
from kvserve.quantization.apply import (
    QuantOptions,
    QuantReport,
    check_known,
    check_rtn_groups,
    check_unsharded,
    count_layer,
    layer_weight,
    linears,
    load_workers,
    new_quant_layer,
)
from kvserve.quantization.qlinear import QuantLinear

if TYPE_CHECKING:
    from kvserve.quantization.checkpoint_linears import CheckpointLinears
    from kvserve.quantization.gguf_weights import GGUFLinears

logger = logging.getLogger(__name__)

Loader = Callable[..., None]  # a layer's weight_loader(param, loaded, shard)


class PendingLinear(nn.Module):
    """Stands where the linear layer ``name`` stands while the checkpoint loads: it has the
    layer's parameter names (``weight``, ``bias``), so ``load_weights`` finds them, and
    calls ``done(self)`` once every part of both is loaded.

    The weight is a tensor on ``device`` whose storage is empty (0 bytes) until the layer's
    first part arrives, and emptied again by ``release`` (as FSDP frees its flat
    parameters): the parameter object stays the one ``load_weights`` looked up.
    ``prequantized``: the layer's weight comes quantized from elsewhere, so it stays on the
    meta device and its checkpoint tensors (meta too) are only shape-checked."""

    def __init__(
        self,
        linear: nn.Linear,
        name: str,
        device: torch.device,
        done: Callable[[PendingLinear], None],
        prequantized: bool,
    ) -> None:
        super().__init__()
        self.name = name
        w = linear.weight
        if not prequantized:
            w = torch.empty_like(w, device=device)
            w.untyped_storage().resize_(0)  # never touched: no page was resident
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(torch.empty_like(linear.bias, device=device),
                                     requires_grad=False)  # fmt: skip
        self._inner: Loader | None = getattr(linear, "weight_loader", None)
        self._done = done
        # a row-parallel shard over several ranks keeps its all-reduce once quantized
        self.row_tp: TPGroup | None = None
        if isinstance(linear, RowParallelLinear) and linear.tp.world_size > 1:
            self.row_tp = linear.tp
        # A fused layer (MergedColumnParallelLinear, QKV) loads one part per checkpoint
        # tensor (shard 0, 1, ...), any other layer its whole weight at once (shard None).
        sizes = getattr(linear, "output_sizes", None)
        shards = list(range(len(sizes))) if sizes is not None else [None]
        params = ("weight",) if linear.bias is None else ("weight", "bias")
        self.missing: set[tuple[str, int | None]] = {(p, s) for p in params for s in shards}

    @torch.no_grad()
    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        which = "weight" if param is self.weight else "bias" if param is self.bias else None
        if which is None or (which, shard) not in self.missing:
            raise ValueError(f"{self.name}: unexpected or repeated checkpoint part {shard}")
        storage = param.untyped_storage()
        if not param.is_meta and storage.nbytes() == 0:
            storage.resize_(param.numel() * param.element_size())  # the first part is here
        if self._inner is not None:
            self._inner(param, loaded, shard)
        elif shard is not None:
            raise ValueError(f"{self.name}: {type(self).__name__} is not a fused layer")
        else:
            default_weight_loader(param, loaded)
        self.missing.discard((which, shard))
        if not self.missing:
            self._done(self)

    def release(self) -> None:
        """Free the dense weight's storage (its shape stays, for the record)."""
        if not self.weight.is_meta:
            self.weight.untyped_storage().resize_(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.name} is still loading")


class StreamingQuantizer:
    """Puts ``PendingLinear``s where the model's linears to quantize stand (the model still
    on the meta device, its parameters in the model dtype) and swaps each for its
    ``QuantLinear`` as its weights complete. ``source``: where pre-quantized weights come
    from (a pre-quantized checkpoint's ``CheckpointLinears``; a GGUF's ``GGUFLinears`` is
    opened here); ``skip``: checkpoint tensors the loader must not read (a GGUF's quantized
    projections); ``finish`` returns the report."""

    def __init__(
        self,
        model: nn.Module,
        quant: QuantOptions,
        device: torch.device,
        dtype: torch.dtype,
        source: CheckpointLinears | None = None,
    ) -> None:
        assert quant.method is not None
        check_unsharded(model, quant.method)
        self.quant, self.device, self.dtype = quant, device, dtype
        self.report = QuantReport(quant.method.value)
        self.source: GGUFLinears | CheckpointLinears | None = source
        self.skip: set[str] = set()
        targets = linears(model)
        if quant.method is Quantization.MXFP4:  # gpt-oss's experts only, as stored
            targets = []  # (model/gpt_oss.py): its other linears stay in the model dtype
        if quant.method is Quantization.GGUF:
            from kvserve.quantization.gguf_weights import GGUFLinears

            assert quant.gguf_file is not None  # ModelConfig checks it
            self.source = GGUFLinears(quant.gguf_file, model.config)  # type: ignore[arg-type]
        if self.source is not None:
            check_known(self.source.modules, targets)
            # projections the file stores as floats stay ordinary layers
            targets = [t for t in targets if t[2] in self.source.modules]
            self.skip = set(self.source.checkpoint_names)
        else:
            check_rtn_groups(quant, targets)
        self.pending: dict[str, tuple[nn.Module, str]] = {}
        # a GGUF's layers are built side by side (``_quantize``); checkpoints' readers
        # (CheckpointLinears) and RTN's held dense weights stay one layer at a time
        gguf = quant.method is Quantization.GGUF and load_workers() > 1
        self._pool = ThreadPoolExecutor(load_workers()) if gguf else None
        self._building: list[tuple[PendingLinear, Future[tuple[QuantLinear, float | None]]]] = []
        for parent, attr, name in targets:
            stand_in = PendingLinear(getattr(parent, attr), name, device, self._quantize,
                                     prequantized=self.source is not None)  # fmt: skip
            setattr(parent, attr, stand_in)
            self.pending[name] = (parent, attr)

    def head_from_file(self, tp_size: int, tied: bool) -> bool:
        """Whether the LM head will be the GGUF's own output tensor (``quantize_lm_head``
        after loading): then its dense weight is never read (``skip``) nor allocated by the
        caller. Only an untied head of a kept type: the dequantized float32 copy and the
        model-dtype weight of gpt-oss-20b's 201,088 x 2880 head would be 2.3 + 1.2 GB of
        load peak for a weight dropped right after."""
        from kvserve.quantization.gguf_weights import output_tensor_kept
        from kvserve.quantization.lm_head import wants_quantized_head

        if self.quant.method is not Quantization.GGUF or tied:
            return False
        if not wants_quantized_head(self.quant, True, tp_size):
            return False
        assert self.quant.gguf_file is not None
        if not output_tensor_kept(self.quant.gguf_file):
            return False
        self.skip.add("lm_head.weight")
        return True

    def _quantize(self, stand_in: PendingLinear) -> None:
        """``stand_in``'s weight is complete: its layer now (RTN, whose dense weight is held
        until then) or, from a GGUF, on the ``load_workers()`` threads, put in place by
        ``finish`` in the order the layers completed (the file's blocks need nothing the
        loader holds, and reading, decoding and packing them was half of a dense GGUF's
        load: TinyLlama-1.1B Q4_K_M 5.2 of 10.9 s)."""
        if self._pool is None:
            self._install(stand_in, *self._build(stand_in))
            trim_heap()
        else:
            self._building.append((stand_in, self._pool.submit(self._build, stand_in)))

    def _build(self, stand_in: PendingLinear) -> tuple[QuantLinear, float | None]:
        name, w = stand_in.name, stand_in.weight
        qw, err = layer_weight(self.quant, name, w, self.source.take(name) if self.source else None)
        stand_in.release()  # before the codes are packed for the kernel: less at once
        own_bias = None if stand_in.row_tp is not None else stand_in.bias  # a shard adds it after
        layer = new_quant_layer(name, qw, own_bias, self.device, self.dtype,
                                self.quant.activations)  # fmt: skip
        return layer, err

    def _install(self, stand_in: PendingLinear, layer: QuantLinear, err: float | None) -> None:
        """Count ``layer`` and put it where ``stand_in`` stands (on the loading thread)."""
        count_layer(self.report, stand_in.weight, layer, err, stand_in.name)
        tp = stand_in.row_tp
        # the partial products of this rank's input slice: all-reduce
        done = layer if tp is None else RowParallelShard(layer, tp, stand_in.bias)
        parent, attr = self.pending.pop(stand_in.name)
        setattr(parent, attr, done)

    def finish(self) -> QuantReport:
        """After ``load_weights``: every layer quantized; the report (also logged)."""
        if self._pool is not None:
            try:
                for stand_in, built in self._building:
                    self._install(stand_in, *built.result())
            finally:
                self._pool.shutdown(cancel_futures=True)
                self._pool, self._building = None, []
            trim_heap()
        if self.pending:
            raise ValueError(f"the checkpoint is missing weights of {sorted(self.pending)[:3]}")
        logger.info("quantized %s", self.report.summary())
        return self.report
