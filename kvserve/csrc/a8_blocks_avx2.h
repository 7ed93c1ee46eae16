// The AVX2 int8-activation path's inner blocks (quant_linear_a8_avx2.h): one block of 32 k of
// a 16-channel vector's codes times MR rows of int8 activations, as exact int32 sums per
// channel. Included by quant_linear_a8_avx2.h inside quant_linear_a8.cpp's anonymous
// namespace, after bcast4_avx2.
#pragma once

// !SPLIT: the block's two 16-k sums as one, in lo.
template <int MR, bool SPLIT>
inline void fold_halves(__m256i lo[MR], const __m256i hi[MR]) {
  if constexpr (!SPLIT) {
    for (int r = 0; r < MR; ++r) lo[r] = _mm256_add_epi32(lo[r], hi[r]);
  }
}

// One block of 32 for MR rows and one 8-channel half h of a vector: the int32 sums of the
// block's first and second 16 k (lo, hi), or their total in lo when !SPLIT.
template <int MR, bool INT4, bool SPLIT>
inline void a8_block_avx2(const uint8_t* codes, int h, const int8_t* const* q, __m256i lo[MR],
                          __m256i hi[MR]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (INT4) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i a16[MR], b16[MR];
    for (int r = 0; r < MR; ++r) a16[r] = b16[r] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      const __m256i packed =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + t * 64 + h * 32));
      const __m256i wl = _mm256_and_si256(packed, low4);  // quad t
      const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);  // quad t + 4
      for (int r = 0; r < MR; ++r) {
        const __m256i pl = _mm256_maddubs_epi16(wl, bcast4_avx2(q[r] + 4 * t));
        const __m256i ph = _mm256_maddubs_epi16(wh, bcast4_avx2(q[r] + 16 + 4 * t));
        // two chains (first and second 16 k); summed once when !SPLIT: 8 * 3810 in int16
        a16[r] = _mm256_add_epi16(a16[r], pl);
        b16[r] = _mm256_add_epi16(b16[r], ph);
      }
    }
    for (int r = 0; r < MR; ++r) {
      if constexpr (SPLIT) {
        lo[r] = _mm256_madd_epi16(a16[r], ones);
        hi[r] = _mm256_madd_epi16(b16[r], ones);
      } else {
        lo[r] = _mm256_madd_epi16(_mm256_add_epi16(a16[r], b16[r]), ones);
      }
    }
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      const __m256i u =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + t * 64 + h * 32));
      const __m256i c = _mm256_xor_si256(u, flip);  // u - 128 = the code, as int8
      const __m256i ac = _mm256_abs_epi8(c);
      for (int r = 0; r < MR; ++r) {
        const __m256i sq = _mm256_sign_epi8(bcast4_avx2(q[r] + 4 * t), c);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ac, sq), ones);
        // two chains (first and second 16 k): half the dependent latency of one
        __m256i& sum = t < 4 ? lo[r] : hi[r];
        sum = _mm256_add_epi32(sum, p);
      }
    }
    fold_halves<MR, SPLIT>(lo, hi);
  }
}

// One block of 32 of narrow byte codes (after `base`, c + o in [0, 63]) for MR rows and both
// 8-channel halves of a vector: each row's int32 sums of (c + o) * q over the block's first
// and second 16 k (lo[r][h], hi[r][h]; their total in lo when !SPLIT; the caller takes
// o * sum(q) off): the same int32 sums as the sign trick's (a8_block_avx2<MR, false, SPLIT>),
// each broadcast of x feeding both halves. Against a one-half form that broadcast every quad
// twice, TinyLlama's Q5_K ffn_up (5632 x 2048, 2 threads, Zen 3) at 64 rows took 6.70-7.30
// against 8.37-11.5 ms and at 256 rows 26.5-28.9 against 33.1-45.1; Q6_K's split sums (g = 16)
// measured the same either way (19.7 against 20.1 ms at 64 rows, 1 thread, min of 5 rounds)
// and take this one form too. The second 16 k run after the first, so only one set of sums is
// updated at a time.
template <int MR, bool SPLIT>
inline void a8_block_narrow_both(const uint8_t* codes, const int8_t* const* q, __m256i base,
                                 __m256i lo[MR][2], __m256i hi[MR][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r) {
    lo[r][0] = lo[r][1] = hi[r][0] = hi[r][1] = _mm256_setzero_si256();
  }
  const auto load = [&](int at) {
    return _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + at)),
                           base);
  };
#pragma GCC unroll 1
  for (int t = 0; t < 8; t += 2) {  // two quads per int16 sum: 2 * 16002 <= 32767
    const __m256i u0 = load(t * 64), u1 = load(t * 64 + 32);  // quad t, halves 0 and 1
    const __m256i v0 = load(t * 64 + 64), v1 = load(t * 64 + 96);  // quad t + 1
    for (int r = 0; r < MR; ++r) {
      const __m256i q0 = bcast4_avx2(q[r] + 4 * t), q1 = bcast4_avx2(q[r] + 4 * t + 4);
      const __m256i p0 =
          _mm256_add_epi16(_mm256_maddubs_epi16(u0, q0), _mm256_maddubs_epi16(v0, q1));
      const __m256i p1 =
          _mm256_add_epi16(_mm256_maddubs_epi16(u1, q0), _mm256_maddubs_epi16(v1, q1));
      __m256i(&sum)[2] = SPLIT && t >= 4 ? hi[r] : lo[r];  // the first 16 k's or the second's
      sum[0] = _mm256_add_epi32(sum[0], _mm256_madd_epi16(p0, ones));
      sum[1] = _mm256_add_epi32(sum[1], _mm256_madd_epi16(p1, ones));
    }
  }
}

// One block of 32 of int4 codes for MR rows and both 8-channel halves of a vector: each row's
// int32 sums of the block (lo[r][h]), exactly a8_block_avx2<MR, true, false>'s, with each
// broadcast of x feeding both halves and one int16 accumulator per row and half (8 products of
// at most 3810 each). The two-call form kept 4 accumulators per row and spilled them at MR = 4
// (344 stack accesses in the unrolled loop, gcc 12); this one keeps 2 MR + 5 registers live.
template <int MR>
inline void a8_block_int4_both(const uint8_t* codes, const int8_t* const* q, __m256i lo[MR][2]) {
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256i a16[MR][2];
  for (int r = 0; r < MR; ++r) a16[r][0] = a16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int t = 0; t < 4; ++t) {
    const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + t * 64));
    const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + t * 64 + 32));
    const __m256i l0 = _mm256_and_si256(p0, low4), l1 = _mm256_and_si256(p1, low4);  // quad t
    for (int r = 0; r < MR; ++r) {
      const __m256i qb = bcast4_avx2(q[r] + 4 * t);
      a16[r][0] = _mm256_add_epi16(a16[r][0], _mm256_maddubs_epi16(l0, qb));
      a16[r][1] = _mm256_add_epi16(a16[r][1], _mm256_maddubs_epi16(l1, qb));
    }
    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(p0, 4), low4);  // quad t + 4
    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(p1, 4), low4);
    for (int r = 0; r < MR; ++r) {
      const __m256i qb = bcast4_avx2(q[r] + 16 + 4 * t);
      a16[r][0] = _mm256_add_epi16(a16[r][0], _mm256_maddubs_epi16(h0, qb));
      a16[r][1] = _mm256_add_epi16(a16[r][1], _mm256_maddubs_epi16(h1, qb));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r) {
    lo[r][0] = _mm256_madd_epi16(a16[r][0], ones);
    lo[r][1] = _mm256_madd_epi16(a16[r][1], ones);
  }
}
