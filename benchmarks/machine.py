"""What machine a benchmark ran on, recorded with its results (the CPU changes between
sessions: `lscpu`'s model name, cores, the commit and whether the engine's tree was dirty)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def machine_info() -> dict[str, Any]:
    """CPU model (lscpu), cores, Python, torch, load, kvserve's commit and uncommitted files."""
    info: dict[str, Any] = {"cpu": platform.processor() or None, "cores": os.cpu_count()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = " ".join(line.split(":", 1)[1].split())
    except (OSError, subprocess.CalledProcessError):
        pass
    git = ["git", "-C", str(REPO)]
    try:
        info["commit"] = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "kvserve"], capture_output=True, text=True
        ).stdout.splitlines()
        info["kvserve_uncommitted_files"] = [line[3:] for line in dirty]
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    info["python"] = platform.python_version()
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    info["load_average"] = list(os.getloadavg())
    return info
