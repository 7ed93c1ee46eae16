// Quantized linear layer with int8 activations: y[M, N] = x[M, K] @ W[N, K]^T, W as in
// quant_linear.cpp (int8 or int4 codes, a float scale and zero per group of g along K), and x
// quantized per row to int8 in blocks of 32 (x ~= d * q, d = max|x| / 127, q = round(x / d)),
// as llama.cpp does (its Q8_0 activations). The products are integer dot products
// (AVX512-VNNI vpdpbusd: 64 u8 x s8 multiply-adds per instruction, twice vdpbf16ps' 32), and
// the float scales are applied once per block of 32. The pure-PyTorch reference is
// kvserve.quantization.qlinear.reference_linear_a8 (quantize x the same way, then an exact
// float64 product); tests hold this kernel to it.
//
// Why: on a CPU without AMX the bf16 path is compute-bound for a 1-row decode (about 6 vector
// ops to turn 32 codes into floats) and, at 64 rows, pays a bf16 tile dequantization per
// chunk (measured in benchmarks/quant_kernels.py; numbers in docs/performance.md).
//
// Arithmetic: the codes are stored unsigned, u = c + o (o = 128 for int8, 8 or 0 for int4),
// since vpdpbusd multiplies unsigned bytes by signed ones. With W = c * s + z per group,
//   sum_k W_k x_k = s * sum_k u_k x_k + (z - o * s) * sum_k x_k,
// and per block of 32, sum_k u_k x_k = d * sum_k u_k q_k: an exact int32 sum (|.| < 2^20).
//
// Layout (built by kvserve.quantization.qlinear.pack_a8): blocks of 16 output channels ("a
// vector"), K in blocks of 32; a 64-byte vector holds 4 consecutive k ("a quad") of the 16
// channels, byte 4j + i = channel j, k = 4t + i (vpdpbusd's layout; also AMX's int8 B-tile
// layout). One block's codes:
//   int8: [8 quads][16][4] uint8 (u), 512 bytes;
//   int4: [4][16][4] uint8, low nibble = quad t, high nibble = quad t + 4, 256 bytes;
//   5 and 6 bits (GGUF Q5_0/Q5_1/Q5_K, Q6_K): int4's 256 bytes of low nibbles, then one bit
//   plane per higher bit: [8 quads] 64-bit masks, bit 4j + i of quad t's = that bit of u for
//   channel j, k = 4t + i (64 bytes a plane). The kernel adds 16 (32) to a quad's nibbles
//   under its mask (one vpaddb with a mask register), so a 6-bit code streams 6 bits, not 8.
// Table codes (scale_format bit 2, A8_TABLE in qlinear.py; int4 layout, per-group records):
// weights with at most 16 distinct code values (MXFP4's doubled E2M1 values, IQ4_NL's levels)
// store 4-bit indices, and the buffer ends with a 64-byte trailer whose first 16 bytes are the
// table of u = c + o; the kernel maps each nibble through it (one vpermb per 64 codes, vpshufb
// without AVX512-VBMI) and runs the 8-bit products. An MXFP4 weight streams 4.5 bits per weight this way (float16 scales)
// instead of 6 (5-bit planes, float32 scales).
// Each vector is one stream of records, one per group of g values (g = 16: per block of 32,
// holding both its groups): the group's 16 scales (float16 or float32; two groups' for g = 16),
// its 16 zeros likewise if there are zeros (else zero 0), then the codes of its g / 32 blocks:
//   [N / 16][K / g or K / 32][header + codes] bytes; g = 16 or a multiple of 32, 32 divides K.
// Super-block records (scale format 2, GGUF K-quants: qweight.SuperScales): one record per 256
// values along K (8 blocks of 32; g = 16 or 32, G = 256 / g groups): the 16 channels' float16
// d, their float16 dmin if there are zeros, the G groups' int8 sc ([G][16]), their int8 m if
// zeros, then the 8 blocks' codes. A group's scale is d * sc and its zero -(dmin * m), float32
// products as gguf's dequantizer computes them, so the outputs equal the float32 records' bit
// for bit. A Q4_K weight streams 4.6 bits per weight this way instead of 6 (a float32 scale
// and zero per 32), Q6_K 8.6 instead of 10.
// Scales beside their codes, as a GGUF block keeps them: with scales and zeros in streams of
// their own ([N / 16][K / g][16] each), a one-row pass over 22 TinyLlama-1.1B layers' own int4
// weights (g 32, with zeros) read 36.2 GB/s against 40.6 in records (the op called directly,
// interleaved, medians of 28; bf16 prepacked: 45.1), and 36.9 against 39.4 without zeros
// (GGUF Q4_0); int8 per channel and 8 rows were level. With [K / g, N] scales, as in
// quant_linear.cpp, each group of a tile was a different page (18.5 ms against 15.6).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_A8_AVX2 1  // quant_linear_a8_avx2.h: vpmaddubsw, float32 or bf16 activations
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVSERVE_A8_VNNI 1
#endif

