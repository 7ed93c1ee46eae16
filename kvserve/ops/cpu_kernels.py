"""C++ CPU kernels (``kvserve/csrc``), compiled on first use with torch's extension builder.

They are fast paths only: every kernel has a pure-PyTorch reference it is tested against, and
when the build is impossible (no compiler, unusual CPU) the engine keeps using the reference.
The build takes ~20 s once per machine, torch version and source edit; the result is cached
under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a folder named by a
hash of the sources and flags. ``kernel_build`` makes the build safe to kill: a lock that
knows its owner (a killed build's lock is free), a log line when building or waiting, and a
timeout (``$KVSERVE_KERNEL_BUILD_TIMEOUT``) after which the PyTorch paths are used.
``$KVSERVE_CPU_ISA`` (``native``, ``avx2``, ``avx512``) builds a fixed instruction set's
variant instead of this CPU's own, in a cache folder of its own (``CpuIsa``).
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve.ops import kernel_build

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = [
    _CSRC / "paged_decode.cpp",
    _CSRC / "fused_ops.cpp",
    _CSRC / "sampling_ops.cpp",
    _CSRC / "quant_linear.cpp",
    _CSRC / "quant_linear_a8.cpp",
    _CSRC / "wide_linear.cpp",
    _CSRC / "lora_ops.cpp",
    _CSRC / "decode_layers.cpp",  # after the kernels it calls (it looks them up at first use)
    _CSRC / "moe_experts.cpp",  # likewise
]

# Compile the kernels with the vector width torch itself dispatches to on this CPU, so
# ATen's Vectorized<float> in the sources is AVX-512 (or AVX2) wide, not the generic loop.
_CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-march=native"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-march=native"],
}

ISA_ENV = "KVSERVE_CPU_ISA"


class CpuIsa(enum.Enum):
    """Which instruction set the kernels are built for (``$KVSERVE_CPU_ISA``).

    ``native`` is this CPU's own (``-march=native``). The forced ones build a fixed variant,
    so that a CI machine of one kind also builds and tests the other kind's code paths: an
    AVX-512 machine runs the AVX2 kernels under ``avx2``."""

    NATIVE = "native"
    AVX2 = "avx2"  # x86-64-v3: AVX2, FMA, F16C, BMI1/2 (AMD Zen 1-3, Intel Haswell on)
    AVX512 = "avx512"  # x86-64-v4 + AVX512-BF16 + AVX512-VNNI: every AVX-512 path kvserve has


_FORCED_FLAGS = {
    CpuIsa.AVX2: ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-march=x86-64-v3",
                  "-mtune=generic"],
    CpuIsa.AVX512: ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-march=x86-64-v4",
                    "-mavx512bf16", "-mavx512vnni", "-mtune=generic"],
}  # fmt: skip

# /proc/cpuinfo flags each forced variant executes (gcc's -march levels, plus what is added).
_REQUIRED_FLAGS = {
    CpuIsa.AVX2: ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"),
    CpuIsa.AVX512: ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq",
                    "avx512vl", "avx512_bf16", "avx512_vnni"),
}  # fmt: skip


def requested_isa() -> CpuIsa:
    """``$KVSERVE_CPU_ISA`` (default native); any other value is an error."""
    raw = os.environ.get(ISA_ENV, "").strip().lower() or CpuIsa.NATIVE.value
    try:
        return CpuIsa(raw)
    except ValueError:
        choices = ", ".join(i.value for i in CpuIsa)
        raise ValueError(f"${ISA_ENV} must be one of {choices}, got {raw!r}") from None


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def missing_flags(isa: CpuIsa, flags: frozenset[str]) -> list[str]:
    """The CPU flags ``isa``'s build executes that ``flags`` lacks (none for native)."""
    return [f for f in _REQUIRED_FLAGS.get(isa, ()) if f not in flags]


def kernel_build_spec() -> kernel_build.KernelBuild:
    """This CPU's build of the kernels (or the ``$KVSERVE_CPU_ISA`` variant): its name,
    sources, flags and cache folder. A forced ISA this CPU lacks raises ``RuntimeError``."""
    isa = requested_isa()
    if isa is CpuIsa.NATIVE:
        cap = torch.backends.cpu.get_cpu_capability()
        name, isa_flags = cap.lower(), _CAPABILITY_FLAGS.get(cap, [])
    else:
        missing = missing_flags(isa, cpu_flags())
        if missing:
            raise RuntimeError(
                f"${ISA_ENV}={isa.value}: this CPU lacks {', '.join(missing)} (unset it to "
                "build for this CPU's own instruction set)"
            )
        name, isa_flags = f"isa_{isa.value}", _FORCED_FLAGS[isa]
    # -ffp-contract=off: a*b+c must round twice, as the PyTorch op chains being fused do.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", *isa_flags]
    return kernel_build.KernelBuild(
        name=f"kvserve_cpu_kernels_{name}",
        sources=tuple(_SOURCES),
        cflags=tuple(flags),
        ldflags=("-fopenmp",),
        root=kernel_build.default_root(),
    )


