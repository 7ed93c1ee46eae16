// The AVX2 + FMA micro-kernels of wide_linear.cpp's packed path: 16-bit weights stored at
// load in the layout they are read in, [ceil(N / 16)][K][16] (one strip of 16 output channels
// per 16 * K weights, the 16 channels of each k contiguous; channels past N are zeros), and
// widened to float32 in registers as they are loaded (bf16: a shift; fp16: F16C).
//
// Why: the panels before this widened each 64-channel x 256-K block of an [N, K] weight into a
// float32 buffer with 8 x 8 transposes on every call (~0.75 uops and a 4-byte store per
// weight), which is why they lost under 24 rows. Packed at load, a strip chunk is read as it
// lies: 2 loads + 2 widenings per 16 weights per micro-kernel pass, no stores.
//
// Each output is one FMA chain along k, in k order, starting from 0, whatever the tile shape
// (MR rows x NV strips), the row's place in it, the number of rows or the thread: the
// accumulators go through memory exactly between K chunks. So a row's result is the same bits
// whatever the batch (batch-invariant mode takes this path for every row count).
//
// Include it inside the including file's anonymous namespace, after load8 (wide_linear.cpp),
// <immintrin.h>, <algorithm> and <cstdint>.
#pragma once

#include <type_traits>

// A strip's 16 weights of one k as two float32 vectors. bf16: one 32-byte load and two
// unpacks with zeros (a bf16 is the top half of its float32), 2 shuffle-port uops per 16
// weights instead of the 2 widening loads + 2 shifts of load8; unpack works within 128-bit
// lanes, so w0 holds channels 0-3 and 8-11, w1 channels 4-7 and 12-15 (kPermuted), and the
// accumulators are permuted to match where they meet memory (KV_PK_LOAD / KV_PK_STORE).
// fp16 (F16C) and float32: channels 0-7 and 8-15.
template <typename W>
inline constexpr bool kPermuted = std::is_same_v<W, c10::BFloat16>;

template <typename W>
inline void load16_packed(const W* p, __m256& w0, __m256& w1) {
  if constexpr (kPermuted<W>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
    w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
  } else {
    w0 = load8(p);
    w1 = load8(p + 8);
  }
}

// The accumulators of an MR x NV tile (MR <= 6 rows, NV <= 4 strips, MR * NV <= 6: at most
// 12 of the 16 registers, beside 2 weights and a broadcast x).
// Named, not arrays, as in f32_micro_avx2.h (gcc kept arrays of __m256 on the stack); all 24
// (row, strip) names exist, those outside the MR x NV tile are never used (and compiled away).
#define KV_PK_TILE(X) \
  X(0, 0) X(1, 0) X(2, 0) X(3, 0) X(4, 0) X(5, 0) X(0, 1) X(1, 1) X(2, 1) X(3, 1) X(4, 1) \
  X(5, 1) X(0, 2) X(1, 2) X(2, 2) X(3, 2) X(4, 2) X(5, 2) X(0, 3) X(1, 3) X(2, 3) X(3, 3) \
  X(4, 3) X(5, 3)
#define KV_PK_ON(r, v) (MR > r && NV > v)
#define KV_PK_LOAD(r, v)                                                         \
  __m256 lo##r##_##v = _mm256_setzero_ps(), hi##r##_##v = lo##r##_##v;                  \
  if constexpr (KV_PK_ON(r, v)) {                                                \
    lo##r##_##v = _mm256_loadu_ps(acc + r * lda + v * 16);                       \
    hi##r##_##v = _mm256_loadu_ps(acc + r * lda + v * 16 + 8);                   \
    if constexpr (kPermuted<W>) { /* to channels 0-3, 8-11 | 4-7, 12-15 */       \
      const __m256 a = lo##r##_##v;                                              \
      lo##r##_##v = _mm256_permute2f128_ps(a, hi##r##_##v, 0x20);                \
      hi##r##_##v = _mm256_permute2f128_ps(a, hi##r##_##v, 0x31);                \
    }                                                                            \
  }
#define KV_PK_FMA(r, v)                                               \
  if constexpr (KV_PK_ON(r, v)) {                                     \
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);          \
    lo##r##_##v = _mm256_fmadd_ps(xv, w0, lo##r##_##v);               \
    hi##r##_##v = _mm256_fmadd_ps(xv, w1, hi##r##_##v);               \
  }
#define KV_PK_STRIP(v)                                             \
  if constexpr (NV > v) {                                          \
    __m256 w0, w1;                                                 \
    load16_packed(w + v * ldw + kk * 16, w0, w1);                  \
    KV_PK_FMA(0, v) KV_PK_FMA(1, v) KV_PK_FMA(2, v) KV_PK_FMA(3, v) \
    KV_PK_FMA(4, v) KV_PK_FMA(5, v)                                \
  }
