// Weight-only quantized linear layer: y[M, N] = x[M, K] @ W[N, K]^T with W stored as int8 or
// packed int4 codes plus a float scale (and optionally a float zero) per group of g weights
// along K: W[n, k] = code[n, k] * scale[k / g, n] + zero[k / g, n]. Activations stay bf16 or
// float32. The pure-PyTorch reference is kvserve.quantization.qlinear.reference_linear
// (dequantize, then F.linear); tests hold this kernel to it.
//
// Why a kernel of our own: PyTorch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu are
// fast for one row but slow for batches (measured, AMD EPYC Zen 5, 2 threads, N=11264,
// K=2048: at 64 rows int8 11.1 ms and int4 9.1 ms against 3.6 ms for prepacked bf16), and
// int8pack has no groups (GGUF Q8_0 has a scale per 32 weights). Here each tile of 64 output
// channels is dequantized once per chunk of K into a small bf16 buffer (L1-resident) that all
// rows of the batch then read with AVX512-BF16 dot products (vdpbf16ps, the instruction
// oneDNN's bf16 GEMM uses on CPUs without AMX), so a batch costs what a bf16 GEMM costs while
// the weights stream from memory at 1 or 0.5 byte each. float32 activations (and bf16 ones on
// CPUs without AVX512-BF16, widened) take the AVX2 + FMA paths of quant_linear_avx2.h, the
// same two schemes on 8-wide float32 vectors; the plain loops below only where there is no
// AVX2 (measured on AMD EPYC Zen 3, 1 thread, N=5632 K=2048: one row int8 g32 18.7 -> 1.6 ms,
// 64 rows 83 -> 29 ms; docs/performance.md, "AVX2 quantized kernels").
//
// Layout (built by kvserve.quantization.qlinear.pack_codes): weights in blocks of 16 output
// channels, K in pairs (k, k + 1) (the pairs vdpbf16ps multiplies together):
//   int8: [N / 16][K / 2][2][16] int8: for block b and pair p, 16 bytes of W[16b + j, 2p], then
//         16 bytes of W[16b + j, 2p + 1];
//   int4: [N / 16][K / 2][16] uint8: byte j = (c[16b+j, 2p] + o) | (c[16b+j, 2p+1] + o) << 4,
//         o = 8 for codes in [-8, 7], 0 for codes in [0, 15] (with a zero point).
//   table (offset kTableOffset): int4's layout of 4-bit indices i, W's code being table[i],
//         then kTableBytes whose first 16 are the table (int8; qlinear.pack_kernel_codes).
//         For 8-bit codes of at most 16 values (MXFP4, IQ4_NL, IQ4_XS): 4 bits a weight streamed
//         instead of 8, the same values looked up in registers (pshufb / vpermd), so the
//         outputs are the byte codes' bit for bit.
// scales / zeros: [K / g, N] float32 or float16 (zeros may be empty: zero 0). g is even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_QL_AVX2 1  // the float32 paths of quant_linear_avx2.h
#endif