namespace {

#if defined(KVSERVE_A8_AVX2)
#include "quant_linear_a8_avx2.h"
#endif

#if defined(KVSERVE_A8_VNNI)
constexpr int64_t kRowChunk = 64;  // rows whose int8 activations stay in L2 for a tile
constexpr int64_t kPrefetchBytes = 2048;
// int4, 5- and 6-bit codes for at least this many rows: each tile's codes unpacked once into
// an 8-bit copy (expand_codes), not once per micro-tile. All projections and the LM head of
// TinyLlama-1.1B's Q4_K_M file, called directly, medians of 9: 16 / 32 / 256 rows 99 / 161 /
// 1068 ms with the copy, 119 / 222 / 1647 unpacking in place; 8 rows: level, so not there.
// Q5_K_M: 16 / 64 rows 0.77 / 0.84x of 8-bit records (0.74 / 0.65x in place).
constexpr int64_t kExpandRows = 16;

struct A8Args {
  const uint8_t* packed;  // pack_a8's records
  bool half_scales;       // scales / zeros are float16 (else float32)
  bool supers;            // super-block records (scale format 2)
  int64_t sc_at, m_at;    // supers: offsets of sc and m in a record's header
  bool zeros;             // the records hold zeros (else zero 0)
  int64_t group;          // g: 16 or a multiple of 32
  int64_t n, k;
  float offset;           // o: stored u = c + o
  int64_t zgroup;         // granularity of xsum: 16 if g == 16, else g
  int64_t scale_bytes;    // one record's scales (16 or 32 values)
  int64_t header;         // scale_bytes, twice with zeros
  int64_t record;         // header + the record's codes
  int64_t blocks_per_record;  // g / 32 (1 for g = 16)
  int64_t planes;             // bit planes above the nibbles: 0 (int4), 1 (5 bits), 2 (6 bits)
  int64_t block_bytes;        // one vector's codes for one block of 32
  int64_t vec_base = 0;       // packed holds vectors vec_base.. (a tile's expanded copy)
  bool prefetch = true;       // streamed from memory (not a tile's copy, already in L2)
  // o when the records hold no zeros (else 0): each block's int32 sums start at -o * sum(q)
  // (A8Rows::qs), so they are sum(c * q) and the float zero term (-o * s) * sum(x) is not
  // needed: exact, where that term rounded a difference of two large sums, and one FMA (and
  // a broadcast) per row, vector and group fewer. TinyLlama-1.1B's Q4_0 file (o = 8), all
  // its projections and LM head called directly (AMD EPYC Zen 5, 2 threads, medians of 15,
  // alternating trees): one row 24.4 -> 20.8 ms, 64 rows 251 -> 231 ms; Q6_K (o = 32) level.
  int32_t int_offset = 0;
  const uint8_t* table = nullptr;  // table codes: the 16 values of u the nibbles index
};

// The 16-byte table in each 128-bit lane (vpshufb looks up within a lane; vpermb's 64 entries
// are it four times over), or zeros.
inline __m512i load_table(const uint8_t* table) {
  if (table == nullptr) return _mm512_setzero_si512();
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
}

// The two halves of 64 packed bytes of table codes, looked up: lo = table[b & 15], hi =
// table[b >> 4]. vpermb (AVX512-VBMI) indexes by the low 6 bits, and the repeated table
// ignores bits 4-5, so neither half needs the mask vpshufb does.
inline void table_halves(__m512i table, __m512i packed, __m512i& lo, __m512i& hi) {
#if defined(__AVX512VBMI__)
  lo = _mm512_permutexvar_epi8(packed, table);
  hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(packed, 4), table);
#else
  const __m512i low4 = _mm512_set1_epi8(15);
  lo = _mm512_shuffle_epi8(table, _mm512_and_si512(packed, low4));
  hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4));
