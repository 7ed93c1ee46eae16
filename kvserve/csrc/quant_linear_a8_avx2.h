// AVX2 int8-activation path of quant_linear_a8.cpp, for CPUs without AVX512-VNNI (AMD Zen
// 1-3, Intel Haswell to Alder Lake) and for float32 activations everywhere. Included by
// quant_linear_a8.cpp inside its anonymous namespace; same records (pack_a8), same
// activation quantization (blocks of 32, d = max|x| / 127, q = round(x / d) half to even),
// same reference (kvserve.quantization.qlinear.reference_linear_a8).
//
// llama.cpp's AVX2 Q4_0 x Q8_0 / Q8_0 x Q8_0 dot products, on pack_a8's quads (4 consecutive
// k of 8 channels in one 32-byte half of a 64-byte quad vector: byte 4j + i = channel j, k =
// 4t + i), with x's quad t broadcast to every channel:
// * int4: the stored nibbles u = c + o in [0, 15] are the unsigned operand of vpmaddubsw, q
//   the signed one: each int16 is u_k q_k + u_k+1 q_k+1, |.| <= 2 * 15 * 127 = 3810, so the 8
//   products of a block of 32 (4 quads, low and high nibbles) add up in int16 without
//   saturating (|.| <= 30480 < 32767); one vpmaddwd by ones then sums each channel's pairs to
//   int32.
// * int8: u = c + 128 times q could reach 2 * 255 * 127 and saturate vpmaddubsw's int16, so
//   the sign trick: |c| (unsigned; |-128| reads as 128) times q * sign(c) (vpsignb; |q| <=
//   127, so no overflow): each int16 is at most 2 * 128 * 127 = 32512; vpmaddwd by ones to
//   int32 per quad, then int32 adds.
// * int8 codes that span 6 bits (GGUF Q5_0/Q5_1/Q5_K/Q6_K: c + o in [0, 63] for the o that
//   qlinear.plane_offset(codes, 6) gives): the stored u = c + 128 less 128 - o (one vpsubb per
//   32 codes, shared by the rows) is the unsigned operand, so no vpsignb; each int16 is at most
//   2 * 63 * 127 = 16002, so two quads add in int16 before the vpmaddwd (32004), and each
//   block's int32 sum then loses o * sum(q) of its 16 or 32 k (quantize's qs): the same exact
//   int32 sum of c * q as the sign trick's, in 5 instead of 8 vector operations per row and
//   two quads. Measured (TinyLlama's Q6_K layers, 2 threads, Zen 3) it is 0-10% faster than
//   the sign trick, not 1.6x: the loop is not bound by those operations alone. Each broadcast
//   of x feeds both 8-channel halves (a8_block_narrow_both).
// Arithmetic, per group with W = c * s + z and x_k ~= d_b q_k (b the block of 32 of k):
//   sum_k W_k x_k = s * sum_b d_b S_b + z' * sum_k d_b q_k,
// with S_b = sum_{k in b} u_k q_k (exact in int32) and z' = z - o * s for int4's stored
// nibbles (u = c + o); int8 sums the codes c themselves (S_b = sum c_k q_k), so z' = z. The
// second sum is quantize's xs (per group; per 16 for g = 16). The floats are rounded once per
// block (d_b S_b, then its FMA with s), so against the exact float64 reference the error is
// a few float32 ulps of the largest partial sum.
#pragma once

struct A8Avx2Args {
  const uint8_t* packed;  // pack_a8's records
  bool half_scales;       // scales / zeros are float16 (else float32)
  bool zeros;             // the records hold zeros (else zero 0)
  int64_t n, k;
  float offset;           // o: stored u = c + o (int8's is unused: codes are read as c)
  int64_t zgroup;         // granularity of xs: 16 if g == 16, else g
  int64_t scale_bytes;    // one record's scales (16 or 32 values)
  int64_t record;         // header + the record's codes
  int64_t blocks_per_record;  // g / 32 (1 for g = 16); 8 for super-block records
  // Super-block records (K-quants' two levels, qweight.SuperScales): per 256 values of K, d
  // [16] float16, dmin [16] (with zeros), sc [G][16] int8 (at sc_at), m [G][16] (at m_at);
  // a group's scale is d * sc and its zero -(dmin * m), as gguf's dequantizer computes them.
  bool supers = false;
  int64_t header = 0;     // bytes before a record's codes
  int64_t sc_at = 0, m_at = 0;
  int32_t narrow = -1;    // int8 codes in 6 bits: c + narrow in [0, 63] (-1: any int8 code)
};

// 8 int8 at p, as float32.
inline __m256 load8_i8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// -v exactly (the sign bit flipped: -(+0) is -0, as numpy's negation gives).
inline __m256 negate8(__m256 v) {
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))));
}