#define KV_PK_STORE(r, v)                                                        \
  if constexpr (KV_PK_ON(r, v)) {                                                \
    __m256 a = lo##r##_##v, b = hi##r##_##v;                                     \
    if constexpr (kPermuted<W>) { /* back to channels 0-7 | 8-15 */              \
      a = _mm256_permute2f128_ps(lo##r##_##v, hi##r##_##v, 0x20);                \
      b = _mm256_permute2f128_ps(lo##r##_##v, hi##r##_##v, 0x31);                \
    }                                                                            \
    _mm256_storeu_ps(acc + r * lda + v * 16, a);                                 \
    _mm256_storeu_ps(acc + r * lda + v * 16 + 8, b);                             \
  }

// acc[r][v * 16 + j] (row stride lda) += sum over kk < kc of x[r][kk] * w[v][kk][j] for
// r < MR, v < NV: w points at strip 0's chunk, strips ldw weights apart. With prefetch, the
// first pass over a chunk asks for the same strips' next chunk (kc * 16 weights on) into L2,
// one 64-byte line per kPrefetchStep k (see rows_packed for why and when).
template <typename W>
inline constexpr int64_t kPrefetchStep = 64 / (16 * static_cast<int64_t>(sizeof(W)));

template <int MR, int NV, typename W>
void micro_packed(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t kc,
                  float* acc, int64_t lda, bool prefetch) {
  static_assert(MR >= 1 && NV >= 1 && MR * NV <= 6 && MR <= 6 && NV <= 4);
  KV_PK_TILE(KV_PK_LOAD)
  if (prefetch) {  // two loops: the other passes' loop stays as it was, without the test
    const W* ahead = w + kc * 16;  // past the last chunk: the next strip's first (harmless)
    for (int64_t kk = 0; kk < kc; ++kk) {
      if (kk % kPrefetchStep<W> == 0) {
        for (int v = 0; v < NV; ++v)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + v * ldw + kk * 16), _MM_HINT_T1);
      }
      KV_PK_STRIP(0) KV_PK_STRIP(1) KV_PK_STRIP(2) KV_PK_STRIP(3)
    }
  } else {
    for (int64_t kk = 0; kk < kc; ++kk) {
      KV_PK_STRIP(0) KV_PK_STRIP(1) KV_PK_STRIP(2) KV_PK_STRIP(3)
    }
  }
  KV_PK_TILE(KV_PK_STORE)
}
#undef KV_PK_TILE
#undef KV_PK_ON
#undef KV_PK_LOAD
#undef KV_PK_FMA
#undef KV_PK_STRIP
#undef KV_PK_STORE

// MR rows over strips [0, nv) of a chunk, NV strips per tile and the rest one at a time.
template <int MR, int NV, typename W>
void tile_strips(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t kc, int64_t nv,
                 float* acc, int64_t lda, bool prefetch) {
  int64_t v = 0;
  for (; v + NV <= nv; v += NV)
    micro_packed<MR, NV>(x, ldx, w + v * ldw, ldw, kc, acc + v * 16, lda, prefetch);
  for (; v < nv; ++v)
    micro_packed<MR, 1>(x, ldx, w + v * ldw, ldw, kc, acc + v * 16, lda, prefetch);
}

// Rows from which the first pass over a chunk prefetches the next one. A panel reads its
// strips' chunks as 8 KB runs 32-64 KB apart, which the hardware prefetchers pick up late
// (each new 4 KB page starts a stream again). A standalone copy of this path over
// TinyLlama-1.1B's 22 layers + LM head (distinct bf16 weights, 2 threads, Zen 3 kind,
// medians of 5-7 alternating rounds; ms without / with the L2 prefetches): 4 rows 125 / 84,
// 8 rows 222 / 144, 16 rows 360 / 300, 24 rows 478 / 363, 32 rows 536 / 488, 64 rows
// 1026 / 967, 96 rows 1425 / 1339. At 1 row the stream is the whole cost and the hardware
// keeps up (80 / 85 ms): no prefetches there. (Into L1 instead: 32 rows 523 ms, 1 row 108;
// the lines push the x rows out.)
constexpr int64_t kPrefetchRows = 2;

// acc[mc][nv * 16] += x[mc][kc] . the chunk of nv strips at w (ldw apart). Six rows at a time
// on one strip (12 accumulators; the strip's chunk stays in L1 across the row groups), the
// last 1-5 rows on as many strips as keep 8-12 accumulators busy (FMA latency x 2 pipes).
// The first pass over each strip's chunk prefetches its next chunk (from kPrefetchRows rows).
template <typename W>
void rows_packed(const float* x, int64_t ldx, int64_t mc, const W* w, int64_t ldw, int64_t kc,
                 int64_t nv, float* acc) {
  const int64_t width = nv * 16, full = mc - mc % 6;
  const bool prefetch = mc >= kPrefetchRows;
  for (int64_t v = 0; v < nv; ++v) {
    for (int64_t r = 0; r < full; r += 6)
      micro_packed<6, 1>(x + r * ldx, ldx, w + v * ldw, ldw, kc, acc + r * width + v * 16,
                         width, prefetch && r == 0);
  }
  const float* xr = x + full * ldx;
  float* ar = acc + full * width;
  const bool first = prefetch && full == 0;  // the remainder's pass is the only one
  switch (mc - full) {
    case 5: tile_strips<5, 1>(xr, ldx, w, ldw, kc, nv, ar, width, first); break;
    case 4: tile_strips<4, 1>(xr, ldx, w, ldw, kc, nv, ar, width, first); break;
    case 3: tile_strips<3, 2>(xr, ldx, w, ldw, kc, nv, ar, width, first); break;
    case 2: tile_strips<2, 2>(xr, ldx, w, ldw, kc, nv, ar, width, first); break;
    case 1: tile_strips<1, 4>(xr, ldx, w, ldw, kc, nv, ar, width, first); break;
    default: break;
  }
}
