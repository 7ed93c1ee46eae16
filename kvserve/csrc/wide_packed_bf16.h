// The AVX512-BF16 micro-kernels of wide_linear.cpp's packed path for bf16 activations: the
// same packed weights as the AVX2 float32 path ([ceil(N / 16)][K][16] bf16, strips of 16
// output channels, the 16 channels of each k contiguous), multiplied by `vdpbf16ps`, which
// sums the products of bf16 pairs into float32 lanes.
//
// Why: on CPUs with AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake on) a bf16 model's linears
// went to oneDNN's prepacked kernel, whose one-row path streamed the weights at 27-28 GB/s
// of a 52.7 GB/s VM (TinyLlama-1.1B shape, AMD EPYC Zen 5 kind, docs/performance.md "The
// AVX512-BF16 kind again"), and one row cost what eight did. Reading the packed layout
// directly, one 64-byte load per 32 weights, lets decode run at the memory's pace.
//
// vdpbf16ps wants the two bf16 of each float32 lane to be consecutive k of one channel. A
// 64-byte load of the layout holds k and k + 1 for 16 channels ([k][16] then [k+1][16]); one
// vpermw interleaves them into 16 (k, k+1) pairs. The x pair (x[r][k], x[r][k+1]) is one
// 32-bit broadcast. The weights need no second layout: the AVX2 float32 path and the MoE
// experts read the same tensor.
//
// Each output is one chain along k, pair by pair in k order, from 0 (vdpbf16ps adds the
// pair's two products, exact in float32, to the lane, rounding to nearest even, bf16 inputs
// and float32 outputs denormals flushed to zero), whatever the tile shape, the row's place in
// it, the number of rows or the thread: the accumulators go through memory exactly between K
// chunks. A row's result is therefore the same bits whatever the batch (batch-invariant mode
// takes it at every row count). An odd K's last k pairs with a zero.
//
// Include it inside the including file's anonymous namespace, after <immintrin.h>,
// <algorithm>, <cstdint> and <cstring>, where __AVX512BF16__ is defined.
#pragma once

// vpermw's index: lane j of the result takes (k, channel j) then (k + 1, channel j).
inline __m512i bf16_pair_index() {
  alignas(64) static const uint16_t idx[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(idx);
}

// The pair (x[k], x[k + 1]) (or (x[k], 0) for the last k of an odd K) in every lane.
inline __m512bh bf16_x_pair(const c10::BFloat16* x, bool single) {
  uint32_t bits = 0;
  std::memcpy(&bits, x, single ? 2 : 4);  // little-endian: x[k] in the low half
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(bits));
}

// acc[r][v * 16 + j] (row stride lda) += sum over kk < kc of x[r][kk] * w[v][kk][j] for
// r < MR, v < NV: w points at strip 0's chunk, strips ldw weights apart. MR * NV accumulators
// (at most 24 of the 32 registers, beside NV weights, the index and a broadcast x). Plain
// arrays: gcc keeps these in registers once the loops over r and v unroll (checked on the
// generated code: no stack traffic in the k loop).
template <int MR, int NV>
void micro_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw,
                int64_t kc, float* acc, int64_t lda) {
  static_assert(MR >= 1 && NV >= 1 && MR * NV <= 24 && NV <= 4);
  __m512 a[MR][NV];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(acc + r * lda + v * 16);
  const __m512i idx = bf16_pair_index();
  const int64_t pairs = kc - kc % 2;
  for (int64_t kk = 0; kk < pairs; kk += 2) {
    __m512bh wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      wv[v] = (__m512bh)_mm512_permutexvar_epi16(idx,
                                                 _mm512_loadu_si512(w + v * ldw + kk * 16));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = bf16_x_pair(x + r * ldx + kk, false);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], xb, wv[v]);
    }
  }
  if (pairs < kc) {  // an odd K's last k: (w, 0) pairs against (x, 0)
    __m512bh wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      wv[v] = (__m512bh)_mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * ldw + pairs * 16)));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = bf16_x_pair(x + r * ldx + pairs, true);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], xb, wv[v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * lda + v * 16, a[r][v]);
}

// MR rows over strips [0, nv) of a chunk: NV strips per tile, the rest one at a time.
template <int MR>
void tile_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw,
               int64_t kc, int64_t nv, float* acc, int64_t lda) {
  int64_t v = 0;
  for (; v + 4 <= nv; v += 4) micro_bf16<MR, 4>(x, ldx, w + v * ldw, ldw, kc, acc + v * 16, lda);
  for (; v < nv; ++v) micro_bf16<MR, 1>(x, ldx, w + v * ldw, ldw, kc, acc + v * 16, lda);
}

// acc[mc][nv * 16] += x[mc][kc] . the chunk of nv strips at w (ldw apart): six rows at a time
// over the panel's strips (24 accumulators; the chunk, 32 KB at 4 strips x 256 k, stays in L1
// across the row groups), then the last 1-5 rows.
inline void rows_bf16(const c10::BFloat16* x, int64_t ldx, int64_t mc, const c10::BFloat16* w,
                      int64_t ldw, int64_t kc, int64_t nv, float* acc) {
  const int64_t width = nv * 16, full = mc - mc % 6;
  for (int64_t r = 0; r < full; r += 6) tile_bf16<6>(x + r * ldx, ldx, w, ldw, kc, nv,
                                                     acc + r * width, width);
  const c10::BFloat16* xr = x + full * ldx;
  float* ar = acc + full * width;
  switch (mc - full) {
    case 5: tile_bf16<5>(xr, ldx, w, ldw, kc, nv, ar, width); break;
    case 4: tile_bf16<4>(xr, ldx, w, ldw, kc, nv, ar, width); break;
    case 3: tile_bf16<3>(xr, ldx, w, ldw, kc, nv, ar, width); break;
    case 2: tile_bf16<2>(xr, ldx, w, ldw, kc, nv, ar, width); break;
    case 1: tile_bf16<1>(xr, ldx, w, ldw, kc, nv, ar, width); break;
    default: break;
  }
}

// The panels [p0, p1) (np strips each, np <= 4) of every row: y[m][n] bf16 = the float32 sums
// plus bias (float32, or null), rounded once. K in chunks of kc_max (a multiple of 2, so the
// chunks' pairs are K's pairs).
inline void panels_bf16(const c10::BFloat16* x, int64_t m, const c10::BFloat16* wp, int64_t k,
                        const float* bias, c10::BFloat16* y, int64_t n, int64_t p0, int64_t p1,
                        int64_t np, int64_t kc_max) {
  const int64_t strips = (n + 15) / 16, ldw = k * 16;
  std::vector<float> acc(m * np * 16);  // [m][width]
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t s0 = p * np, nv = std::min(np, strips - s0), width = nv * 16;
    std::fill(acc.begin(), acc.begin() + m * width, 0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
      rows_bf16(x + k0, k, m, wp + s0 * ldw + k0 * 16, ldw, std::min(kc_max, k - k0), nv,
                acc.data());
    }
    const int64_t c0 = s0 * 16, cols = std::min(width, n - c0);
    for (int64_t r = 0; r < m; ++r) {
      const float* a = acc.data() + r * width;
      c10::BFloat16* yr = y + r * n + c0;
      for (int64_t c = 0; c < cols; ++c) yr[c] = c10::BFloat16(bias ? a[c] + bias[c0 + c] : a[c]);
    }
  }
}
