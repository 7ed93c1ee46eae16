// The AVX2 int8-activation path's activation side (quant_linear_a8_avx2.h): rows of x
// quantized to int8 blocks of 32 as the reference does (kvserve.quantization.qlinear.
// quantize_activations). Included by quant_linear_a8_avx2.h inside quant_linear_a8.cpp's
// anonymous namespace.
#pragma once

// 8 values of x at p as float32 (bf16 widened exactly: its bits shifted up by 16).
inline __m256 load8_x(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_x(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// Rows r0..r1 of x [M, K] (float32 or bf16) into int8 blocks of 32: q [M, K], d [M, K / 32],
// xs [M, K / zg] (sum of d * q per zgroup), qs [M, K / 16] (sum of q per 16, exact). The
// reference computes the same float32 values: inv = 127 / max|x| (a division), x * inv (one
// float32 product), rounded half to even
// (vcvtps2dq under the default rounding mode, as std::nearbyint). 8-wide: the scalar loop
// took 0.65 of 7.7 ms of a 64-row int4 call at N 5632, K 2048 (2 threads).
template <typename T>
void quantize_rows_avx2(const T* x, int64_t r0, int64_t r1, int64_t k, int64_t zg, int8_t* q,
                        float* d, float* xs, int32_t* qs) {
  const int64_t nb = k / 32, nz = k / zg;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lanes
  for (int64_t r = r0; r < r1; ++r) {
    std::fill(xs + r * nz, xs + (r + 1) * nz, 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = x + r * k + b * 32;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load8_x(xb + 8 * j);
      __m256 mx = _mm256_and_ps(v[0], abs_mask);
      for (int j = 1; j < 4; ++j) mx = _mm256_max_ps(mx, _mm256_and_ps(v[j], abs_mask));
      const float amax = hmax8(mx);
      const float dd = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i iv[4];
      for (int j = 0; j < 4; ++j) iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
      const __m256i w16 = _mm256_packs_epi32(iv[0], iv[1]), x16 = _mm256_packs_epi32(iv[2], iv[3]);
      const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * k + b * 32), b8);
      const int32_t s0 = hsum8_epi32(_mm256_add_epi32(iv[0], iv[1]));
      const int32_t s1 = hsum8_epi32(_mm256_add_epi32(iv[2], iv[3]));
      d[r * nb + b] = dd;
      qs[r * 2 * nb + 2 * b] = s0;
      qs[r * 2 * nb + 2 * b + 1] = s1;
      if (zg == 16) {
        xs[r * nz + 2 * b] = dd * static_cast<float>(s0);
        xs[r * nz + 2 * b + 1] = dd * static_cast<float>(s1);
      } else {
        xs[r * nz + b * 32 / zg] += dd * static_cast<float>(s0 + s1);
      }
    }
  }
}