namespace {

constexpr int64_t kTileVecs = 4;    // 16-channel vectors per tile: 64 output channels
constexpr int64_t kChunkPairs = 128;  // K pairs dequantized at once: 256 values of K
constexpr int64_t kRowChunk = 64;   // batch rows that share one dequantized chunk
constexpr int64_t kTableOffset = -1;  // the op's offset for table codes (qlinear.TABLE_OFFSET)
constexpr int64_t kTableBytes = 64;   // the table's trailer after the codes (16 bytes used)

struct QuantArgs {
  const void* codes;
  const void* scales;
  const void* zeros;  // nullptr: no zeros
  bool half_scales;   // scales/zeros are float16 (else float32)
  int64_t bits;       // 8 or 4
  int64_t group;      // g, even, divides K
  int64_t n;          // N
  int64_t k;          // K
  int64_t offset;     // int4: the stored nibble is code + offset (8 or 0; 0 with a table)
  const int8_t* table;  // nullptr, or the 16 values int4 nibbles index (the codes' trailer)
};

inline float scale_at(const QuantArgs& a, const void* p, int64_t grp, int64_t n) {
  int64_t i = grp * a.n + n;
  return a.half_scales ? static_cast<float>(static_cast<const c10::Half*>(p)[i])
                       : static_cast<const float*>(p)[i];
}

// The two codes of pair p for channel j of block b (int4 codes are stored + offset).
inline void codes_at(const QuantArgs& a, int64_t b, int64_t p, int64_t j, int& lo, int& hi) {
  int64_t pairs = a.k / 2;
  if (a.bits == 8) {
    const int8_t* c = static_cast<const int8_t*>(a.codes) + (b * pairs + p) * 32;
    lo = c[j];
    hi = c[16 + j];
  } else {
    uint8_t c = static_cast<const uint8_t*>(a.codes)[(b * pairs + p) * 16 + j];
    if (a.table) {
      lo = a.table[c & 15];
      hi = a.table[c >> 4];
      return;
    }
    lo = static_cast<int>(c & 15) - static_cast<int>(a.offset);
    hi = static_cast<int>(c >> 4) - static_cast<int>(a.offset);
  }
}

// ---- float32 path (CPUs without AVX2; quant_linear_avx2.h elsewhere): dequantize a chunk to float [2 * np][nv * 16], then FMA rows.
[[maybe_unused]] void dequant_f32(const QuantArgs& a, int64_t b0, int64_t nv, int64_t p0,
                                  int64_t np, float* buf) {
  const int64_t width = nv * 16;
  for (int64_t p = p0; p < p0 + np; ++p) {
    int64_t grp = (2 * p) / a.group;
    float* row0 = buf + (2 * (p - p0)) * width;
    float* row1 = row0 + width;
    for (int64_t v = 0; v < nv; ++v) {
      for (int64_t j = 0; j < 16; ++j) {
        int64_t n = (b0 + v) * 16 + j;
        float s = scale_at(a, a.scales, grp, n);
        float z = a.zeros ? scale_at(a, a.zeros, grp, n) : 0.0f;
        int lo, hi;
        codes_at(a, b0 + v, p, j, lo, hi);
        // mul, then add: rounds as the reference's codes * scales + zeros does
        row0[v * 16 + j] = static_cast<float>(lo) * s + z;
        row1[v * 16 + j] = static_cast<float>(hi) * s + z;
      }
    }
  }
}

[[maybe_unused]] void rows_f32(const float* x, int64_t ldx, int64_t mc, const float* buf,
                               int64_t kc, int64_t width, float* acc) {
  for (int64_t r = 0; r < mc; ++r) {
    float* out = acc + r * width;
    const float* xr = x + r * ldx;
    for (int64_t kk = 0; kk < kc; ++kk) {
      float xv = xr[kk];
      const float* w = buf + kk * width;
      for (int64_t c = 0; c < width; ++c) out[c] += xv * w[c];
    }
  }
}

#if defined(KVSERVE_QL_AVX2)
#include "quant_linear_avx2.h"
#endif

#if defined(__AVX512BF16__)
// ---- bf16 path: dequantize a chunk to bf16 pairs [np][nv][16 channels x (k, k + 1)].
inline __m512 load_scales(const QuantArgs& a, const void* p, int64_t grp, int64_t n) {
  int64_t i = grp * a.n + n;
  if (a.half_scales) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const c10::Half*>(p) + i)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

// The 16 table values as int32 lanes, vpermd's lookup table (zeros without a table).
inline __m512i table_i32(const QuantArgs& a) {
  return a.table ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.table)))
                 : _mm512_setzero_si512();
}

