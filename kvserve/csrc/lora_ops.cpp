// Multi-LoRA deltas of a mixed batch in one call per adapted linear (punica's SGMV on a CPU).
//
// out[t, slice i] += (x[t] @ A[s_t]^T)[rank block i] @ Bt_i[s_t]   for every row t, s_t >= 0
//
// x [T, K], out [T, sum N_i] (the base linear's output, updated in place), A [S, n*R, K] (the
// n slices' A stacked along the rank), Bt_i [S, R, N_i] (B transposed: the expand is then an
// axpy over contiguous output channels, no horizontal sums), token_slots [T] int64 (-1: the
// base model only). The reference is kvserve.lora.punica.lora_delta_reference.
//
// Why a kernel: in PyTorch the delta is ~6 ops per active slot per linear (index_select,
// shrink, n expands, cat, index_add); with 4 adapters on the built-in model's 30 layers that
// is ~3000 op calls a decode step, which made 4 adapters cost 0.44x the base's tok/s (batch 4,
// AVX2 EPYC) while the multiply-adds are ~3% of the base's. Here rows are grouped by slot once
// per call (counting the slots), then:
//   shrink: per (slot, block of its rows, block of A rows) every row of the block is dotted
//           with the A rows, 4 rows x 2 A rows per register block; a row block is ~128 KB of
//           x, so it stays in L2 while the A rows pass (a 1024-row prefill group streamed x
//           from memory once per A pair before: slower than PyTorch's GEMM); h [T, n*R] f32;
//   expand: per (slot, slice, block of 64 output channels) every row of the slot adds
//           sum_r h[t, r] * Bt[r, cols], two rows at a time sharing each load of Bt, the
//           [R, 64] block of Bt staying in L1 across rows.
// Both phases run in one OpenMP team (a barrier between them) over their blocks, or on the
// calling thread when the call is small (kInlineWork); in float32 (bf16 and fp16
// widened in registers); a 16-bit out gets its sum added in float32 and rounded once.
// AVX-512 where built for it (16-wide, masked tails, 4 rows per expand block; a bf16 x
// against bf16 A shrinks by `vdpbf16ps` with AVX512-BF16, 32 exact products an instruction),
// else AVX2 + FMA (8-wide, 2 rows per expand block), else scalar loops. Measured on a 2-core
// AVX512-BF16 EPYC (Zen 5 kind), the built-in model's seven projections over 30 layers at 32
// decode rows on 4 adapters, rank 16, bf16, 2 threads (benchmarks/lora_kernel.py): 3.69 ms a
// step for the AVX2 build before the vectorized bf16 store_add, 2.92 ms for this AVX-512 one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVSERVE_LORA_AVX512 1
#if defined(__AVX512BF16__)
#define KVSERVE_LORA_DPBF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVSERVE_LORA_AVX2 1
#endif

namespace {

constexpr int kRowTile = 4;    // rows sharing one pass over an A row (shrink)
constexpr int kABlock = 2;     // A rows per pass (shrink): 4 x 2 accumulators
constexpr int64_t kColBlock = 64;  // output channels per expand task: 8 AVX2 accumulators
// Rows sharing each widened Bt load (expand): AVX2 2 (8 of its 16 registers accumulate),
// AVX-512 4 (16 of 32). 4 rows cut a 32-row, 4-adapter decode's kernel time ~15% on the
// AVX512-BF16 EPYC against 2 (benchmarks/lora_kernel.py).
#if defined(KVSERVE_LORA_AVX512)
constexpr int kExpandRows = 4;
#else
constexpr int kExpandRows = 2;
#endif
// Below this many multiply-adds a call runs on the calling thread (~15-25 us of work, about
// what waking the pool costs: a 4-row decode of a fused QKV is ~170K).
constexpr int64_t kInlineWork = int64_t{1} << 18;

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

#if defined(KVSERVE_LORA_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(KVSERVE_LORA_AVX512)
// 16 values widened to float32; lanes past `m` read as 0 (a masked load touches no memory
// there), so a row's tail needs no scalar loop.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
#endif
#if defined(KVSERVE_LORA_DPBF16)
inline __mmask32 mask32(int64_t left) {
  return left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left) - 1);
}
inline __m512bh load32bh(const c10::BFloat16* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
#endif

// h[rows[m], j0 + j] = dot(x[rows[m]], a[j0 + j]) for MR rows and NB A rows.
template <typename T, typename W, int MR, int NB>
void shrink_block(const T* x, int64_t ldx, const int64_t* rows, const W* a, int64_t k,
                  float* h, int64_t ldh, int64_t j0) {
  float sums[MR][NB];
  int64_t done = 0;
#if defined(KVSERVE_LORA_AVX512)
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
#if defined(KVSERVE_LORA_DPBF16)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<W, c10::BFloat16>) {
    for (int64_t i = 0; i < k; i += 32) {  // pairs of k per float32 lane
      const __mmask32 mk = mask32(k - i);  // all ones but in the tail
      __m512bh av[NB];
      for (int j = 0; j < NB; ++j) av[j] = load32bh(a + (j0 + j) * k + i, mk);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = load32bh(x + rows[m] * ldx + i, mk);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, av[j]);
      }
    }
  } else