#endif
}

struct A8Rows {  // x, quantized (quantize_rows)
  const int8_t* q;  // [M, K]
  const float* d;   // [M, K / 32]
  const float* xs;  // [M, K / zgroup]: sum of d * q over each zgroup
  const int32_t* qs;  // [M, K / 16]: sum of q over each half block
};

// 16 scales (or zeros) at p, as float32.
inline __m512 load16(bool half, const uint8_t* p) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

#include "quant_linear_a8_gguf.h"  // GGUF records: super-block scales, bit planes

// Rows r0..r1 of x [M, K] bf16 into int8 blocks of 32. inv = 127 / max|x| and round half to
// even (the MXCSR default): the reference computes the same float32 values.
void quantize_rows(const c10::BFloat16* x, int64_t r0, int64_t r1, int64_t k, int64_t zg,
                   int8_t* q, float* d, float* xs, int32_t* qs) {
  const int64_t nb = k / 32, nz = k / zg;
  for (int64_t r = r0; r < r1; ++r) {
    std::fill(xs + r * nz, xs + (r + 1) * nz, 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const auto* src = reinterpret_cast<const __m256i*>(x + r * k + b * 32);
      __m512 v0 = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src)), 16));
      __m512 v1 = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src + 1)), 16));
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      float dd = amax / 127.0f;
      __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
      __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + b * 32), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + b * 32 + 16),
                       _mm512_cvtsepi32_epi8(q1));
      d[r * nb + b] = dd;
      const int32_t n0 = _mm512_reduce_add_epi32(q0), n1 = _mm512_reduce_add_epi32(q1);
      qs[r * (k / 16) + 2 * b] = n0;
      qs[r * (k / 16) + 2 * b + 1] = n1;
      float h0 = dd * static_cast<float>(n0);
      float h1 = dd * static_cast<float>(n1);
      if (zg == 16) {
        xs[r * nz + 2 * b] = h0;
        xs[r * nz + 2 * b + 1] = h1;
      } else {
        xs[r * nz + b * 32 / zg] += h0 + h1;
      }
    }
  }
}

