"""The C++ kernels must build where there is a compiler: a broken build fails every attention
test instead of skipping the kernel's."""

from __future__ import annotations

import pytest

from kvserve.ops import cpu_kernels
from tests.attention.utils import HAS_COMPILER


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if HAS_COMPILER:
        assert cpu_kernels.available(), "the C++ CPU kernels failed to build"
