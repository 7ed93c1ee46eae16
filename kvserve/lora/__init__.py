"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

``request.py`` (``LoRARequest``), ``peft_loader.py`` (reading and checking a PEFT folder),
``punica.py`` (the grouped per-row delta and its reference), ``layers.py`` (stacked slot
weights per fused linear), ``manager.py`` (``LoRAManager``: host LRU and device slots).
"""

from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
