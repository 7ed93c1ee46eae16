// AVX2 + FMA float32 paths of quant_linear.cpp (8-wide vectors; AMD Zen 1-3, Intel Haswell
// on, and every AVX-512 CPU too). Included by quant_linear.cpp inside its anonymous namespace,
// after QuantArgs; same codes layout (pack_codes), same reference (reference_linear).
//
// Two paths, as the bf16 ones:
// * direct (one row, decode): no dequantized buffer; the codes are widened in registers and
//   multiplied by the float32 activations, the scale applied once per group:
//     sum_k (c_k * s + z) x_k = s * sum_k c_k x_k + z' * sum_k x_k,  z' = z - o * s
//   for int4's stored nibbles c_k + o. 64 output channels at a time (8 accumulators), so each
//   broadcast of x feeds 16 FMAs and the codes are read once, sequentially per 16 channels.
// * tiles (batches): each 64-channel x 256-K chunk is dequantized once, exactly as the
//   reference does (float(c) * s, then + z, in float32), into a 64 KB buffer laid out per 16
//   channels ([4][256][16] floats: each block's slice contiguous, 16 KB, so it stays in L1
//   while 6 rows at a time read it with FMAs).
// The sums use FMA (one rounding per product and add) in another order than F.linear: the
// float32 tests' tolerance (a few ulps of the largest partial sum) covers both.
#pragma once

// 16 float32 scales (or zeros) of group grp, channels n..n+15, as two 8-wide vectors.
inline void load16_avx2(const QuantArgs& a, const void* p, int64_t grp, int64_t n, __m256& v0,
                        __m256& v1) {
  const int64_t i = grp * a.n + n;
  if (a.half_scales) {
    const auto* h = reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(p) + i);
    v0 = _mm256_cvtph_ps(_mm_loadu_si128(h));
    v1 = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
  } else {
    const float* f = static_cast<const float*>(p) + i;
    v0 = _mm256_loadu_ps(f);
    v1 = _mm256_loadu_ps(f + 8);
  }
}

inline __m256i widen8(const void* p) {  // 8 signed bytes -> 8 int32
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}

inline __m256i widen8u(const void* p) {  // 8 unsigned bytes -> 8 int32
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}

// Pair p of block b as int32: lo (k = 2p) and hi (k = 2p + 1), channels 0-7 and 8-15 each.
// int4 gives the stored nibbles (code + offset); TABLE int4 the values the nibbles index in
// `table` (16 int8, one pshufb per 16 codes: the byte codes' values, so the same sums).
template <int BITS, bool TABLE = false>
inline void codes_i32(const void* codes, int64_t pairs, int64_t b, int64_t p, __m256i lo[2],
                      __m256i hi[2], __m128i table = _mm_setzero_si128()) {
  if constexpr (BITS == 8) {
    const int8_t* c = static_cast<const int8_t*>(codes) + (b * pairs + p) * 32;
    lo[0] = widen8(c);
    lo[1] = widen8(c + 8);
    hi[0] = widen8(c + 16);
    hi[1] = widen8(c + 24);
  } else if constexpr (TABLE) {
    const uint8_t* c = static_cast<const uint8_t*>(codes) + (b * pairs + p) * 16;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    const __m128i low4 = _mm_set1_epi8(15);
    const __m128i l8 = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));  // 16 values
    const __m128i h8 = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    lo[0] = _mm256_cvtepi8_epi32(l8);
    lo[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(l8, 8));
    hi[0] = _mm256_cvtepi8_epi32(h8);
    hi[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(h8, 8));
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(codes) + (b * pairs + p) * 16;
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i b0 = widen8u(c), b1 = widen8u(c + 8);
    lo[0] = _mm256_and_si256(b0, low4);
    lo[1] = _mm256_and_si256(b1, low4);
    hi[0] = _mm256_srli_epi32(b0, 4);
    hi[1] = _mm256_srli_epi32(b1, 4);
  }
}

// The 16 table values as pshufb's lookup bytes (zeros without a table).
inline __m128i table_bytes(const QuantArgs& a) {
  return a.table ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.table))
                 : _mm_setzero_si128();
}

