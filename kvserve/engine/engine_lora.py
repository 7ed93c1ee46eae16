"""LoRA adapters of an engine: registering (vLLM's ``add_lora``), removing and listing them.

``LoRAMixin`` is part of ``LLMEngine`` (``llm_engine.py``), which owns the state it changes:
``loras`` (the registered adapters by name) and ``_lora_removals`` (adapters removed while
requests still use them; the runners forget them after the last one).
"""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.core.scheduler import Scheduler
from kvserve.executor import Executor
from kvserve.lora.request import LoRARequest


class LoRAMixin:
    """``LLMEngine``'s adapter registry; the attributes are the engine's."""

    config: EngineConfig
    executor: Executor
    scheduler: Scheduler
    loras: dict[str, LoRARequest]
    _lora_removals: set[int]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter and read it into the runners' host memory (vLLM's
        ``add_lora``); False if it was registered already. Raises ValueError with the reason
        (LoRA off, a name or id taken by another adapter, a bad adapter)."""
        if self.config.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora=True "
                             "(--enable-lora)")  # fmt: skip
        known = self.loras.get(lora_request.lora_name)
        if known == lora_request:
            return False
        if known is not None:
            raise ValueError(f"a LoRA adapter named {lora_request.lora_name!r} is already "
                             f"loaded (id {known.lora_int_id}, {known.lora_path})")  # fmt: skip
        for other in self.loras.values():
            if other.lora_int_id == lora_request.lora_int_id:
                raise ValueError(f"lora_int_id {other.lora_int_id} is already adapter "
                                 f"{other.lora_name!r}")  # fmt: skip
        if self.config.parallel.world_size > 1:
            self._check_adapter_here(lora_request)
        self.executor.collective_rpc("add_lora", lora_request)
        self.loras[lora_request.lora_name] = lora_request
        return True

    def _check_adapter_here(self, lora_request: LoRARequest) -> None:
        """Read and check the adapter in this process (a ``LoRAAdapterError`` with the
        reason), before the ranks do: under tensor parallelism an error raised on a rank is
        fatal to the engine (``executor/multiproc.py``), a bad adapter must fail its load
        only. The ranks then read the same files and cannot disagree."""
        from kvserve.lora.peft_loader import LoRAModelDims, load_peft_adapter
        from kvserve.model.loader import load_hf_config

        lc, mc = self.config.lora, self.config.model
        assert lc is not None
        dims = LoRAModelDims.from_hf_config(load_hf_config(mc.path))
        load_peft_adapter(
            lora_request.lora_path, lora_request.lora_int_id, dims, lc.max_lora_rank, mc.dtype
        )

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``): new requests can no longer name it;
        requests already queued or running on it finish on it. False if unknown."""
        name = next((n for n, r in self.loras.items() if r.lora_int_id == lora_int_id), None)
        if name is None:
            return False
        del self.loras[name]
        if not any(r.lora_int_id == lora_int_id for r in self.scheduler.requests.values()):
            self.executor.collective_rpc("remove_lora", lora_int_id)
        else:  # queued requests still need it: the runner forgets it after the last one
            self._lora_removals.add(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        """The registered adapters' ids (vLLM's ``list_loras``)."""
        return {r.lora_int_id for r in self.loras.values()}

    def _finish_lora_removals(self) -> None:
        """Removed adapters whose last request is gone leave the runners' memory."""
        in_use = {r.lora_int_id for r in self.scheduler.requests.values()}
        for lid in [i for i in self._lora_removals if i not in in_use]:
            self._lora_removals.discard(lid)
            if lid not in self.list_loras():  # not added again meanwhile
                self.executor.collective_rpc("remove_lora", lid)