void dequant_bf16(const QuantArgs& a, int64_t b0, int64_t nv, int64_t p0, int64_t np,
                  __m512bh* buf) {
  const int64_t pairs = a.k / 2;
  // (lo_0, hi_0, lo_1, hi_1, ...): word 2j takes lo_j (word j), word 2j + 1 takes hi_j (16 + j)
  alignas(64) int16_t idx_words[32];
  for (int j = 0; j < 16; ++j) {
    idx_words[2 * j] = static_cast<int16_t>(j);
    idx_words[2 * j + 1] = static_cast<int16_t>(16 + j);
  }
  const __m512i idx = _mm512_load_si512(idx_words);
  const __m512i low4 = _mm512_set1_epi32(15);
  const __m512i offset = _mm512_set1_epi32(static_cast<int>(a.offset));
  const __m512i table = table_i32(a);
  __m512 s[kTileVecs], z[kTileVecs];
  int64_t cur = -1;
  for (int64_t p = p0; p < p0 + np; ++p) {
    int64_t grp = (2 * p) / a.group;
    if (grp != cur) {
      for (int64_t v = 0; v < nv; ++v) {
        s[v] = load_scales(a, a.scales, grp, (b0 + v) * 16);
        z[v] = a.zeros ? load_scales(a, a.zeros, grp, (b0 + v) * 16) : _mm512_setzero_ps();
      }
      cur = grp;
    }
    for (int64_t v = 0; v < nv; ++v) {
      __m512i lo_i, hi_i;
      if (a.bits == 8) {
        const int8_t* c = static_cast<const int8_t*>(a.codes) + ((b0 + v) * pairs + p) * 32;
        lo_i = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
        hi_i = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)));
      } else {
        const uint8_t* c = static_cast<const uint8_t*>(a.codes) + ((b0 + v) * pairs + p) * 16;
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
        lo_i = _mm512_sub_epi32(_mm512_and_si512(bytes, low4), offset);
        hi_i = _mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), offset);
        if (a.table) {  // offset 0: the nibbles index the table
          lo_i = _mm512_permutexvar_epi32(lo_i, table);
          hi_i = _mm512_permutexvar_epi32(hi_i, table);
        }
      }
      __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo_i), s[v]), z[v]);
      __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi_i), s[v]), z[v]);
      __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // [lo | hi]
      buf[(p - p0) * nv + v] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(idx, halves));
    }
  }
}

// acc[MR][NV * 16] += x[MR rows][2 * np] . buf, one vdpbf16ps per (row, vector, pair).
template <int MR, int NV>
void micro_bf16(const c10::BFloat16* x, int64_t ldx, const __m512bh* buf, int64_t np,
                float* acc, int64_t width) {
  __m512 c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = _mm512_loadu_ps(acc + r * width + v * 16);
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  for (int64_t p = 0; p < np; ++p) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = buf[p * NV + v];
    for (int r = 0; r < MR; ++r) {
      __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xr[r][p]));
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], xv, w[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * width + v * 16, c[r][v]);
}

template <int NV>
void rows_bf16_nv(const c10::BFloat16* x, int64_t ldx, int64_t mc, const __m512bh* buf,
                  int64_t np, float* acc) {
  const int64_t width = NV * 16;
  int64_t r = 0;
  for (; r + 4 <= mc; r += 4) micro_bf16<4, NV>(x + r * ldx, ldx, buf, np, acc + r * width, width);
  switch (mc - r) {
    case 3: micro_bf16<3, NV>(x + r * ldx, ldx, buf, np, acc + r * width, width); break;
    case 2: micro_bf16<2, NV>(x + r * ldx, ldx, buf, np, acc + r * width, width); break;
    case 1: micro_bf16<1, NV>(x + r * ldx, ldx, buf, np, acc + r * width, width); break;
    default: break;
  }
}

