"""Mixture-of-experts building blocks: top-k routing (``router.py``) and the stacked experts
with their grouped fast path and per-token reference (``experts.py``). The decoders that use
them are in ``kvserve/model/moe.py``."""
