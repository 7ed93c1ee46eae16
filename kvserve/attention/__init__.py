"""Attention over the paged KV cache, behind one seam (``backend.AttentionBackend``).

``paged.py`` and ``prefill.py`` hold the metadata and the shared SDPA paths (with
``reference_paged_attention``, the yardstick); ``torch_sdpa.py`` and ``cpu_kernel.py`` are the
backends; ``selector.py`` picks one per model and device. See docs/ARCHITECTURE.md.
"""