// out[MR rows][NV * 16 channels from vector v0] for rows starting at row r0 of `rows`.
// HALVES: g == 16, so the two halves of a block of 32 have their own scales.
// kOneChain: tiles of several rows keep one accumulator per row and vector, so the block's
// sum needs no add, and 5 rows x 2 vectors fit the registers (4 x 2 with two chains): the
// four projections of a TinyLlama-1.1B layer at 8 to 2048 rows took 5-10% less time
// (benchmarks/quant_kernels.py shapes, interleaved, medians of 7-15; bit-identical outputs:
// int32 sums in any order). int8 codes as stored gained nothing that way (0.93-1.02x); the
// 8-bit copies of int4 / K-quant tiles (expand_codes) did: TinyLlama-1.1B's Q4_K
// projections at 64 rows, called directly, 0.50-0.52 -> 0.52-0.56 T int8 ops/s (AMD EPYC
// Zen 5, 2 threads, medians of 15, alternating trees). One row needs the two chains'
// independent latency.
// Where the rest of the int8 peak goes at 64 rows (0.94 T ops/s measured by
// benchmarks/int8_peak.py; the same Q4_K projections at 0.55): the per-block float work
// shares the vector pipes with vpdpbusd. Dropping the block's scale (cvt, mul, fmadd per row
// and vector) ran them at 0.65, dropping the zero term too at 0.73 (wrong outputs, measured
// only). llama.cpp's integer route for K-quants' scales alone (activations scaled per 256,
// each block's int32 sum times its integer sub-scale, vpmulld) measured 0.56-0.58 in the
// same test: not worth a rounding change by itself; with the mins as one vpdpwssd per
// super-block too, estimated +10-15% (not built; docs/performance.md, "K-quants at 64 rows,
// again").
template <int MR, int NV, bool INT4, bool HALVES>
void a8_micro(const A8Args& a, const A8Rows& rows, int64_t r0, int64_t v0, c10::BFloat16* out) {
  const int64_t code_bytes = a.block_bytes;  // one vector's codes for one block of 32
  constexpr bool kOneChain = !HALVES && MR * NV >= 8;
  const int64_t nb = a.k / 32, nz = a.k / a.zgroup;
  const int64_t bpr = a.blocks_per_record;
  const int64_t records = nb / bpr;
  const int64_t elt = a.half_scales ? 2 : 4;
  const uint8_t* w[NV];  // each vector's first record
  for (int v = 0; v < NV; ++v) w[v] = a.packed + (v0 + v - a.vec_base) * records * a.record;
  const int8_t* q[MR];
  for (int r = 0; r < MR; ++r) q[r] = rows.q + (r0 + r) * a.k;
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i table = load_table(a.table);
  const __m512 off = _mm512_set1_ps(a.offset);
  __m512 total[MR][NV], s0[NV], s1[NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) total[r][v] = _mm512_setzero_ps();
  int64_t rec = 0, in_rec = 0;  // kb's record and its block in it (no division per block)
  for (int64_t kb = 0; kb < nb; ++kb) {
    // This block's bytes in each vector's stream: its record's header first if it starts one.
    const int64_t first = rec * a.record + (in_rec == 0 ? 0 : a.header + in_rec * code_bytes);
    const int64_t len = in_rec == 0 ? a.header + code_bytes : code_bytes;
    // Prefetch kPrefetchBytes ahead in each vector's stream: a one-row pass over
    // TinyLlama-1.1B's int4 weights took 15.6 ms with the hardware prefetchers alone, 14.4 /
    // 14.0 / 13.7 ms at 512 / 1024 / 2048 bytes ahead (8 rows: 35.4 against 30.5 ms). Not in
    // a tile's 8-bit copy: it sits in L2 already, and the prefetches took load slots from the
    // 64-row tiles (about 3% of those tiles' time).
    for (int v = 0; v < NV && a.prefetch; ++v) {
      const char* ahead = reinterpret_cast<const char*>(w[v] + first) + kPrefetchBytes;
      for (int64_t line = 0; line < len; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    // New group: its scales, and the zero term (z - o * s) * sum x for every row.
    if (a.supers) {  // every block starts a group (two with HALVES), scales from its record
      for (int h = 0; h < (HALVES ? 2 : 1); ++h) {
        const int64_t gi = HALVES ? 2 * in_rec + h : in_rec;  // the group in the record
        for (int v = 0; v < NV; ++v) {
          const uint8_t* hdr = w[v] + rec * a.record;
          __m512 s = _mm512_mul_ps(load16(true, hdr), load16_i8(hdr + a.sc_at + gi * 16));
          (h ? s1 : s0)[v] = s;
          if (a.int_offset != 0) continue;  // no zeros, the offset in the int32 sums
          __m512 z = a.zeros ? negate(_mm512_mul_ps(load16(true, hdr + 32),
                                                    load16_i8(hdr + a.m_at + gi * 16)))
                             : _mm512_setzero_ps();
          z = _mm512_sub_ps(z, _mm512_mul_ps(off, s));
          for (int r = 0; r < MR; ++r) {
            __m512 xsum = _mm512_set1_ps(rows.xs[(r0 + r) * nz + (HALVES ? 2 * kb : kb) + h]);
            total[r][v] = _mm512_fmadd_ps(z, xsum, total[r][v]);
          }
        }
      }
    } else if (in_rec == 0) {
      const int64_t g0 = HALVES ? 2 * kb : rec;
      for (int h = 0; h < (HALVES ? 2 : 1); ++h) {
        for (int v = 0; v < NV; ++v) {
          const uint8_t* hdr = w[v] + rec * a.record + h * 16 * elt;
          __m512 s = load16(a.half_scales, hdr);
          (h ? s1 : s0)[v] = s;
          if (a.int_offset != 0) continue;  // no zeros, the offset in the int32 sums
          __m512 z = a.zeros ? load16(a.half_scales, hdr + a.scale_bytes) : _mm512_setzero_ps();
          z = _mm512_sub_ps(z, _mm512_mul_ps(off, s));
          for (int r = 0; r < MR; ++r) {
            __m512 xsum = _mm512_set1_ps(rows.xs[(r0 + r) * nz + g0 + h]);
            total[r][v] = _mm512_fmadd_ps(z, xsum, total[r][v]);
          }
        }
      }
    }
    __m512i acc0[MR][NV], acc1[MR][NV];  // acc1 unused (acc0 takes both halves) if kOneChain
    for (int r = 0; r < MR; ++r) {
      // int_offset: start at -o * sum(q) (per half with HALVES), so the sums are of c = u - o
      __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
      if (a.int_offset != 0) {
        const int32_t* n = rows.qs + (r0 + r) * (a.k / 16) + 2 * kb;
        i0 = _mm512_set1_epi32(-a.int_offset * (HALVES ? n[0] : n[0] + n[1]));
        if constexpr (HALVES) i1 = _mm512_set1_epi32(-a.int_offset * n[1]);
      }
      for (int v = 0; v < NV; ++v) {
        acc0[r][v] = i0;
        acc1[r][v] = i1;
      }
    }
    for (int t = 0; t < 4; ++t) {
      __m512i lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        const uint8_t* p = w[v] + rec * a.record + a.header + in_rec * code_bytes;
        if constexpr (INT4) {
          __m512i packed = _mm512_loadu_si512(p + t * 64);
          if (a.table != nullptr) {  // table codes: nibble i -> u = table[i] (no planes)
            table_halves(table, packed, lo[v], hi[v]);
            continue;
          }
          lo[v] = _mm512_and_si512(packed, low4);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
          for (int64_t pl = 0; pl < a.planes; ++pl) {  // 5- and 6-bit codes: + 16 (32)
            const uint8_t* bits = p + 256 + pl * 64;
            const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << pl));
            lo[v] = _mm512_mask_add_epi8(lo[v], load_mask(bits + t * 8), lo[v], add);
            hi[v] = _mm512_mask_add_epi8(hi[v], load_mask(bits + (t + 4) * 8), hi[v], add);
          }
        } else {
          lo[v] = _mm512_loadu_si512(p + t * 64);
          hi[v] = _mm512_loadu_si512(p + (t + 4) * 64);
        }
      }
      for (int r = 0; r < MR; ++r) {
        __m512i xa = bcast4(q[r] + kb * 32 + 4 * t);
        __m512i xb = bcast4(q[r] + kb * 32 + 16 + 4 * t);
        for (int v = 0; v < NV; ++v) {
          // Two chains (the halves of the block): half the dependent-latency of one.
          acc0[r][v] = _mm512_dpbusd_epi32(acc0[r][v], lo[v], xa);
          if constexpr (kOneChain) {
            acc0[r][v] = _mm512_dpbusd_epi32(acc0[r][v], hi[v], xb);
          } else {
            acc1[r][v] = _mm512_dpbusd_epi32(acc1[r][v], hi[v], xb);
          }
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      __m512 dr = _mm512_set1_ps(rows.d[(r0 + r) * nb + kb]);
      for (int v = 0; v < NV; ++v) {
        if constexpr (HALVES) {
          // (S0 s0 + S1 s1) d: 5 float ops a row, vector and block, not 8 (s0 d, s1 d, two
          // products, two adds), which share the vector pipes with vpdpbusd. Random Q6_K
          // layers of TinyLlama-1.1B's four shapes, 2 threads, medians of 15, 3-4 rounds
          // alternating with the previous build (AMD EPYC Zen 5): 64 rows 13.1-13.7 ->
          // 12.5-12.9 ms, 256 rows 47.4-50.5 -> 43.8-45.7; Q3_K at 64 rows 12.6-13.5 -> 11.7-12.7.
          const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc1[r][v]), s1[v],
                                              _mm512_mul_ps(_mm512_cvtepi32_ps(acc0[r][v]), s0[v]));
          total[r][v] = _mm512_fmadd_ps(both, dr, total[r][v]);
        } else if constexpr (kOneChain) {
          __m512 sum = _mm512_cvtepi32_ps(acc0[r][v]);
          total[r][v] = _mm512_fmadd_ps(sum, _mm512_mul_ps(s0[v], dr), total[r][v]);
        } else {
          __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc0[r][v], acc1[r][v]));
          total[r][v] = _mm512_fmadd_ps(sum, _mm512_mul_ps(s0[v], dr), total[r][v]);
        }
      }
    }
    if (++in_rec == bpr) {
      in_rec = 0;
      ++rec;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + r) * a.n + (v0 + v) * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(total[r][v])));
}