// 8 scales (or zeros) at p, as float32.
inline __m256 load8_a8(bool half, const uint8_t* p) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

inline __m256i bcast4_avx2(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

#include "a8_activations_avx2.h"  // quantize_rows_avx2

#include "a8_blocks_avx2.h"  // a8_block_avx2, a8_block_narrow_both, a8_block_int4_both

// Whether a group's zero term is there at all: zeros in the records, or int4's stored
// nibbles c + o with o != 0 (z' = -o * s).
template <bool INT4>
inline bool a8_zero_term(const A8Avx2Args& a) {
  return a.zeros || (INT4 && a.offset != 0.0f);
}

// One slot's group scales s and zero terms z' = z - o * s (int4's stored nibbles are c + o) as
// float32, [group half gh][channel half h]: the record at hdr, its block i (super records).
// Always inlined: called, it kept s and z in memory (the 1-row Q4_K call 1.25x slower).
template <bool INT4, bool HALVES>
__attribute__((always_inline)) inline void a8_slot_avx2(const A8Avx2Args& a, const uint8_t* hdr,
                                                        int64_t i, __m256 s[2][2], __m256 z[2][2]) {
  const int64_t elt = a.half_scales ? 2 : 4;
  const float off = INT4 ? a.offset : 0.0f;
  const bool zero_term = a8_zero_term<INT4>(a);
  for (int gh = 0; gh < (HALVES ? 2 : 1); ++gh) {
    for (int h = 0; h < 2; ++h) {
      z[gh][h] = _mm256_setzero_ps();
      if (a.supers) {
        const int64_t gi = HALVES ? 2 * i + gh : i;  // the group in the super-block
        s[gh][h] = _mm256_mul_ps(load8_a8(true, hdr + h * 16),
                                 load8_i8(hdr + a.sc_at + gi * 16 + h * 8));
        if (a.zeros) {
          z[gh][h] = negate8(_mm256_mul_ps(load8_a8(true, hdr + 32 + h * 16),
                                           load8_i8(hdr + a.m_at + gi * 16 + h * 8)));
        }
      } else {
        const uint8_t* sp = hdr + (gh * 16 + h * 8) * elt;
        s[gh][h] = load8_a8(a.half_scales, sp);
        if (a.zeros) z[gh][h] = load8_a8(a.half_scales, sp + a.scale_bytes);
      }
      if (zero_term) z[gh][h] = _mm256_fnmadd_ps(_mm256_set1_ps(off), s[gh][h], z[gh][h]);
    }
  }
}

// Floats per scale slot in a vector's cache (sz): s and z' of a8_slot_avx2, [gh][h][s, z'][8].
constexpr int64_t kSlotFloats = 2 * 2 * 2 * 8;

// The scale slots of a vector: one per record of per-group records (a group, or a block of two
// g = 16 groups), one per block of 32 for super records.
inline int64_t a8_scale_slots(const A8Avx2Args& a) {
  const int64_t nb = a.k / 32;
  return a.supers ? nb : nb / a.blocks_per_record;
}

// out [MR rows][16 channels of vector vec] (acc): rows r0.. of (q, d, xs) times the vector's
// codes. The scales come from the records (SCALES_FROM_RECORDS: decoded and written to the
// vector's cache sz [slots][kSlotFloats], the first MR rows) or from sz (the rest). Decoded for
// every MR rows they took 41% of a 64-row Q4_K call's kernel time (TinyLlama's ffn_up, 1
// thread, Zen 3, perf annotate) against 40% in the int8 products; read back they make the call
// 1.2x faster (15.3 against 17.8 ms). A call of at most MR rows only decodes, in registers:
// every cache write and read there cost the 1-row call 1.3x (0.20 against 0.153 ms).
template <int MR, bool INT4, bool HALVES, bool NARROW, bool DECODE, bool CACHE>
void a8_vec_avx2(const A8Avx2Args& a, const int8_t* q, const float* d, const float* xs,
                 const int32_t* qs, float* sz, int64_t r0, int64_t vec,
                 float* acc /* [MR][16] */) {
  constexpr int64_t kBytes = INT4 ? 256 : 512;  // one vector's codes for one block of 32
  const int64_t nb = a.k / 32, nz = a.k / a.zgroup, bpr = a.blocks_per_record;
  const int64_t records = nb / bpr;
  const uint8_t* w = a.packed + vec * records * a.record;
  const bool zero_term = a8_zero_term<INT4>(a);
  const int8_t* qr[MR];
  for (int r = 0; r < MR; ++r) qr[r] = q + (r0 + r) * a.k;
  __m256 total[MR][2];
  for (int r = 0; r < MR; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  // NARROW: u - (128 - o) = c + o in every byte
  const __m256i base = _mm256_set1_epi8(static_cast<char>(128 - (NARROW ? a.narrow : 0)));
  for (int64_t rec = 0; rec < records; ++rec) {
    const uint8_t* hdr = w + rec * a.record;
    __m256 s[2][2], z[2][2];  // [group half (g = 16)][channel half]
    for (int64_t i = 0; i < bpr; ++i) {
      const int64_t kb = rec * bpr + i;
      // The scales (and zero terms) of this block's group(s): once per record of per-group
      // records, per block of super records; each group's zero term goes in before its
      // blocks' sums.
      if (a.supers || i == 0) {
        float* slot = CACHE || !DECODE ? sz + (a.supers ? kb : rec) * kSlotFloats : nullptr;
        if constexpr (DECODE) {
          a8_slot_avx2<INT4, HALVES>(a, hdr, i, s, z);
          if constexpr (CACHE) {
            for (int j = 0; j < (HALVES ? 4 : 2); ++j) {
              _mm256_storeu_ps(slot + j * 16, s[j / 2][j % 2]);
              _mm256_storeu_ps(slot + j * 16 + 8, z[j / 2][j % 2]);
            }
          }
        } else {
          for (int j = 0; j < (HALVES ? 4 : 2); ++j) {
            s[j / 2][j % 2] = _mm256_loadu_ps(slot + j * 16);
            z[j / 2][j % 2] = _mm256_loadu_ps(slot + j * 16 + 8);
          }
        }
        if (zero_term) {
          for (int gh = 0; gh < (HALVES ? 2 : 1); ++gh) {
            // xs's group: per 16 for g = 16 (two per block), else the record's (per-group) or
            // the block's (super records of g = 32)
            const int64_t zi = HALVES ? 2 * kb + gh : (a.supers ? kb : rec);
            for (int h = 0; h < 2; ++h) {
              for (int r = 0; r < MR; ++r) {
                const __m256 sum = _mm256_set1_ps(xs[(r0 + r) * nz + zi]);
                total[r][h] = _mm256_fmadd_ps(z[gh][h], sum, total[r][h]);
              }
            }
          }
        }
      }
      const uint8_t* codes = hdr + a.header + i * kBytes;
      const int8_t* qb[MR];
      for (int r = 0; r < MR; ++r) qb[r] = qr[r] + kb * 32;
      if constexpr (INT4 && !HALVES) {  // the same float operations, in the same order
        __m256i sums[MR][2];
        a8_block_int4_both<MR>(codes, qb, sums);
        for (int h = 0; h < 2; ++h) {
          for (int r = 0; r < MR; ++r) {
            const __m256 db = _mm256_set1_ps(d[(r0 + r) * nb + kb]);
            const __m256 flo = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r][h]), db);
            total[r][h] = _mm256_fmadd_ps(flo, s[0][h], total[r][h]);
          }
        }
        continue;
      }
      __m256i off_lo[MR], off_hi[MR];  // NARROW: o * sum(q) of the block's halves (or whole)
      if constexpr (NARROW) {
        for (int r = 0; r < MR; ++r) {
          const int32_t* s16 = qs + (r0 + r) * (a.k / 16) + 2 * kb;
          off_lo[r] = _mm256_set1_epi32(a.narrow * (HALVES ? s16[0] : s16[0] + s16[1]));
          off_hi[r] = _mm256_set1_epi32(a.narrow * s16[1]);
        }
      }
      if constexpr (NARROW) {  // the same float operations, in the same order
        __m256i lo[MR][2], hi[MR][2];
        a8_block_narrow_both<MR, HALVES>(codes, qb, base, lo, hi);
        for (int h = 0; h < 2; ++h) {
          for (int r = 0; r < MR; ++r) {
            const __m256 db = _mm256_set1_ps(d[(r0 + r) * nb + kb]);
            const __m256i clo = _mm256_sub_epi32(lo[r][h], off_lo[r]);
            total[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(clo), db), s[0][h],
                                          total[r][h]);
            if constexpr (HALVES) {
              const __m256i chi = _mm256_sub_epi32(hi[r][h], off_hi[r]);
              total[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(chi), db), s[1][h],
                                            total[r][h]);
            }
          }
        }
        continue;
      }
      for (int h = 0; h < 2; ++h) {
        __m256i lo[MR], hi[MR];
        a8_block_avx2<MR, INT4, HALVES>(codes, h, qb, lo, hi);
        for (int r = 0; r < MR; ++r) {
          const __m256 db = _mm256_set1_ps(d[(r0 + r) * nb + kb]);
          const __m256 flo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo[r]), db);
          total[r][h] = _mm256_fmadd_ps(flo, s[0][h], total[r][h]);
          if constexpr (HALVES) {
            const __m256 fhi = _mm256_mul_ps(_mm256_cvtepi32_ps(hi[r]), db);
            total[r][h] = _mm256_fmadd_ps(fhi, s[1][h], total[r][h]);
          }
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(acc + r * 16, total[r][0]);
    _mm256_storeu_ps(acc + r * 16 + 8, total[r][1]);
  }
}