void rows_bf16(const c10::BFloat16* x, int64_t ldx, int64_t mc, const __m512bh* buf,
               int64_t np, int64_t nv, float* acc) {
  switch (nv) {
    case 4: rows_bf16_nv<4>(x, ldx, mc, buf, np, acc); break;
    case 3: rows_bf16_nv<3>(x, ldx, mc, buf, np, acc); break;
    case 2: rows_bf16_nv<2>(x, ldx, mc, buf, np, acc); break;
    default: rows_bf16_nv<1>(x, ldx, mc, buf, np, acc); break;
  }
}
// ---- few rows (decode at low concurrency): no dequantized buffer. Each group's codes are
// multiplied by the float32 activations as integers, and the scale applied once per group:
// sum_k (c_k * s + z') x_k = s * sum_k c_k x_k + z' * sum_k x_k, with z' = z - offset * s
// for int4's stored nibbles. About 6 vector ops per 32 weights instead of ~15, so a
// one-row product streams at memory speed. The weights are not rounded to bf16 here (the
// batched path rounds them, as the reference does): results differ by that rounding only.
template <int MR, int NV>
void direct_tile(const QuantArgs& a, const float* x, int64_t ldx, const float* xsum,
                 int64_t ngroups, int64_t b0, float* acc /* [MR][NV * 16] */) {
  const int64_t pairs = a.k / 2;
  const int64_t gp = a.group / 2;  // pairs per group
  const __m512i low4 = _mm512_set1_epi32(15);
  const __m512i table = table_i32(a);
  __m512 total[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) total[r][v] = _mm512_setzero_ps();
  for (int64_t grp = 0; grp < ngroups; ++grp) {
    __m512 part[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) part[r][v] = _mm512_setzero_ps();
    for (int64_t p = grp * gp; p < (grp + 1) * gp; ++p) {
      __m512 lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        if (a.bits == 8) {
          const int8_t* c = static_cast<const int8_t*>(a.codes) + ((b0 + v) * pairs + p) * 32;
          lo[v] = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
          hi[v] = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
        } else {
          const uint8_t* c = static_cast<const uint8_t*>(a.codes) + ((b0 + v) * pairs + p) * 16;
          __m512i bytes =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
          __m512i lo_i = _mm512_and_si512(bytes, low4), hi_i = _mm512_srli_epi32(bytes, 4);
          if (a.table) {  // offset 0: the nibbles index the table
            lo_i = _mm512_permutexvar_epi32(lo_i, table);
            hi_i = _mm512_permutexvar_epi32(hi_i, table);
          }
          lo[v] = _mm512_cvtepi32_ps(lo_i);
          hi[v] = _mm512_cvtepi32_ps(hi_i);
        }
      }
      for (int r = 0; r < MR; ++r) {
        __m512 x0 = _mm512_set1_ps(x[r * ldx + 2 * p]);
        __m512 x1 = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
        for (int v = 0; v < NV; ++v) {
          part[r][v] = _mm512_fmadd_ps(lo[v], x0, part[r][v]);
          part[r][v] = _mm512_fmadd_ps(hi[v], x1, part[r][v]);
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      __m512 sv = load_scales(a, a.scales, grp, (b0 + v) * 16);
      __m512 zv = a.zeros ? load_scales(a, a.zeros, grp, (b0 + v) * 16) : _mm512_setzero_ps();
      if (a.bits == 4) zv = _mm512_sub_ps(zv, _mm512_mul_ps(_mm512_set1_ps(a.offset), sv));
      for (int r = 0; r < MR; ++r) {
        total[r][v] = _mm512_fmadd_ps(part[r][v], sv, total[r][v]);
        total[r][v] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xsum[r * ngroups + grp]), total[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * NV * 16 + v * 16, total[r][v]);
}

template <int MR>
void direct_rows(const QuantArgs& a, const float* x, const float* xsum, int64_t ngroups,
                 int64_t b0, int64_t nv, float* acc) {
  switch (nv) {
    case 4: direct_tile<MR, 4>(a, x, a.k, xsum, ngroups, b0, acc); break;
    case 3: direct_tile<MR, 3>(a, x, a.k, xsum, ngroups, b0, acc); break;
    case 2: direct_tile<MR, 2>(a, x, a.k, xsum, ngroups, b0, acc); break;
    default: direct_tile<MR, 1>(a, x, a.k, xsum, ngroups, b0, acc); break;
  }
}

// x [m, K] bf16 -> out [m, N] through direct_tile, tiles split over threads. Used up to
// direct_rows rows (the caller's threshold: kvserve.quantization.qlinear.DIRECT_ROWS).
void run_direct(const QuantArgs& a, const c10::BFloat16* x, int64_t m, c10::BFloat16* out) {
  const int64_t ngroups = a.k / a.group;
  std::vector<float> xf(m * a.k), xsum(m * ngroups, 0.0f);
  for (int64_t i = 0; i < m * a.k; ++i) xf[i] = static_cast<float>(x[i]);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < a.k; ++i) xsum[r * ngroups + i / a.group] += xf[r * a.k + i];
  const int64_t blocks = a.n / 16;
  const int64_t tiles = (blocks + kTileVecs - 1) / kTileVecs;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 64 * a.k));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float acc[4 * kTileVecs * 16];
    for (int64_t t = begin; t < end; ++t) {
      int64_t b0 = t * kTileVecs;
      int64_t nv = std::min(kTileVecs, blocks - b0);
      // Rows four at a time; the tile's codes come from L2 after the first four.
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const float* xr = xf.data() + r0 * a.k;
        const float* sr = xsum.data() + r0 * ngroups;
        int64_t mr = std::min<int64_t>(4, m - r0);
        switch (mr) {
          case 4: direct_rows<4>(a, xr, sr, ngroups, b0, nv, acc); break;
          case 3: direct_rows<3>(a, xr, sr, ngroups, b0, nv, acc); break;
          case 2: direct_rows<2>(a, xr, sr, ngroups, b0, nv, acc); break;
          default: direct_rows<1>(a, xr, sr, ngroups, b0, nv, acc); break;
        }
        for (int64_t r = 0; r < mr; ++r)
          for (int64_t c = 0; c < nv * 16; ++c)
            out[(r0 + r) * a.n + b0 * 16 + c] = static_cast<c10::BFloat16>(acc[r * nv * 16 + c]);
      }
    }
  });
}
#endif