// ---- direct: out[nv * 16] = x[K] . W[b0 * 16 .. (b0 + nv) * 16, :]^T for one row.
template <int BITS, bool TABLE, int NV>
void direct_row_avx2(const QuantArgs& a, const float* x, const float* xsum, int64_t b0,
                     float* out) {
  const int64_t pairs = a.k / 2, gp = a.group / 2, ngroups = a.k / a.group;
  const __m128i table = table_bytes(a);
  const bool shift = a.zeros != nullptr || (BITS == 4 && a.offset != 0);
  const __m256 offset = _mm256_set1_ps(static_cast<float>(a.offset));
  __m256 total[2 * NV];
  for (int i = 0; i < 2 * NV; ++i) total[i] = _mm256_setzero_ps();
  for (int64_t grp = 0; grp < ngroups; ++grp) {
    __m256 part[2 * NV];
    for (int i = 0; i < 2 * NV; ++i) part[i] = _mm256_setzero_ps();
    for (int64_t p = grp * gp; p < (grp + 1) * gp; ++p) {
      const __m256 x0 = _mm256_broadcast_ss(x + 2 * p);
      const __m256 x1 = _mm256_broadcast_ss(x + 2 * p + 1);
      for (int v = 0; v < NV; ++v) {
        __m256i lo[2], hi[2];
        codes_i32<BITS, TABLE>(a.codes, pairs, b0 + v, p, lo, hi, table);
        for (int h = 0; h < 2; ++h) {
          part[2 * v + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[h]), x0, part[2 * v + h]);
          part[2 * v + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[h]), x1, part[2 * v + h]);
        }
      }
    }
    const __m256 xs = _mm256_set1_ps(xsum[grp]);
    for (int v = 0; v < NV; ++v) {
      __m256 s[2], z[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      load16_avx2(a, a.scales, grp, (b0 + v) * 16, s[0], s[1]);
      if (a.zeros) load16_avx2(a, a.zeros, grp, (b0 + v) * 16, z[0], z[1]);
      for (int h = 0; h < 2; ++h) {
        total[2 * v + h] = _mm256_fmadd_ps(part[2 * v + h], s[h], total[2 * v + h]);
        if (shift) {
          const __m256 zs = BITS == 4 ? _mm256_fnmadd_ps(offset, s[h], z[h]) : z[h];
          total[2 * v + h] = _mm256_fmadd_ps(zs, xs, total[2 * v + h]);
        }
      }
    }
  }
  for (int i = 0; i < 2 * NV; ++i) _mm256_storeu_ps(out + 8 * i, total[i]);
}

template <int BITS, bool TABLE>
void direct_tile_avx2(const QuantArgs& a, const float* x, const float* xsum, int64_t b0,
                      int64_t nv, float* out) {
  switch (nv) {
    case 4: direct_row_avx2<BITS, TABLE, 4>(a, x, xsum, b0, out); break;
    case 3: direct_row_avx2<BITS, TABLE, 3>(a, x, xsum, b0, out); break;
    case 2: direct_row_avx2<BITS, TABLE, 2>(a, x, xsum, b0, out); break;
    default: direct_row_avx2<BITS, TABLE, 1>(a, x, xsum, b0, out); break;
  }
}

// x [m, K] float32 -> out [m, N]: each 64-channel tile row by row (the tile's codes stay in
// L2 for the next rows), tiles split over threads.
void run_direct_avx2(const QuantArgs& a, const float* x, int64_t m, float* out) {
  const int64_t ngroups = a.k / a.group;
  std::vector<float> xsum(m * ngroups, 0.0f);  // [m, K / g]
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < a.k; ++i) xsum[r * ngroups + i / a.group] += x[r * a.k + i];
  const int64_t blocks = a.n / 16;
  const int64_t tiles = (blocks + kTileVecs - 1) / kTileVecs;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 64 * a.k));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kTileVecs, nv = std::min(kTileVecs, blocks - b0);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * a.k;
        const float* sr = xsum.data() + r * ngroups;
        float* o = out + r * a.n + b0 * 16;
        if (a.bits == 8) {
          direct_tile_avx2<8, false>(a, xr, sr, b0, nv, o);
        } else if (a.table) {
          direct_tile_avx2<4, true>(a, xr, sr, b0, nv, o);
        } else {
          direct_tile_avx2<4, false>(a, xr, sr, b0, nv, o);
        }
      }
    }
  });
}