def build_isa() -> str:
    """What the kernels are (or would be) built for: ``avx2`` / ``avx512`` when forced, else
    this CPU's torch capability in lower case (``avx2``, ``avx512``, ``default``)."""
    isa = requested_isa()
    if isa is CpuIsa.NATIVE:
        return torch.backends.cpu.get_cpu_capability().lower()
    return isa.value


_LOAD_LOCK = threading.Lock()


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels; False, with a warning, if impossible
    (a forced ``$KVSERVE_CPU_ISA`` this CPU lacks too) or not done within
    ``$KVSERVE_KERNEL_BUILD_TIMEOUT`` seconds. An unknown ``$KVSERVE_CPU_ISA`` raises. Once
    per process even when several threads ask first (``functools.cache`` alone lets each
    caller in until one returns; quantized layers are built on ``load_workers()`` threads)."""
    with _LOAD_LOCK:
        return _load()


@functools.cache
def _load() -> bool:
    if os.environ.get("KVSERVE_DISABLE_CPU_KERNELS") == "1":
        return False
    requested_isa()  # a bad $KVSERVE_CPU_ISA is an error, not a silent fallback
    try:
        error = kernel_build.load(kernel_build_spec(), kernel_build.build_timeout())
    except Exception as exc:  # any failure means "use the reference path"
        error = repr(exc)
    if error is not None:
        logger.warning("CPU kernels unavailable, using the PyTorch paths: %s", error)
        return False
    return True


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Decode attention reading K/V in place through the block tables, written into ``out``.

    q, out: ``[T, H, D]``; caches ``[num_blocks, Hkv, block_size, D]``; block_tables
    ``[Bd, nb]`` int64 (rows may be a strided view); seq_lens ``[Bd]`` int64; rows ``[Bd]``
    int64 token rows of q/out for each decode row, or empty when row i is token i.
    ``sliding_window``: a row of length L reads only tokens ``max(0, L - window)..L - 1``;
    ``soft_cap``: scores ``cap * tanh(s / cap)`` before the softmax; ``sinks``: ``[H]``
    logits joining each query head's softmax denominator (gpt-oss; None: unset each).
    """
    torch.ops.kvserve.paged_decode_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        rows,
        scale,
        0 if sliding_window is None else sliding_window,  # 0: the kernel's "no window"
        0.0 if soft_cap is None else soft_cap,  # 0: no soft-cap
        None if sinks is None else sinks.float().contiguous(),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm of ``[T, hidden]`` rows in one pass (see ``RMSNorm``);
    ``unit_offset``: Gemma's ``(1 + w)`` RMSNorm, rounded once at the end (``GemmaRMSNorm``)."""
    out = torch.empty_like(x)
    torch.ops.kvserve.rms_norm(out, x, weight, eps, unit_offset)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:
    """``residual += x`` (in place, rounded to its dtype), then returns RMSNorm(residual)."""
    out = torch.empty_like(x)
    torch.ops.kvserve.add_rms_norm(out, residual, x, weight, eps, unit_offset)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [T, 2 * I]`` -> ``[T, I]`` (see ``MLP``)."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.kvserve.silu_and_mul(out, gate_up)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for ``gate_up = [T, 2 * I]`` -> ``[T, I]``
    (Gemma's GeGLU, see ``MLP``)."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.kvserve.gelu_tanh_and_mul(out, gate_up)
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> torch.Tensor:
    """Rotate q and k of the fused projection ``qkv`` ``[T, (H + 2 Hkv) * D]`` with
    ``cos``/``sin`` ``[T, D]``, store k and v in their cache slots; returns q ``[T, H, D]``.

    ``qk_norm``: the q and k norm weights (``[D]`` each; Qwen3, Gemma3), applied to every
    head before the rotation (Gemma's ``(1 + w)`` form with ``unit_offset``)."""
    head_dim = k_cache.shape[3]
    q = qkv.new_empty(qkv.shape[0], num_heads, head_dim)
    q_w, k_w = qk_norm if qk_norm is not None else (None, None)
    torch.ops.kvserve.rope_write_kv(
        q, qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
        q_w, k_w, eps, unit_offset,
    )  # fmt: skip
    return q


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every token of float32 ``logits[rows[g]]`` whose bit is clear in
    int32 ``bitmask[g]`` (xgrammar's packed layout)."""
    index = torch.tensor(rows, dtype=torch.long)  # [G]
    torch.ops.kvserve.apply_token_bitmask(logits, bitmask.contiguous(), index)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.max(dim=-1).indices`` of ``[N, V]`` rows (first maximum; a NaN wins), ``[N]`` int64,
    read straight from bf16 logits instead of a float32 copy."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    torch.ops.kvserve.argmax_rows(out, x)
    return out


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bts: Sequence[torch.Tensor],
    token_slots: torch.Tensor,
) -> None:
    """``out[t, slice i] += (x[t] @ A[s_t]^T)[rank block i] @ Bt_i[s_t]`` in place for every
    row with slot ``s_t >= 0`` (``csrc/lora_ops.cpp``; reference
    ``kvserve.lora.punica.lora_delta_reference``). x ``[T, K]``, out ``[T, sum N_i]`` (unit
    column stride), A ``[S, n*R, K]``, each Bt ``[S, R, N_i]``, token_slots ``[T]`` int64."""
    torch.ops.kvserve.lora_add(out, x, a, list(bts), token_slots)