template <typename T>
void write_rows(T* out, int64_t ldo, const float* acc, int64_t mc, int64_t width) {
  for (int64_t r = 0; r < mc; ++r)
    for (int64_t c = 0; c < width; ++c) out[r * ldo + c] = static_cast<T>(acc[r * width + c]);
}

// One tile of 64 (or fewer) output channels for all rows: x [M, K], out [M, N].
// fbuf (float32 path) or vbuf (bf16 path, 64-byte aligned) holds one dequantized chunk.
template <typename T>
void tile(const QuantArgs& a, const T* x, int64_t m, T* out, int64_t b0, int64_t nv,
          float* acc, float* fbuf, void* vbuf) {
  const int64_t width = nv * 16;
  const int64_t pairs = a.k / 2;
  for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
    int64_t mc = std::min(kRowChunk, m - m0);
    std::fill(acc, acc + mc * width, 0.0f);
    for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
      int64_t np = std::min(kChunkPairs, pairs - p0);
      if constexpr (std::is_same_v<T, float>) {
        dequant_f32(a, b0, nv, p0, np, fbuf);
        rows_f32(x + m0 * a.k + 2 * p0, a.k, mc, fbuf, 2 * np, width, acc);
      } else {
#if defined(__AVX512BF16__)
        auto* buf = static_cast<__m512bh*>(vbuf);
        dequant_bf16(a, b0, nv, p0, np, buf);
        rows_bf16(x + m0 * a.k + 2 * p0, a.k, mc, buf, np, nv, acc);
#else
        (void)vbuf;  // never instantiated: quant_linear widens bf16 to float32 there
#endif
      }
    }
    write_rows(out + m0 * a.n + b0 * 16, a.n, acc, mc, width);
  }
}

template <typename T>
void run(const QuantArgs& a, const T* x, int64_t m, T* out) {
  const int64_t blocks = a.n / 16;
  const int64_t tiles = (blocks + kTileVecs - 1) / kTileVecs;
  // Tiles per task: enough that a small layer runs on the calling thread (waking the pool
  // costs more than ~64K weights of work).
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 64 * a.k));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kRowChunk * kTileVecs * 16);
    std::vector<float> fbuf;
    std::vector<uint8_t> raw;
    void* vbuf = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      fbuf.resize(2 * kChunkPairs * kTileVecs * 16);
    } else {
      raw.resize(kChunkPairs * kTileVecs * 64 + 64);  // chunk of 32-bf16 vectors, aligned
      uintptr_t base = reinterpret_cast<uintptr_t>(raw.data());
      vbuf = raw.data() + (64 - base % 64) % 64;
    }
    for (int64_t t = begin; t < end; ++t) {
      int64_t b0 = t * kTileVecs;
      tile(a, x, m, out, b0, std::min(kTileVecs, blocks - b0), acc.data(), fbuf.data(), vbuf);
    }
  });
}

