"""``LoRARequest``: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter folder, named for clients and numbered for the engine.

    ``lora_int_id`` is the engine's key for the adapter (its device slot, its prefix-cache
    blocks): positive and unique per adapter, as in vLLM. ``base_model_name``: the model the
    adapter was trained on, as `/v1/models` reports it (informational).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def cache_key(self) -> tuple[object, ...]:
        """What the prefix cache mixes into a block's hash: the same tokens computed under
        another adapter (or the base model) are other K/V. The path is part of it so an id
        re-registered for other weights never finds the old adapter's blocks."""
        return ("lora", self.lora_int_id, self.lora_path)