// Rows r0..r0 + mc (mc <= 5; <= 8 for one vector) times nv (1, 2 or 4) vectors from v0.
template <bool INT4, bool HALVES>
void a8_rows(const A8Args& a, const A8Rows& rows, int64_t r0, int64_t mc, int64_t v0, int64_t nv,
             c10::BFloat16* out) {
#define KVSERVE_A8(MR, NV) a8_micro<MR, NV, INT4, HALVES>(a, rows, r0, v0, out)
  if (nv == 4) {  // one row, four vectors: enough independent chains to hide the latency
    KVSERVE_A8(1, 4);
    return;
  }
  if (nv == 2) {
    switch (mc) {
      case 5: KVSERVE_A8(5, 2); break;
      case 4: KVSERVE_A8(4, 2); break;
      case 3: KVSERVE_A8(3, 2); break;
      case 2: KVSERVE_A8(2, 2); break;
      default: KVSERVE_A8(1, 2); break;
    }
    return;
  }
  switch (mc) {
    case 8: KVSERVE_A8(8, 1); break;
    case 7: KVSERVE_A8(7, 1); break;
    case 6: KVSERVE_A8(6, 1); break;
    case 5: KVSERVE_A8(5, 1); break;
    case 4: KVSERVE_A8(4, 1); break;
    case 3: KVSERVE_A8(3, 1); break;
    case 2: KVSERVE_A8(2, 1); break;
    default: KVSERVE_A8(1, 1); break;
  }
#undef KVSERVE_A8
}