// float32 activations: AVX2 direct (up to direct_rows rows) or tiles; else the plain loops.
void run_f32(const QuantArgs& a, const float* x, int64_t m, float* out, int64_t direct_rows) {
#if defined(KVSERVE_QL_AVX2)
  if (m <= direct_rows) {
    run_direct_avx2(a, x, m, out);
  } else {
    run_tiles_avx2(a, x, m, out);
  }
#else
  (void)direct_rows;
  run<float>(a, x, m, out);
#endif
}

void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes,
                  const at::Tensor& scales, const at::Tensor& zeros, int64_t bits,
                  int64_t group, int64_t offset, int64_t direct_rows) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(),
              "quant_linear: x and out must be contiguous 2-D tensors");
  TORCH_CHECK(bits == 8 || bits == 4, "quant_linear: bits must be 8 or 4");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(out.size(0) == m && out.scalar_type() == x.scalar_type(), "quant_linear: out");
  TORCH_CHECK(n % 16 == 0 && k % 2 == 0 && group % 2 == 0 && k % group == 0,
              "quant_linear: N must be a multiple of 16, and g even and dividing K");
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == k / group && scales.size(1) == n,
              "quant_linear: scales must be [K / g, N]");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scales.scalar_type() == at::kFloat, "quant_linear: scales dtype");
  const bool has_zeros = zeros.numel() > 0;
  if (has_zeros) {
    TORCH_CHECK(zeros.is_contiguous() && zeros.sizes() == scales.sizes() &&
                    zeros.scalar_type() == scales.scalar_type(),
                "quant_linear: zeros must match scales");
  }
  const bool table = offset == kTableOffset;
  TORCH_CHECK(!table || bits == 4, "quant_linear: table codes are 4-bit indices");
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 &&
                  codes.numel() == n * k / (bits == 8 ? 1 : 2) + (table ? kTableBytes : 0),
              "quant_linear: codes do not hold N x K weights", table ? " and a table" : "");
  const auto* table_values =
      table ? static_cast<const int8_t*>(codes.data_ptr()) + n * k / 2 : nullptr;
  QuantArgs a{codes.data_ptr(), scales.data_ptr(), has_zeros ? zeros.data_ptr() : nullptr,
              half, bits, group, n, k, table ? 0 : offset, table_values};
  if (m == 0) return;
  if (x.scalar_type() == at::kFloat) {
    run_f32(a, x.data_ptr<float>(), m, out.data_ptr<float>(), direct_rows);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_linear: x must be float32 or bf16");
#if defined(__AVX512BF16__)
    if (m <= direct_rows) {
      run_direct(a, x.data_ptr<c10::BFloat16>(), m, out.data_ptr<c10::BFloat16>());
      return;
    }
    run<c10::BFloat16>(a, x.data_ptr<c10::BFloat16>(), m, out.data_ptr<c10::BFloat16>());
#else
    // No bf16 dot product (AVX2-only CPUs): widen x to float32, take the float32 path and
    // round the output once, as the direct path does (float32 weights and sums). Dequantizing
    // the whole weight per call and running bf16 F.linear (emulated there) is the other way.
    const at::Tensor xf = x.to(at::kFloat);
    at::Tensor of = at::empty({m, n}, x.options().dtype(at::kFloat));
    run_f32(a, xf.data_ptr<float>(), m, of.data_ptr<float>(), direct_rows);
    out.copy_(of);
#endif
  }
}

// Whether bf16 activations run on bf16 dot products (AVX512-BF16); elsewhere they are widened
// to the float32 path, which every CPU has.
bool quant_linear_bf16_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The instruction set of the float32 paths: "avx2" (quant_linear_avx2.h; also on AVX-512
// CPUs) or "generic" (plain C++ loops).
std::string quant_linear_f32_isa() {
#if defined(KVSERVE_QL_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "quant_linear(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor zeros, "
      "int bits, int group, int offset, int direct_rows) -> ()");
  m.def("quant_linear_bf16_native() -> bool", &quant_linear_bf16_native);
  m.def("quant_linear_f32_isa() -> str", &quant_linear_f32_isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("quant_linear", &quant_linear); }
