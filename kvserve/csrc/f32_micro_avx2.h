// A float32 register-blocked FMA micro-kernel for AVX2 + FMA (8-wide vectors): MR <= 6 rows x
// 16 output channels, 12 named accumulators, over a weight panel laid out [kc][16] (16
// channels contiguous per k). Shared by the quantized kernels' tiles (quant_linear_avx2.h:
// dequantized int8/int4 chunks) and the 16-bit weights' panels (wide_linear.cpp: widened
// bf16/fp16 chunks). Include it inside the including file's anonymous namespace, after
// <immintrin.h>, <algorithm> and <cstdint>.
//
// Each output is one chain of FMAs along k, in k order, whatever MR or the row's place in
// its group of rows: a row's result never depends on the other rows (nor on kc's chunking,
// since the accumulators go through memory exactly between chunks).
#pragma once

constexpr int64_t kMicroRows = 6;  // rows per micro-kernel: 12 accumulators + 2 weights + x

// acc[MR rows][16] (row stride lda) += x[MR rows][kc] . w[kc][16]. Named accumulators, not
// arrays: gcc 12 kept arrays of __m256 on the stack and stored all 12 every step (measured:
// 64 rows at 33 GFLOP/s on one Zen 3 core, against 50 for MKL's float32 GEMM).
#define KV_MICRO_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define KV_MICRO_LOAD(r)                                 \
  __m256 lo##r = _mm256_setzero_ps(), hi##r = lo##r;    \
  if constexpr (MR > r) {                                \
    lo##r = _mm256_loadu_ps(acc + r * lda);              \
    hi##r = _mm256_loadu_ps(acc + r * lda + 8);          \
  }
#define KV_MICRO_FMA(r)                                          \
  if constexpr (MR > r) {                                        \
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);     \
    lo##r = _mm256_fmadd_ps(xv, w0, lo##r);                      \
    hi##r = _mm256_fmadd_ps(xv, w1, hi##r);                      \
  }
#define KV_MICRO_STORE(r)                        \
  if constexpr (MR > r) {                        \
    _mm256_storeu_ps(acc + r * lda, lo##r);      \
    _mm256_storeu_ps(acc + r * lda + 8, hi##r);  \
  }
template <int MR>
void micro_f32_avx2(const float* x, int64_t ldx, const float* w, int64_t kc, float* acc,
                    int64_t lda) {
  static_assert(MR >= 1 && MR <= kMicroRows);
  KV_MICRO_ROWS(KV_MICRO_LOAD)
  for (int64_t kk = 0; kk < kc; ++kk) {
    const __m256 w0 = _mm256_loadu_ps(w + kk * 16), w1 = _mm256_loadu_ps(w + kk * 16 + 8);
    KV_MICRO_ROWS(KV_MICRO_FMA)
  }
  KV_MICRO_ROWS(KV_MICRO_STORE)
}
#undef KV_MICRO_ROWS
#undef KV_MICRO_LOAD
#undef KV_MICRO_FMA
#undef KV_MICRO_STORE

// acc[mc][nv * 16] += x[mc][kc] . the chunk in buf [nv][kc][16].
void rows_f32_avx2(const float* x, int64_t ldx, int64_t mc, const float* buf, int64_t kc,
                   int64_t nv, float* acc) {
  const int64_t width = nv * 16;
  for (int64_t v = 0; v < nv; ++v) {
    const float* w = buf + v * kc * 16;
    int64_t r = 0;
    for (; r + kMicroRows <= mc; r += kMicroRows)
      micro_f32_avx2<kMicroRows>(x + r * ldx, ldx, w, kc, acc + r * width + v * 16, width);
    const float* xr = x + r * ldx;
    float* ar = acc + r * width + v * 16;
    switch (mc - r) {
      case 5: micro_f32_avx2<5>(xr, ldx, w, kc, ar, width); break;
      case 4: micro_f32_avx2<4>(xr, ldx, w, kc, ar, width); break;
      case 3: micro_f32_avx2<3>(xr, ldx, w, kc, ar, width); break;
      case 2: micro_f32_avx2<2>(xr, ldx, w, kc, ar, width); break;
      case 1: micro_f32_avx2<1>(xr, ldx, w, kc, ar, width); break;
      default: break;
    }
  }
}