// One tile of up to 4 vectors (64 channels) for rows m0..m0 + mc.
template <bool INT4, bool HALVES>
void a8_tile(const A8Args& a, const A8Rows& rows, int64_t m0, int64_t mc, int64_t v0,
             int64_t nv, c10::BFloat16* out) {
  if (mc == 1 && nv == 4) {
    a8_rows<INT4, HALVES>(a, rows, m0, 1, v0, 4, out);
    return;
  }
  // Rows per micro-tile: HALVES doubles the accumulators, kOneChain halves them (HALVES: 3
  // rows x 2 vectors; 2 read each vector's codes from L2 once per 2 rows: Q6_K's projections
  // and LM head of TinyLlama-1.1B's Q4_K_M file at 64 rows 0.29-0.36 -> 0.37-0.41 T int8
  // ops/s; 4 rows: no better). 5- and
  // 6-bit codes with g = 16 take one vector of 5 rows: their unpacking (masked adds of the
  // bit planes) is paid once per micro-tile, and 2 rows did not repay it.
  const bool tall = INT4 && HALVES && a.planes > 0;
  // Table codes (g >= 32): 8 rows of one vector, each lookup paid once per 8 rows. 8 gpt-oss
  // gate/up projections ([5760, 2880] MXFP4), AMD EPYC Zen 5, 2 threads, medians of 15, ms,
  // at 1 / 2 / 4 / 8 / 16 / 32 / 64 / 128 rows: 2.3 / 2.8 / 3.7 / 4.5 / 8.2 / 15.4 / 29.5 /
  // 58.4, against 5 rows x 2 vectors 2.6 / 3.2 / 5.0 / 7.8 and the 8-bit copy from 16 rows
  // 11.3 / 18.1; the same codes as bytes 4.0 / 4.6 / 4.5 / 6.4 / 9.8 / 16.7 / 30.3 / 59.7.
  const bool tabled = INT4 && !HALVES && a.table != nullptr;
  const int64_t kMR = tabled ? 8 : (tall ? 5 : (HALVES ? 3 : 5));
  const int64_t kNV = (tall || tabled) ? 1 : 2;
  for (int64_t v = v0; v < v0 + nv; v += kNV) {
    const int64_t w = std::min<int64_t>(kNV, v0 + nv - v);
    for (int64_t r = m0; r < m0 + mc; r += kMR) {
      a8_rows<INT4, HALVES>(a, rows, r, std::min(kMR, m0 + mc - r), v, w, out);
    }
  }
}

