"""The attention seam: what a backend says it supports, builds per step, and computes.

A backend is chosen once per model by ``selector.py`` and handed to the model in every
``ForwardBatch``; models call ``backend.write_kv`` and ``backend.forward`` and never name an
attention function. Shape of vLLM's ``AttentionBackend`` + metadata builder and mini-sglang's
``BaseAttnBackend`` + registry, without their global forward context.

Every backend serves every kind of row a step holds, in one flat batch (``AttentionMetadata``
in ``paged.py``): fresh prefills, prefills after cached context (prefix-cache hits), chunked
prefills, decode rows and speculative verification rows (the last token plus k proposals,
each query seeing exactly the keys a one-token step at its position would). Its results are
``reference_paged_attention``'s (to rounding; tested in ``tests/attention``).

Adding one (``docs/ARCHITECTURE.md``, "Adding an attention backend"): a subclass with its
class attributes, ``forward`` (and ``build_metadata`` when it needs its own per-step tensors),
an ``AttentionBackendEnum`` member and a line in ``selector.BACKENDS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvserve.attention.paged import AttentionMetadata, GatherWorkspace, write_kv
from kvserve.config import AttentionBackendEnum

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache; one instance per model (the
    runner's target and a draft model each own one: it owns the step's gather buffers)."""

    name: ClassVar[AttentionBackendEnum]
    device_types: ClassVar[frozenset[str]]  # torch device types it runs on
    dtypes: ClassVar[frozenset[torch.dtype]]  # query / KV cache dtypes it computes
    supports_sliding_window: ClassVar[bool] = True
    supports_soft_cap: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True  # gpt-oss's per-head attention sinks
    # attends a decode-only step from device tensors alone (``static_decode_metadata``): what
    # a step replayed as a CUDA graph needs (``worker/cuda_graph.py``)
    supports_static_decode: ClassVar[bool] = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.workspace = GatherWorkspace()  # gather buffers reused across steps

    @classmethod
    def supports(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int,
        *,
        sliding_window: bool = False,
        soft_cap: bool = False,
        sinks: bool = False,
    ) -> str | None:
        """None when this backend runs a model with these properties, else why not (a
        sentence for the error). Cheap checks first: ``available`` (which may build a
        kernel) is asked only when everything else fits."""
        if device.type not in cls.device_types:
            return f"it runs on {sorted(cls.device_types)} devices, not {device.type}"
        if dtype not in cls.dtypes:
            names = sorted(DTYPE_NAMES.get(d, str(d)) for d in cls.dtypes)
            return f"it computes {names}, not {DTYPE_NAMES.get(dtype, dtype)}"
        reason = cls.check_head_size(head_size)
        if reason is not None:
            return reason
        if sliding_window and not cls.supports_sliding_window:
            return "the model has sliding-window layers, which it does not support"
        if soft_cap and not cls.supports_soft_cap:
            return "the model soft-caps its attention scores, which it does not support"
        if sinks and not cls.supports_sinks:
            return "the model has attention sinks (gpt-oss), which it does not support"
        return cls.available()

    @classmethod
    def check_head_size(cls, head_size: int) -> str | None:
        """Why ``head_size`` does not fit (None: it does); any size by default."""
        return None

    @classmethod
    def available(cls) -> str | None:
        """Why this backend cannot run here at all (None: it can): a kernel that failed to
        build, a missing package. Asked last by ``supports``."""
        return None

    def build_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata, built once and shared by every layer: the common fields come
        from the runner (``build_metadata`` in ``worker/inputs.py``), the backend adds what
        it reads. By default the row split every SDPA-based backend shares (decode batch,
        fresh-prompt groups, padded context groups gathering into this backend's buffers)."""
        md.split_rows(self.workspace)
        return md

    def static_decode_metadata(
        self,
        slot_mapping: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, max_blocks] int64
        seq_lens: torch.Tensor,  # [B] int32 on the device
        block_size: int,
        max_len: int,
    ) -> AttentionMetadata:
        """Metadata for a decode-only step of ``B`` rows (row ``i``: token ``i``) whose every
        per-step value lives in these device tensors, rewritten before each step: nothing of
        the step is read on the host, so the step can be captured once and replayed.
        ``max_len``: the longest context any row may have. Only backends with
        ``supports_static_decode``."""
        raise NotImplementedError(f"{self.name.value} cannot attend from device tensors alone")

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> None:
        """Store this step's K/V into their slots (``md.slot_mapping``)."""
        write_kv(k, v, k_cache, v_cache, md.slot_mapping)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] (the step's K/V already written)
        k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every row of the step over its context; returns ``[T, H, D]``.
        ``sliding_window``/``soft_cap``/``sinks`` per layer, as
        ``reference_paged_attention``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"