#endif
  {
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 mk = mask16(k - i);
      __m512 av[NB];
      for (int j = 0; j < NB; ++j) av[j] = load16(a + (j0 + j) * k + i, mk);
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = load16(x + rows[m] * ldx + i, mk);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, av[j], acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) sums[m][j] = _mm512_reduce_add_ps(acc[m][j]);
  done = k;
#elif defined(KVSERVE_LORA_AVX2)
  __m256 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const int64_t k8 = k - k % 8;
  for (int64_t i = 0; i < k8; i += 8) {
    __m256 av[NB];
    for (int j = 0; j < NB; ++j) av[j] = load8(a + (j0 + j) * k + i);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = load8(x + rows[m] * ldx + i);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(xv, av[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) sums[m][j] = hsum(acc[m][j]);
  done = k8;
#else
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) sums[m][j] = 0.f;
#endif
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NB; ++j) {
      float s = sums[m][j];
      for (int64_t i = done; i < k; ++i) {
        s += widen(x[rows[m] * ldx + i]) * widen(a[(j0 + j) * k + i]);
      }
      h[rows[m] * ldh + j0 + j] = s;
    }
  }
}

// A rows [j0, j1) of one slot, against rows[0, n) of the slot (a block of them that stays in
// L2 while each pair of A rows passes over it).
template <typename T, typename W>
void shrink_task(const T* x, int64_t ldx, const int64_t* rows, int64_t n, const W* a, int64_t k,
                 float* h, int64_t ldh, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += kABlock) {
    const bool pair = j + kABlock <= j1;
    int64_t m = 0;
    for (; m + kRowTile <= n; m += kRowTile) {
      if (pair) {
        shrink_block<T, W, kRowTile, kABlock>(x, ldx, rows + m, a, k, h, ldh, j);
      } else {
        shrink_block<T, W, kRowTile, 1>(x, ldx, rows + m, a, k, h, ldh, j);
      }
    }
    for (; m < n; ++m) {
      if (pair) {
        shrink_block<T, W, 1, kABlock>(x, ldx, rows + m, a, k, h, ldh, j);
      } else {
        shrink_block<T, W, 1, 1>(x, ldx, rows + m, a, k, h, ldh, j);
      }
    }
  }
}

inline void store_add(float* out, const float* d, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] += d[c];
}

#if defined(KVSERVE_LORA_AVX512)
// out[0:n] = bf16(float(out) + d) for the whole vectors of n; returns how many were done.
inline int64_t store_add_bf16(c10::BFloat16* out, const float* d, int64_t n) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 sum = _mm512_add_ps(load16(out + c), _mm512_loadu_ps(d + c));
    const __m512i bits = _mm512_castps_si512(sum);  // round to nearest even, as c10 does
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(bias, odd)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q);  // c10's quiet NaN
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm512_cvtepi32_epi16(r));
  }
  return c;
}
#elif defined(KVSERVE_LORA_AVX2)
inline int64_t store_add_bf16(c10::BFloat16* out, const float* d, int64_t n) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 sum = _mm256_add_ps(load8(out + c), _mm256_loadu_ps(d + c));
    const __m256i bits = _mm256_castps_si256(sum);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, odd)), 16);
    const __m256 nan = _mm256_cmp_ps(sum, sum, _CMP_UNORD_Q);  // c10's quiet NaN
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                            _mm256_extracti128_si256(r, 1));  // < 2^16: exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), packed);
  }
  return c;
}
#endif
// A 16-bit out row gets its float32 sum added and rounded once (to nearest even, as
// c10's conversion). Vectorized for bf16: a scalar loop here cost more than the expand's
// multiply-adds at prefill sizes (one conversion pair per channel against R / 16 vector FMAs).
template <typename T>
inline void store_add(T* out, const float* d, int64_t n) {
  int64_t c = 0;
#if defined(KVSERVE_LORA_AVX512) || defined(KVSERVE_LORA_AVX2)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    c = store_add_bf16(out, d, n);
  }
