"""Triton kernels (``paged_attention``: paged decode and prefill attention).

Importing the submodules needs the ``triton`` package (Linux x86_64: pulled by xgrammar, pinned
in the ``test`` extra). On a machine without CUDA they run only in Triton's interpreter, which
must be switched on (``TRITON_INTERPRET=1``) before they are imported.
"""
