"""The package ships every file the kernel build compiles or includes: the C++ kernels are
built on the user's machine from the installed package's ``csrc``, so a source or header left
out of ``[tool.setuptools.package-data]`` breaks the build of a non-editable install (the
``*.h`` headers were missing from the wheel until the package data named them)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

from kvserve.ops.kernel_build import SOURCE_SUFFIXES

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_source_is_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["kvserve"]
    csrc = ROOT / "kvserve" / "csrc"
    files = sorted(p.relative_to(ROOT / "kvserve").as_posix() for p in csrc.iterdir()
                   if p.suffix in SOURCE_SUFFIXES)  # fmt: skip
    assert any(f.endswith(".h") for f in files) and any(f.endswith(".cpp") for f in files)
    left_out = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert left_out == []
