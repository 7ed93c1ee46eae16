"""Headless Chromium for ``kvserve bench report --screenshot`` and the report's tests.

Debian's ``chromium`` package (``/usr/bin/chromium``; ``apt-get install -y chromium``), or
the binary in ``$KVSERVE_CHROMIUM``. The flags keep it off the network (a sandboxed machine
refuses its background connections, many at a time) and let it run as root in a container.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container has no user namespace for the sandbox
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
INSTALL_HINT = (
    "no Chromium found: install Debian's (apt-get install -y chromium) or set KVSERVE_CHROMIUM "
    "to a Chromium/Chrome binary."
)


def find_chromium() -> str | None:
    """``$KVSERVE_CHROMIUM``, else the first of ``CANDIDATES`` on ``PATH``; None if absent."""
    env = os.environ.get("KVSERVE_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(
    page: Path, png: Path, width: int = 1280, height: int = 2000, timeout_s: float = 120.0
) -> Path:
    """Render ``page`` (a local HTML file) headless into ``png`` (the top ``width`` x ``height``
    pixels), after up to 10 s of the page's own time for its scripts to draw."""
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError(INSTALL_HINT)
    png = png.resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-chromium-") as profile:
        cmd = [
            chromium,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "--virtual-time-budget=10000",
            f"--screenshot={png}",
            page.resolve().as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not png.is_file():
        raise RuntimeError(
            f"chromium --screenshot failed ({proc.returncode}): {proc.stderr[-2000:]}"
        )
    return png
