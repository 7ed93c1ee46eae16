"""What machine a benchmark ran on, recorded with its results (the CPU changes between
sessions: `lscpu`'s model name, cores, the commit and whether the engine's tree was dirty)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def machine_info(engine: Any | None = None) -> dict[str, Any]:
    """CPU model (lscpu), cores, Python, torch, load, kvserve's commit and uncommitted files;
    with ``engine`` (an ``LLM`` or ``LLMEngine``) also the paths its run took (``run_paths``)."""
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
    info["cpu_paths"] = cpu_paths()
    if engine is not None:
        info["run_paths"] = run_paths(engine)
    return info


def run_paths(engine: Any) -> list[dict[str, Any]]:
    """Which paths a run took, per rank, as its runners read them back after loading
    (``ExecutionPaths``): fused ops and C++ decode loop on/off, the CPU capability torch
    dispatches to and the kernels' build flags, dtype and weight storage, thread count, the
    model thread's cores and each OpenMP thread's cores, the OpenMP wait policy."""
    llm_engine = getattr(engine, "engine", engine)  # LLM -> its LLMEngine
    return [paths.as_dict() for paths in llm_engine.rank_execution_paths]


def server_run_paths(base_url: str) -> list[dict[str, str]]:
    """The same facts for a running ``kvserve serve`` (rank 0's, one entry per model): its
    ``execution_paths_info`` gauge on ``/metrics`` (any metrics prefix)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [
        dict(sample.labels)
        for family in text_string_to_metric_families(text)
        if family.name.endswith(":execution_paths_info")
        for sample in family.samples
    ]


# The CPU features kvserve's kernels choose between (the CPU kind changes between sessions).
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def cpu_paths() -> dict[str, Any]:
    """Which of kvserve's CPU paths this machine takes: the ISA flags they depend on, what
    ``dtype=auto`` is, and each kernel's variant (results differ between CPU kinds by these)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    paths: dict[str, Any] = {"isa": [f for f in _ISA_FLAGS if f in flags]}
    try:
        import torch

        from kvserve.config import auto_dtype
        from kvserve.ops import cpu_kernels
        from kvserve.ops.packed_linear import _onednn_bf16_packing
        from kvserve.quantization.qlinear import _a8_kernel, bf16_native
    except ImportError:
        return paths
    paths["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    paths["auto_dtype"] = str(auto_dtype("cpu")).removeprefix("torch.")
    paths["onednn_bf16_packing"] = _onednn_bf16_packing()
    paths["cpp_kernels"] = cpu_kernels.available()
    if paths["cpp_kernels"]:
        paths["quant_bf16_activations"] = "avx512_bf16" if bf16_native() else "widened_fp32"
        paths["quant_int8_activations"] = _a8_kernel()  # the VNNI kernel (auto for bf16)
        isa = getattr(torch.ops.kvserve, "quant_linear_a8_isa", None)  # float32 x, no VNNI
        paths["quant_int8_activations_isa"] = str(isa()) if isa is not None else "none"
        # which layers auto gives int8 activations (qlinear.a8_auto_supports)
        avx2 = paths["quant_int8_activations_isa"] == "avx2"
        auto = "4-bit and Q5/Q6 codes (AVX2)" if avx2 else "none"
        paths["quant_int8_activations_auto"] = "bf16 layers (VNNI)" if _a8_kernel() else auto
        paths["wide_linear"] = str(torch.ops.kvserve.wide_linear_isa())
    return paths