// One pass over vector vec for rows r0 .. r0 + mr (mr <= 4), with a8_vec_avx2's scale source.
template <bool INT4, bool HALVES, bool NARROW, bool DECODE, bool CACHE>
void a8_rows_avx2(const A8Avx2Args& a, const int8_t* q, const float* d, const float* xs,
                  const int32_t* qs, float* sz, int64_t r0, int64_t mr, int64_t vec, float* acc) {
  const auto pass = [&](auto rows) {
    a8_vec_avx2<decltype(rows)::value, INT4, HALVES, NARROW, DECODE, CACHE>(a, q, d, xs, qs, sz,
                                                                            r0, vec, acc);
  };
  switch (mr) {
    case 4: pass(std::integral_constant<int, 4>{}); break;
    case 3: pass(std::integral_constant<int, 3>{}); break;
    case 2: pass(std::integral_constant<int, 2>{}); break;
    default: pass(std::integral_constant<int, 1>{}); break;
  }
}

// x [m, K] (float32 or bf16) -> out [m, N] of the same dtype: each 16-channel vector for a
// block of rows, four at a time (the vector's records stay in L1 for the next four; its
// decoded scales, sz, for all but the first four), vectors split over threads. Blocks of rows
// whose int8 activations fit in 128 KB, so that they stay in L2 while every vector passes over
// them; one block per parallel region.
template <typename T, bool INT4, bool HALVES, bool NARROW = false>
void a8_run_avx2(const A8Avx2Args& a, const int8_t* q, const float* d, const float* xs,
                 const int32_t* qs, int64_t m, T* out) {
  const int64_t vecs = a.n / 16;
  // Vectors per task: enough that a small layer runs on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 16 * a.k));
  const int64_t block = std::max<int64_t>(4, ((1 << 17) / a.k) / 4 * 4);
  // Rows per pass over a vector's records: 2 for narrow codes (their two-quad sums keep more
  // values live; with both halves per broadcast, 4 measured the same: Q5_K ffn_up at 64 rows
  // 6.82 against 6.87 ms), else 4.
  constexpr int64_t kMR = NARROW ? 2 : 4;
  for (int64_t b0 = 0; b0 < m; b0 += block) {
    const int64_t b1 = std::min(m, b0 + block);
    at::parallel_for(0, vecs, grain, [&](int64_t begin, int64_t end) {
      float acc[4 * 16];
      std::vector<float> sz(b1 - b0 > kMR ? a8_scale_slots(a) * kSlotFloats : 0);
      for (int64_t v = begin; v < end; ++v) {
        for (int64_t r0 = b0; r0 < b1; r0 += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, b1 - r0);
          // one pass of rows: decode in registers; more: the first pass fills the cache
          const auto rows = [&](auto decode, auto cache) {
            a8_rows_avx2<INT4, HALVES, NARROW, decltype(decode)::value, decltype(cache)::value>(
                a, q, d, xs, qs, sz.data(), r0, mr, v, acc);
          };
          if (b1 - b0 <= kMR) {
            rows(std::true_type{}, std::false_type{});
          } else if (r0 == b0) {
            rows(std::true_type{}, std::true_type{});
          } else {
            rows(std::false_type{}, std::false_type{});
          }
          for (int64_t r = 0; r < mr; ++r)
            for (int c = 0; c < 16; ++c)
              out[(r0 + r) * a.n + v * 16 + c] = static_cast<T>(acc[r * 16 + c]);
        }
      }
    });
  }
}

template <typename T>
void quant_linear_a8_avx2(const A8Avx2Args& a, int64_t bits, bool halves, const T* x, int64_t m,
                          T* out) {
  std::vector<int8_t> q(m * a.k);
  std::vector<float> d(m * (a.k / 32)), xs(m * (a.k / a.zgroup));
  std::vector<int32_t> qs(m * (a.k / 16));
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows_avx2<T>(x, r0, r1, a.k, a.zgroup, q.data(), d.data(), xs.data(), qs.data());
  });
  const auto run = [&](auto int4, auto hv, auto narrow) {
    a8_run_avx2<T, decltype(int4)::value, decltype(hv)::value, decltype(narrow)::value>(
        a, q.data(), d.data(), xs.data(), qs.data(), m, out);
  };
  using F = std::false_type;
  using Tr = std::true_type;
  if (bits == 4) {
    halves ? run(Tr{}, Tr{}, F{}) : run(Tr{}, F{}, F{});
  } else if (a.narrow >= 0) {
    halves ? run(F{}, Tr{}, Tr{}) : run(F{}, F{}, Tr{});
  } else {
    halves ? run(F{}, Tr{}, F{}) : run(F{}, F{}, F{});
  }
}