template <bool INT4, bool HALVES>
void a8_run(const A8Args& a, const A8Rows& rows, int64_t m, c10::BFloat16* out) {
  const int64_t vecs = a.n / 16;
  const int64_t tiles = (vecs + 3) / 4;
  // Tiles per task: a small layer runs on the calling thread (waking the pool costs more
  // than ~64K weights of work).
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 64 * a.k));
  // Each tile's codes unpacked once into an 8-bit copy; not table codes (g >= 32): their
  // 8-row tiles beat the copy at every row count (a8_tile)
  const bool expand = INT4 && m >= kExpandRows && (a.table == nullptr || HALVES);
  if (expand) {
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> buf;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t nv = std::min<int64_t>(4, vecs - 4 * t);
        const A8Args e = expand_codes(a, 4 * t, nv, buf);
        for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
          a8_tile<false, HALVES>(e, rows, m0, std::min(kRowChunk, m - m0), 4 * t, nv, out);
        }
      }
    });
    return;
  }
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t mc = std::min(kRowChunk, m - m0);
      for (int64_t t = begin; t < end; ++t) {
        a8_tile<INT4, HALVES>(a, rows, m0, mc, 4 * t, std::min<int64_t>(4, vecs - 4 * t), out);
      }
    }
  });
}
#endif

constexpr int64_t kTableCodes = 4;  // scale_format's bit: 4-bit indices into a table
constexpr int64_t kTableBytes = 64;  // the trailer holding the table (16 bytes used)
// scale_format's bit: int8 codes that span 6 bits, c + offset in [0, 63] (offset is then that
// o; the records still hold c + 128). The AVX2 path reads them without the sign trick
// (quant_linear_a8_avx2.h); the VNNI kernel reads them as any int8 codes.
constexpr int64_t kNarrowCodes = 8;

void quant_linear_a8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t bits,
                     int64_t group, int64_t offset, int64_t scale_format, bool has_zeros) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(),
              "quant_linear_a8: x and out must be contiguous 2-D tensors");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && out.scalar_type() == x.scalar_type(),
              "quant_linear_a8: x and out must be both bfloat16 or both float32");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 5 || bits == 6,
              "quant_linear_a8: bits must be 4, 5, 6 or 8");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(out.size(0) == m, "quant_linear_a8: out rows");
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0 && (group == 16 || group % 32 == 0) && k % group == 0,
              "quant_linear_a8: N must be a multiple of 16, K of 32, g 16 or a multiple of 32");
  const bool tabled = (scale_format & kTableCodes) != 0;
  const bool narrow = (scale_format & kNarrowCodes) != 0;
  scale_format &= ~(kTableCodes | kNarrowCodes);
  TORCH_CHECK(!narrow || (bits == 8 && !tabled && offset >= 0 && offset <= 63),
              "quant_linear_a8: narrow codes are int8 codes with an offset in [0, 63]");
  const int64_t narrow_offset = narrow ? offset : -1;
  if (narrow) offset = 128;  // what the records hold
  TORCH_CHECK(scale_format >= 0 && scale_format <= 2,
              "quant_linear_a8: scale_format is 0 (float32), 1 (float16) or 2 (super-blocks), "
              "plus 4 for table codes, plus 8 for narrow int8 codes");
  const bool half_scales = scale_format == 1, supers = scale_format == 2;
  TORCH_CHECK(!tabled || (bits == 4 && !supers),
              "quant_linear_a8: table codes are 4-bit indices with per-group records");
  TORCH_CHECK(!supers || (k % 256 == 0 && (group == 16 || group == 32)),
              "quant_linear_a8: super-block records need K a multiple of 256 and g 16 or 32");
  int64_t bpr = group == 16 ? 1 : group / 32;  // blocks of 32 per record
  int64_t scale_bytes = (group == 16 ? 32 : 16) * (half_scales ? 2 : 4);
  int64_t header = scale_bytes * (has_zeros ? 2 : 1);
  const int64_t groups = 256 / group;  // supers: groups per record
  const int64_t sc_at = 32 * (has_zeros ? 2 : 1), m_at = sc_at + 16 * groups;
  if (supers) {  // d (dmin), sc (m)
    bpr = 8;
    header = (32 + 16 * groups) * (has_zeros ? 2 : 1);
  }
  const int64_t planes = bits == 8 ? 0 : bits - 4;  // bit planes above the nibbles
  const int64_t block_bytes = bits == 8 ? 512 : 256 + 64 * planes;
  const int64_t record = header + bpr * block_bytes;
  const int64_t records_bytes = (n / 16) * (k / 32 / bpr) * record;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == records_bytes + (tabled ? kTableBytes : 0),
              "quant_linear_a8: packed does not hold N x K weights in pack_a8's records");
  const int64_t zg = group == 16 ? 16 : group;
