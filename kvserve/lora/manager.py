"""``LoRAManager``: the one owner of the adapters a runner holds.

Two tiers, as in vLLM: up to ``max_cpu_loras`` adapters read into host memory (LRU), and
``max_loras`` device slots of stacked weights in every adapted layer (LRU among the
adapters not in the current step). The scheduler never puts more than ``max_loras``
distinct adapters in one step, so ``prepare`` always finds room. An adapter dropped from
host memory leaves its device slot too, and is read from its folder again when a request
needs it. Adapters used by a request the runner holds (``set_live``) are never dropped, even
past ``max_cpu_loras`` or after ``remove``: requests in flight finish on the adapter they
began with; a removed adapter goes when its last request does.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from kvserve.config import LoRAConfig
from kvserve.distributed.parallel_state import SINGLE, TPGroup
from kvserve.lora.layers import LayerLoRA, attach_lora
from kvserve.lora.peft_loader import LoRAModel, LoRAModelDims, load_peft_adapter
from kvserve.lora.punica import LoRAMapping
from kvserve.lora.request import LoRARequest
from kvserve.lora.sharding import shard_lora_model

logger = logging.getLogger("kvserve.lora")


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup = SINGLE,
    ) -> None:
        """``tp``: this runner's rank; each adapter is checked against the whole model, then
        only this rank's slice is kept (``lora/sharding.py``)."""
        self.config = config
        self.dtype, self.device = dtype, device
        self.tp = tp
        self.dims = LoRAModelDims.from_hf_config(model.config)  # type: ignore[arg-type]
        self.layers: list[LayerLoRA] = attach_lora(
            model, config.max_loras, config.max_lora_rank, dtype, device
        )
        self._requests: dict[int, LoRARequest] = {}  # registered adapters (add/remove)
        self._cpu: OrderedDict[int, LoRAModel] = OrderedDict()  # host memory, LRU first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # id -> device slot, LRU first
        self._live: set[int] = set()  # ids of requests the runner holds
        self._step: set[int] = set()  # ids of the step being prepared (never evicted by it)
        self.num_loads = 0  # adapters read from disk (tests watch the LRU with it)
        self.num_slot_loads = 0  # adapters copied into a device slot

    # -- registry ------------------------------------------------------------------------
    def add(self, req: LoRARequest) -> bool:
        """Read and check an adapter into host memory; False if it was already there.
        Raises ``LoRAAdapterError`` (a ValueError) with the reason for a bad adapter."""
        old = self._requests.get(req.lora_int_id)
        if old is not None and old.lora_path != req.lora_path:
            raise ValueError(
                f"lora_int_id {req.lora_int_id} is already adapter {old.lora_name!r} "
                f"({old.lora_path}); give another id"
            )
        if req.lora_int_id in self._cpu:
            self._requests[req.lora_int_id] = req
            self._cpu.move_to_end(req.lora_int_id)
            return False
        self._load(req)
        self._requests[req.lora_int_id] = req
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; its memory goes now, or when its last live request finishes."""
        if self._requests.pop(lora_int_id, None) is None:
            return False
        if lora_int_id not in self._live:
            self._drop(lora_int_id)
        return True

    def list_ids(self) -> set[int]:
        return set(self._requests)

    def cpu_ids(self) -> list[int]:
        """Adapters in host memory, least recently used first."""
        return list(self._cpu)

    def slot_ids(self) -> dict[int, int]:
        """Adapter id -> device slot, least recently used first."""
        return dict(self._slot_of)

    def set_live(self, ids: Iterable[int]) -> None:
        """The adapters of the requests the runner holds now (after each step message)."""
        ended = self._live - set(ids)
        self._live = set(ids)
        for i in ended:
            if i not in self._requests:
                self._drop(i)  # removed while its requests ran: they are done now

    # -- per step ------------------------------------------------------------------------
    def prepare(
        self, rows: Sequence[LoRARequest | None], counts: Sequence[int]
    ) -> LoRAMapping | None:
        """The step's mapping: each request's adapter in a device slot (loading it where
        needed), its token rows mapped there. None when no row has an adapter."""
        wanted = {r.lora_int_id: r for r in rows if r is not None}
        if not wanted:
            return None
        if len(wanted) > self.config.max_loras:  # the scheduler's cap: a bug if broken
            raise RuntimeError(f"{len(wanted)} adapters in one step; max_loras is "
                               f"{self.config.max_loras}")  # fmt: skip
        self._step = set(wanted)
        for req in wanted.values():
            self._ensure_slot(req, self._step)
        slots = [-1 if r is None else self._slot_of[r.lora_int_id] for r in rows]
        return LoRAMapping.from_rows(slots, counts, self.device)

    def _ensure_slot(self, req: LoRARequest, step_ids: set[int]) -> None:
        lid = req.lora_int_id
        if lid in self._slot_of:
            self._slot_of.move_to_end(lid)
            return
        model = self._cpu.get(lid)
        if model is None:  # evicted from host memory (or never added here): read it again
            model = self._load(req)
        self._cpu.move_to_end(lid)
        used = set(self._slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slot_of if i not in step_ids)
            slot = self._slot_of.pop(victim)
        for layer, ll in enumerate(self.layers):
            for w in ll.all():
                w.load_slot(slot, layer, model)
        self._slot_of[lid] = slot
        self.num_slot_loads += 1

    def _load(self, req: LoRARequest) -> LoRAModel:
        whole = load_peft_adapter(
            req.lora_path, req.lora_int_id, self.dims, self.config.max_lora_rank, self.dtype
        )
        model = shard_lora_model(whole, self.tp.rank, self.tp.world_size)
        self.num_loads += 1
        self._cpu[req.lora_int_id] = model
        self._evict_cpu(keep=req.lora_int_id)
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", req.lora_name,
                    req.lora_int_id, model.rank, req.lora_path)  # fmt: skip
        return model

    def _evict_cpu(self, keep: int) -> None:
        """Drop least recently used adapters past ``max_cpu_loras``, with their device slot
        (never ``keep``, nor one a live request uses: those may pass the limit)."""
        extra = len(self._cpu) - self.config.cpu_capacity
        for lid in list(self._cpu):
            if extra <= 0:
                break
            if lid == keep or lid in self._live or lid in self._step:
                continue
            self._drop(lid)
            extra -= 1

    def _drop(self, lid: int) -> None:
        self._cpu.pop(lid, None)
        slot = self._slot_of.pop(lid, None)
        if slot is not None:
            for ll in self.layers:
                for w in ll.all():
                    w.clear_slot(slot)