#endif
  for (; c < n; ++c) out[c] = static_cast<T>(widen(out[c]) + d[c]);
}

#if defined(KVSERVE_LORA_AVX2)
// NR rows x 32 channels: acc[i][v] += h[row i, r] * bt[r, 8v..8v+7], each Bt load shared by
// the NR rows (2 rows: 8 accumulators, 4 loads and 2 broadcasts of 16 registers).
template <typename W, int NR>
inline void expand32(const float* const* hts, int64_t rank, const W* bt, int64_t n,
                     float* const* ds) {
  __m256 acc[NR][4];
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    __m256 b[4];
    for (int v = 0; v < 4; ++v) b[v] = load8(bt + r * n + 8 * v);
    for (int i = 0; i < NR; ++i) {
      const __m256 hb = _mm256_set1_ps(hts[i][r]);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_fmadd_ps(hb, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(ds[i] + 8 * v, acc[i][v]);
}
#endif

#if defined(KVSERVE_LORA_AVX512)
// NR rows x the first `width` (<= 64) channels: acc[i][v] += h[row i, r] * bt[r, 16v..16v+15],
// each Bt load shared by the NR rows; channels past `width` are masked off.
template <typename W, int NR, bool kFull>
inline void expand64(const float* const* hts, int64_t rank, const W* bt, int64_t n,
                     int64_t width, float* const* ds) {
  __m512 acc[NR][4];
  __mmask16 mk[4];
  for (int v = 0; v < 4; ++v) mk[v] = width > 16 * v ? mask16(width - 16 * v) : 0;
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    __m512 b[4];
    for (int v = 0; v < 4; ++v) {  // masked loads only in a slice's last, narrower block
      b[v] = kFull ? load16(bt + r * n + 16 * v) : load16(bt + r * n + 16 * v, mk[v]);
    }
    for (int i = 0; i < NR; ++i) {
      const __m512 hb = _mm512_set1_ps(hts[i][r]);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(hb, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(ds[i] + 16 * v, acc[i][v]);  // d: 64 wide
}
#endif

// out[t, c0:c1] += sum_r h[t, r0 + r] * bt[r, c0:c1] for every row t of one slot (c1 - c0 <=
// kColBlock); bt: this slot's [R, N] block of one slice, its [R, c1 - c0] part staying in L1.
template <typename T, typename W>
void expand_task(const float* h, int64_t ldh, int64_t r0, int64_t rank, const W* bt, int64_t n,
                 const std::vector<int64_t>& rows, T* out, int64_t ldo, int64_t col_off,
                 int64_t c0, int64_t c1) {
  alignas(64) float d[kExpandRows][kColBlock];
  const int64_t width = c1 - c0;
  const int64_t count = static_cast<int64_t>(rows.size());
  int64_t i = 0;
#if defined(KVSERVE_LORA_AVX512)
  for (; i < count; i += kExpandRows) {  // any width: 4 rows at a time, masked past the end
    const int nr = static_cast<int>(std::min<int64_t>(kExpandRows, count - i));
    const float* hts[kExpandRows];
    float* ds[kExpandRows];
    for (int j = 0; j < kExpandRows; ++j) {
      hts[j] = h + rows[i + std::min(j, nr - 1)] * ldh + r0;
      ds[j] = d[j];
    }
    if (width == kColBlock && nr == kExpandRows) {
      expand64<W, kExpandRows, true>(hts, rank, bt + c0, n, width, ds);
    } else if (nr == kExpandRows) {
      expand64<W, kExpandRows, false>(hts, rank, bt + c0, n, width, ds);
    } else if (nr == 1) {  // a slot's last rows
      expand64<W, 1, false>(hts, rank, bt + c0, n, width, ds);
    } else {
      expand64<W, 2, false>(hts, rank, bt + c0, n, width, ds);
      if (nr == 3) expand64<W, 1, false>(hts + 2, rank, bt + c0, n, width, ds + 2);
    }
    for (int j = 0; j < nr; ++j) store_add(out + rows[i + j] * ldo + col_off + c0, d[j], width);
  }
#elif defined(KVSERVE_LORA_AVX2)
  if (width == kColBlock) {  // full blocks: two rows at a time, 32 channels at a time
    for (; i < count; i += 2) {
      const int nr = i + 1 < count ? 2 : 1;
      const float* hts[2] = {h + rows[i] * ldh + r0, h + rows[i + nr - 1] * ldh + r0};
      for (int64_t c = 0; c < kColBlock; c += 32) {
        float* ds[2] = {d[0] + c, d[1] + c};
        if (nr == 2) {
          expand32<W, 2>(hts, rank, bt + c0 + c, n, ds);
        } else {
          expand32<W, 1>(hts, rank, bt + c0 + c, n, ds);
        }
      }
      for (int j = 0; j < nr; ++j) store_add(out + rows[i + j] * ldo + col_off + c0, d[j], width);
    }
  }
#endif
  for (; i < count; ++i) {  // a narrow block (a slice's tail), or no AVX2
    const float* ht = h + rows[i] * ldh + r0;
    int64_t c = 0;
#if defined(KVSERVE_LORA_AVX2)
    for (; c + 8 <= width; c += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t r = 0; r < rank; ++r) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(ht[r]), load8(bt + r * n + c0 + c), acc);
      }
      _mm256_store_ps(d[0] + c, acc);
    }
#endif
    for (; c < width; ++c) {
      float sum = 0.f;
      for (int64_t r = 0; r < rank; ++r) sum += ht[r] * widen(bt[r * n + c0 + c]);
      d[0][c] = sum;
    }
    store_add(out + rows[i] * ldo + col_off + c0, d[0], width);
  }
}

struct Task {  // one parallel unit of a phase
  int64_t slot;
  int64_t slice;  // expand: the slice; shrink: the first row (index into the slot's rows)
  int64_t begin, end;  // expand: output channels; shrink: A rows
  int64_t count;  // shrink: rows in the block
};

template <typename T, typename W>
void lora_add_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                    at::TensorList bts,
                    const std::vector<std::vector<int64_t>>& rows_of) {
  const int64_t t_rows = x.size(0), k = x.size(1), nr = a.size(1);
  const int64_t rank = bts[0].size(1);
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const W* ap = a.const_data_ptr<W>();
  T* op = out.data_ptr<T>();
  at::Tensor h = at::empty({t_rows, nr}, x.options().dtype(at::kFloat));
  float* hp = h.data_ptr<float>();
  // shrink: per slot, per block of its rows (~128 KB of x: it stays in L2 while the A rows
  // pass; a 1024-row prefill group otherwise streams x from memory once per pair of A rows),
  // per block of A rows (each task >= ATen's grain of multiply-adds); the tasks of one row
  // block are adjacent, so a thread's share keeps reusing its x block.
  const int64_t row_block = std::clamp<int64_t>((32768 / k) / kRowTile * kRowTile, kRowTile, 64);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(rows_of.size()); ++s) {
    const int64_t n = static_cast<int64_t>(rows_of[s].size());
    for (int64_t r = 0; r < n; r += row_block) {
      const int64_t rn = std::min(row_block, n - r);
      const int64_t step = std::max<int64_t>(
          kABlock, (at::internal::GRAIN_SIZE / (rn * k)) / kABlock * kABlock);
      for (int64_t j = 0; j < nr; j += step) {
        tasks.push_back({s, r, j, std::min(nr, j + step), rn});
      }
    }
  }
  // expand: per slot, slice and block of output channels
  std::vector<Task> expands;
  for (int64_t s = 0; s < static_cast<int64_t>(rows_of.size()); ++s) {
    if (rows_of[s].empty()) continue;
    for (int64_t i = 0; i < static_cast<int64_t>(bts.size()); ++i) {
      const int64_t n = bts[i].size(2);
      for (int64_t c = 0; c < n; c += kColBlock) {
        expands.push_back({s, i, c, std::min(n, c + kColBlock), 0});
      }
    }
  }
  std::vector<int64_t> offsets(bts.size(), 0);
  for (size_t i = 1; i < bts.size(); ++i) offsets[i] = offsets[i - 1] + bts[i - 1].size(2);
  auto shrink = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Task& tk = tasks[i];
      shrink_task<T, W>(xp, ldx, rows_of[tk.slot].data() + tk.slice, tk.count,
                        ap + tk.slot * nr * k, k, hp, nr, tk.begin, tk.end);
    }
  };
  auto expand = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Task& tk = expands[i];
      const at::Tensor& bt = bts[tk.slice];
      const int64_t n = bt.size(2);
      expand_task<T, W>(hp, nr, tk.slice * rank, rank, bt.const_data_ptr<W>() + tk.slot * rank * n,
                        n, rows_of[tk.slot], op, ldo, offsets[tk.slice], tk.begin, tk.end);
    }
  };
  const int64_t num_shrink = static_cast<int64_t>(tasks.size());
  const int64_t num_expand = static_cast<int64_t>(expands.size());
  int64_t active = 0;
  for (const auto& rows : rows_of) active += static_cast<int64_t>(rows.size());
  const int64_t work = active * (nr * k + rank * out.size(1));  // multiply-adds
  const int64_t threads = work < kInlineWork ? 1
      : std::min<int64_t>(at::get_num_threads(), std::max(num_shrink, num_expand));
  if (threads <= 1) {
    shrink(0, num_shrink);
    expand(0, num_expand);
    return;
  }