#if defined(KVSERVE_A8_VNNI)
  if (bf16) {
    if (m == 0) return;
    A8Args a{packed.data_ptr<uint8_t>(), half_scales, supers, sc_at, m_at, has_zeros, group, n, k,
             static_cast<float>(offset), zg, scale_bytes, header, record, bpr, planes,
             block_bytes};
    if (tabled) a.table = packed.data_ptr<uint8_t>() + records_bytes;
    TORCH_CHECK(offset >= 0 && offset <= 255, "quant_linear_a8: the offset is in [0, 255]");
    if (!has_zeros) a.int_offset = static_cast<int32_t>(offset);
    std::vector<int8_t> q(m * k);
    std::vector<float> d(m * (k / 32)), xs(m * (k / zg));
    std::vector<int32_t> qs(m * (k / 16));
    const auto* xp = x.data_ptr<c10::BFloat16>();
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      quantize_rows(xp, r0, r1, k, zg, q.data(), d.data(), xs.data(), qs.data());
    });
    A8Rows rows{q.data(), d.data(), xs.data(), qs.data()};
    auto* op = out.data_ptr<c10::BFloat16>();
    const bool halves = group == 16;
    if (bits != 8) {
      halves ? a8_run<true, true>(a, rows, m, op) : a8_run<true, false>(a, rows, m, op);
    } else {
      halves ? a8_run<false, true>(a, rows, m, op) : a8_run<false, false>(a, rows, m, op);
    }
    return;
  }
#endif
#if defined(KVSERVE_A8_AVX2)
  TORCH_CHECK(planes == 0 && !tabled,
              "quant_linear_a8: 5- or 6-bit codes and table codes run on AVX512-VNNI only "
              "(bf16 activations); pack this weight with 4- or 8-bit codes");
  if (m == 0) return;
  A8Avx2Args a{packed.data_ptr<uint8_t>(), half_scales, has_zeros, n, k,
               static_cast<float>(offset), zg, scale_bytes, record, bpr, supers, header,
               sc_at, m_at, static_cast<int32_t>(narrow_offset)};
  if (bf16) {
    quant_linear_a8_avx2(a, bits, group == 16, x.data_ptr<c10::BFloat16>(), m,
                         out.data_ptr<c10::BFloat16>());
  } else {
    quant_linear_a8_avx2(a, bits, group == 16, x.data_ptr<float>(), m, out.data_ptr<float>());
  }
#else
  TORCH_CHECK(false, "quant_linear_a8 needs AVX2 (float32, bf16) or AVX512-VNNI (bf16)");
#endif
}

// Whether bf16 activations run on AVX512-VNNI (vpdpbusd) here: the path `auto` picks.
bool quant_linear_a8_supported() {
#if defined(KVSERVE_A8_VNNI)
  return true;
#else
  return false;
#endif
}

// The instruction set quant_linear_a8 runs float32 activations on (bf16 too without VNNI):
// "avx2" (quant_linear_a8_avx2.h, vpmaddubsw) or "none".
std::string quant_linear_a8_isa() {
#if defined(KVSERVE_A8_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "quant_linear_a8(Tensor(a!) out, Tensor x, Tensor packed, int bits, int group, int offset, "
      "int scale_format, bool has_zeros) -> ()");
  m.def("quant_linear_a8_supported() -> bool", &quant_linear_a8_supported);
  m.def("quant_linear_a8_isa() -> str", &quant_linear_a8_isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("quant_linear_a8", &quant_linear_a8); }
