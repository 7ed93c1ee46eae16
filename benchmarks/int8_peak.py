"""This CPU's peak rate of int8 dot products, in int8 ops/s: AVX512-VNNI ``vpdpbusd`` where the
CPU has it, else AVX2 ``vpmaddubsw``.

The compute ceiling of kvserve's int8-activation kernel (``csrc/quant_linear_a8.cpp``): every
thread runs 12 independent chains on registers, nothing else. VNNI: ``vpdpbusd`` (64 u8 x s8
multiply-adds into int32, 128 ops). AVX2: ``vpmaddubsw`` then ``vpaddw`` (32 u8 x s8
multiply-adds summed in int16 pairs, 64 ops), the inner step of the AVX2 kernel's int4 blocks
(``csrc/quant_linear_a8_avx2.h``; its int8 codes need more instructions per product). A
prefill-bound quantized step cannot run faster than its multiply-adds at this rate. Built at
first use with ``torch.utils.cpp_extension`` (the same compiler as kvserve's kernels), in a
cache of its own.

    python benchmarks/int8_peak.py              # 2 threads
    python benchmarks/int8_peak.py --threads 1
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
// One dot step per ISA: the vector type, its accumulators, the step, and the lane sum.
#if defined(__AVX512VNNI__)
typedef __m512i kv_vec;
#define KV_SET8(v) _mm512_set1_epi8(v)
#define KV_ACC(i) __m512i a##i = _mm512_set1_epi32(i);
#define KV_DOT(i) a##i = _mm512_dpbusd_epi32(a##i, x, y);
#define KV_SUM(i) s = _mm512_add_epi32(s, a##i);
#define KV_KEEP "+v"
inline int64_t kv_lanes(kv_vec s) { return _mm512_reduce_add_epi32(s); }  // 16 int32
#elif defined(__AVX2__)
typedef __m256i kv_vec;
#define KV_SET8(v) _mm256_set1_epi8(v)
#define KV_ACC(i) __m256i a##i = _mm256_set1_epi16(i);
#define KV_DOT(i) a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(x, y));
#define KV_SUM(i) s = _mm256_add_epi16(s, a##i);
#define KV_KEEP "+x"
inline int64_t kv_lanes(kv_vec s) {  // 16 int16
  alignas(32) int16_t v[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), s);
  int64_t total = 0;
  for (int i = 0; i < 16; ++i) total += v[i];
  return total;
}
#endif

// int8 ops (2 per multiply-add) of one KV_DOT: 128 (vpdpbusd), 64 (vpmaddubsw), 0 (neither).
int64_t int8_dot_ops() {
#if defined(__AVX512VNNI__)
  return 128;
#elif defined(__AVX2__)
  return 64;
#else
  return 0;
#endif
}

// Runs `iters` rounds of 12 dot steps on each of `threads` tasks; returns a checksum.
int64_t int8_dot_rounds(int64_t iters, int64_t threads) {
#if defined(__AVX512VNNI__) || defined(__AVX2__)
  std::vector<int64_t> sums(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      kv_vec x = KV_SET8(3), y = KV_SET8(5);
      KV_ACC(0) KV_ACC(1) KV_ACC(2) KV_ACC(3) KV_ACC(4) KV_ACC(5)
      KV_ACC(6) KV_ACC(7) KV_ACC(8) KV_ACC(9) KV_ACC(10) KV_ACC(11)
      for (int64_t it = 0; it < iters; ++it) {
        KV_DOT(0) KV_DOT(1) KV_DOT(2) KV_DOT(3) KV_DOT(4) KV_DOT(5)
        KV_DOT(6) KV_DOT(7) KV_DOT(8) KV_DOT(9) KV_DOT(10) KV_DOT(11)
        __asm__ volatile("" : KV_KEEP(x));  // the loop is not folded away
      }
      kv_vec s = a0;
      KV_SUM(1) KV_SUM(2) KV_SUM(3) KV_SUM(4) KV_SUM(5) KV_SUM(6)
      KV_SUM(7) KV_SUM(8) KV_SUM(9) KV_SUM(10) KV_SUM(11)
      sums[t] = kv_lanes(s);
    }
  });
  int64_t total = 0;
  for (int64_t v : sums) total += v;
  return total;
#else
  TORCH_CHECK(false, "int8_dot_rounds needs AVX512-VNNI or AVX2");
#endif
}
"""

CHAINS = 12


@functools.cache
def _module() -> Any:
    from torch.utils import cpp_extension

    build = os.path.join(os.path.expanduser("~"), ".cache", "kvserve", "int8_peak")
    os.makedirs(build, exist_ok=True)
    return cpp_extension.load_inline(
        name="kvserve_int8_peak", cpp_sources=SOURCE, functions=["int8_dot_rounds", "int8_dot_ops"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
        build_directory=build,
    )  # fmt: skip


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def vnni_available() -> bool:
    return "avx512_vnni" in _cpu_flags()


def int8_peak_isa() -> str | None:
    """The instructions ``measure_int8_peak`` times here: ``vpdpbusd`` (AVX512-VNNI),
    ``vpmaddubsw`` (AVX2) or None."""
    flags = _cpu_flags()
    return "vpdpbusd" if "avx512_vnni" in flags else ("vpmaddubsw" if "avx2" in flags else None)


def measure_int8_peak(
    threads: int | None = None, iters: int = 20_000_000, repeats: int = 3
) -> float:
    """int8 ops/s of ``threads`` threads (default: torch's) issuing only int8 dot steps
    (``int8_peak_isa``), best of ``repeats``."""
    import torch

    n = threads or torch.get_num_threads()
    mod = _module()
    mod.int8_dot_rounds(1000, n)  # warm the pool
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mod.int8_dot_rounds(iters, n)
        best = min(best, time.perf_counter() - t0)
    return n * iters * CHAINS * mod.int8_dot_ops() / best


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    isa = int8_peak_isa()
    if isa is None:
        raise SystemExit("this CPU has neither AVX512-VNNI nor AVX2")
    torch.set_num_threads(args.threads)
    peak = measure_int8_peak(args.threads)
    print(f"int8 dot-product peak ({isa}), {args.threads} threads: {peak / 1e12:.2f} T ops/s")


if __name__ == "__main__":
    main()