#if defined(_OPENMP)
  // One team for both phases, a barrier between them: half the wake-ups of two parallel_for
  // calls (each one a chance to wait for a descheduled teammate on a busy machine).
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
    shrink(num_shrink * id / nt, num_shrink * (id + 1) / nt);
#pragma omp barrier
    expand(num_expand * id / nt, num_expand * (id + 1) / nt);
  }
#else
  at::parallel_for(0, num_shrink, 1, shrink);
  at::parallel_for(0, num_expand, 1, expand);
#endif
}

template <typename T>
void dispatch_weights(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                      at::TensorList bts,
                      const std::vector<std::vector<int64_t>>& rows_of) {
  switch (a.scalar_type()) {
    case at::kFloat: return lora_add_typed<T, float>(out, x, a, bts, rows_of);
    case at::kBFloat16: return lora_add_typed<T, c10::BFloat16>(out, x, a, bts, rows_of);
    case at::kHalf: return lora_add_typed<T, c10::Half>(out, x, a, bts, rows_of);
    default: TORCH_CHECK(false, "lora_add: A and B must be float32, bfloat16 or float16");
  }
}

// See the file comment. token_slots [T] int64 (CPU); rows with slot -1 are left untouched.
void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a,
              at::TensorList bts, const at::Tensor& token_slots) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "lora_add: x must be a CPU [T, K] tensor with unit column stride");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1),
              "lora_add: A must be a contiguous [S, n*R, K] tensor");
  TORCH_CHECK(!bts.empty() && a.size(1) == static_cast<int64_t>(bts.size()) * bts[0].size(1),
              "lora_add: A's rows must be the n slices' ranks stacked (n * R)");
  int64_t total = 0;
  for (const at::Tensor& bt : bts) {
    TORCH_CHECK(bt.dim() == 3 && bt.is_contiguous() && bt.size(0) == a.size(0) &&
                    bt.size(1) == bts[0].size(1) && bt.scalar_type() == a.scalar_type(),
                "lora_add: every Bt must be a contiguous [S, R, N_i] tensor in A's dtype");
    total += bt.size(2);
  }
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == total && out.scalar_type() == x.scalar_type(),
              "lora_add: out must be [T, sum N_i] in x's dtype, with unit column stride");
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == x.size(0) &&
                  token_slots.scalar_type() == at::kLong && token_slots.is_contiguous(),
              "lora_add: token_slots must be a contiguous [T] int64 tensor");
  const int64_t slots = a.size(0);
  std::vector<std::vector<int64_t>> rows_of(slots);
  const int64_t* sp = token_slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(sp[t] >= -1 && sp[t] < slots, "lora_add: slot ", sp[t], " of row ", t,
                " is outside [-1, ", slots, ")");
    if (sp[t] >= 0) rows_of[sp[t]].push_back(t);
  }
  switch (x.scalar_type()) {
    case at::kFloat: return dispatch_weights<float>(out, x, a, bts, rows_of);
    case at::kBFloat16: return dispatch_weights<c10::BFloat16>(out, x, a, bts, rows_of);
    case at::kHalf: return dispatch_weights<c10::Half>(out, x, a, bts, rows_of);
    default: TORCH_CHECK(false, "lora_add: x must be float32, bfloat16 or float16");
  }
}

std::string lora_isa() {
#if defined(KVSERVE_LORA_DPBF16)
  return "avx512bf16";
#elif defined(KVSERVE_LORA_AVX512)
  return "avx512";
#elif defined(KVSERVE_LORA_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor[] bts, Tensor token_slots) -> ()");
  m.def("lora_isa() -> str", &lora_isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("lora_add", &lora_add); }