// ---- tiles: dequantize pairs p0..p0+np of blocks b0..b0+nv into buf [nv][2 * np][16].
template <int BITS, bool TABLE>
void dequant_f32_avx2(const QuantArgs& a, int64_t b0, int64_t nv, int64_t p0, int64_t np,
                      float* buf) {
  const int64_t pairs = a.k / 2;
  const __m128i table = table_bytes(a);
  const __m256i offset = _mm256_set1_epi32(static_cast<int>(a.offset));
  for (int64_t v = 0; v < nv; ++v) {
    float* dst = buf + v * (2 * np) * 16;
    __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, z[2] = {s[0], s[1]};
    int64_t cur = -1;
    for (int64_t p = p0; p < p0 + np; ++p, dst += 32) {
      const int64_t grp = (2 * p) / a.group;
      if (grp != cur) {
        load16_avx2(a, a.scales, grp, (b0 + v) * 16, s[0], s[1]);
        z[0] = z[1] = _mm256_setzero_ps();
        if (a.zeros) load16_avx2(a, a.zeros, grp, (b0 + v) * 16, z[0], z[1]);
        cur = grp;
      }
      __m256i lo[2], hi[2];
      codes_i32<BITS, TABLE>(a.codes, pairs, b0 + v, p, lo, hi, table);
      for (int h = 0; h < 2; ++h) {
        if constexpr (BITS == 4 && !TABLE) {  // the code itself, as the reference has it
          lo[h] = _mm256_sub_epi32(lo[h], offset);
          hi[h] = _mm256_sub_epi32(hi[h], offset);
        }
        // mul, then add: rounds as the reference's codes * scales + zeros does
        _mm256_storeu_ps(dst + 8 * h,
                         _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo[h]), s[h]), z[h]));
        _mm256_storeu_ps(dst + 16 + 8 * h,
                         _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi[h]), s[h]), z[h]));
      }
    }
  }
}

#include "f32_micro_avx2.h"  // micro_f32_avx2, rows_f32_avx2

template <int BITS, bool TABLE>
void tile_f32_avx2(const QuantArgs& a, const float* x, int64_t m, float* out, int64_t b0,
                   int64_t nv, float* acc, float* buf) {
  const int64_t width = nv * 16, pairs = a.k / 2;
  for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, m - m0);
    std::fill(acc, acc + mc * width, 0.0f);
    for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
      const int64_t np = std::min(kChunkPairs, pairs - p0);
      dequant_f32_avx2<BITS, TABLE>(a, b0, nv, p0, np, buf);
      rows_f32_avx2(x + m0 * a.k + 2 * p0, a.k, mc, buf, 2 * np, nv, acc);
    }
    for (int64_t r = 0; r < mc; ++r)
      std::copy(acc + r * width, acc + (r + 1) * width, out + (m0 + r) * a.n + b0 * 16);
  }
}

// x [m, K] float32 -> out [m, N] through dequantized chunks, tiles split over threads.
void run_tiles_avx2(const QuantArgs& a, const float* x, int64_t m, float* out) {
  const int64_t blocks = a.n / 16;
  const int64_t tiles = (blocks + kTileVecs - 1) / kTileVecs;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 64 * a.k));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kRowChunk * kTileVecs * 16);
    std::vector<float> buf(kTileVecs * 2 * kChunkPairs * 16);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kTileVecs, nv = std::min(kTileVecs, blocks - b0);
      if (a.bits == 8) {
        tile_f32_avx2<8, false>(a, x, m, out, b0, nv, acc.data(), buf.data());
      } else if (a.table) {
        tile_f32_avx2<4, true>(a, x, m, out, b0, nv, acc.data(), buf.data());
      } else {
        tile_f32_avx2<4, false>(a, x, m, out, b0, nv, acc.data(), buf.data());
      }
    }
  });
}
