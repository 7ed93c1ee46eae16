// Linear layers whose weights are stored in 16 bits (bf16 or fp16) and computed in float32:
// y[M, N] = x[M, K] @ W[N, K]^T (+ b), x and y float32, W widened to float32 in registers.
//
// Why: on CPUs without bf16 arithmetic (AVX2-only: AMD EPYC Rome/Milan, older Xeons) kvserve
// computes in float32, and a decode step is paid in bytes of weights read: float32 weights
// cost 4 bytes each, a 16-bit copy 2. llama.cpp keeps F16/BF16 weights and widens them in
// registers on such CPUs for the same reason. The widening is exact (every bf16 and fp16 value
// is a float32 value), so this computes the product of the stored weights exactly as
// F.linear(x, W.float()) does, summed in another order (the pure-PyTorch reference
// kvserve.model.wide_linear.reference_wide_linear; tests hold the two within float32 rounding).
//
// Up to kDirectRows rows (decode, short prefill chunks) this kernel reads W once per block of 4
// output channels and applies it to every row; above, a widened float32 copy of W goes to
// at::linear, whose GEMM beats a weight-stationary loop once the copy is shared by enough rows.
//
// Batch-invariant mode (kvserve/ops/batch_invariant.py) calls it with direct_rows 0 and float32
// or bf16 weights too: every row through the kernel, whose per-output order never depends on
// the number of rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVSERVE_WIDE_AVX2 1
#endif

namespace {

// Rows the kernel takes; more go through a widened copy (see the file comment). Measured on
// a TinyLlama-1.1B layer's four linears plus its LM head, bf16 weights (AMD EPYC, AVX2 only,
// 2 threads, medians): kernel / widened copy + F.linear / float32 weights in F.linear
//   1 row 11.3 / 248 / 27.0 ms; 16 rows 44.6 / 337 / 133; 128 rows 317 / 573 / 346;
//   256 rows 728 / 949 / 782; 512 rows 1507 / 1367 / 1012.
constexpr int64_t kDirectRows = 256;
constexpr int64_t kBlockN = 4;  // output channels that share one pass over a row of x

template <typename W>
inline float widen(W w) {
  return static_cast<float>(w);
}

#if defined(KVSERVE_WIDE_AVX2)
// 8 weights widened to float32: bf16 is the top half of a float32; fp16 through F16C.
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// NB output channels (NB <= kBlockN) x MR rows: acc[r][j] sums x[r, k] * w[j, k] 8 at a time.
template <typename W, int MR, int NB>
void block(const float* x, int64_t ldx, const W* w, int64_t k, float* y, int64_t ldy) {
  __m256 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t k8 = k - k % 8;
  for (int64_t i = 0; i < k8; i += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load8(w + j * k + i);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t i = k8; i < k; ++i) s += x[r * ldx + i] * widen(w[j * k + i]);
      y[r * ldy + j] = s;
    }
  }
}

template <typename W, int NB>
void rows(const float* x, int64_t m, const W* w, int64_t k, float* y, int64_t n) {
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) block<W, 2, NB>(x + r * k, k, w, k, y + r * n, n);
  if (r < m) block<W, 1, NB>(x + r * k, k, w, k, y + r * n, n);
}
#endif

// Output channels [n0, n1) of every row.
template <typename W>
void channels(const float* x, int64_t m, const W* w, int64_t k, float* y, int64_t n,
              int64_t n0, int64_t n1) {
#if defined(KVSERVE_WIDE_AVX2)
  int64_t j = n0;
  for (; j + kBlockN <= n1; j += kBlockN) rows<W, kBlockN>(x, m, w + j * k, k, y + j, n);
  for (; j < n1; ++j) rows<W, 1>(x, m, w + j * k, k, y + j, n);
#else
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = n0; j < n1; ++j) {
      float s = 0.f;
      for (int64_t i = 0; i < k; ++i) s += x[r * k + i] * widen(w[j * k + i]);
      y[r * n + j] = s;
    }
  }
#endif
}

// x [M, K] float32, w [N, K] bf16, fp16 or float32, bias [N] float32 or none -> [M, N] float32.
// direct_rows: the most rows the kernel takes (-1: kDirectRows; benchmarks move it; 0: all).
// Each output is one fixed sequence of operations (8-wide FMA sums along K, the same
// horizontal sum, the scalar tail, then the bias) whatever M, the row's place in its block of
// rows, the channel block or the thread: a row's result never depends on the other rows.
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias, int64_t direct_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "wide_linear: x must be a float32 [M, K] CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "wide_linear: w must be a contiguous [N, K] tensor");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf ||
                  w.scalar_type() == at::kFloat,
              "wide_linear: w must be bfloat16, float16 or float32");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == w.size(0),
                "wide_linear: bias must be float32 [N]");
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  // direct_rows 0: no limit (batch-invariant mode, kvserve/ops/batch_invariant.py: every row
  // is summed by this kernel in the same order whatever M is)
  if (direct_rows != 0 && m > (direct_rows < 0 ? kDirectRows : direct_rows)) {
    return at::linear(x, w.to(at::kFloat), bias);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0) {
    const float* xp = xc.const_data_ptr<float>();
    float* yp = y.data_ptr<float>();
    // Channels per task: at least ATen's grain of weights, so small layers stay on the
    // calling thread (waking the pool costs more than ~32K multiply-adds).
    const int64_t grain =
        std::max<int64_t>(kBlockN, at::internal::GRAIN_SIZE / std::max<int64_t>(1, k));
    const int64_t blocks = (n + kBlockN - 1) / kBlockN;
    at::parallel_for(0, blocks, (grain + kBlockN - 1) / kBlockN, [&](int64_t b0, int64_t b1) {
      const int64_t n0 = b0 * kBlockN, n1 = std::min(n, b1 * kBlockN);
      if (w.scalar_type() == at::kBFloat16) {
        channels(xp, m, w.const_data_ptr<c10::BFloat16>(), k, yp, n, n0, n1);
      } else if (w.scalar_type() == at::kFloat) {
        channels(xp, m, w.const_data_ptr<float>(), k, yp, n, n0, n1);
      } else {
        channels(xp, m, w.const_data_ptr<c10::Half>(), k, yp, n, n0, n1);
      }
    });
  }
  if (bias.has_value()) {
    y.add_(*bias);  // after the sums
  }
  return y;
}

// The rows the kernel takes (the tests cover both sides of it).
int64_t wide_linear_direct_rows() { return kDirectRows; }

// The instruction set the kernel was built for (benchmarks record it).
std::string wide_linear_isa() {
#if defined(KVSERVE_WIDE_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

// The op namespace: kvserve, or another where a test builds this file alone for a forced
// instruction set (tests/model/test_wide_linear_isa.py) beside the main build.
#ifndef KVSERVE_NS
#define KVSERVE_NS kvserve
#endif

TORCH_LIBRARY_FRAGMENT(KVSERVE_NS, m) {
  m.def("wide_linear(Tensor x, Tensor w, Tensor? bias, int direct_rows=-1) -> Tensor");
  m.def("wide_linear_direct_rows() -> int", &wide_linear_direct_rows);
  m.def("wide_linear_isa() -> str", &wide_linear_isa);
}

TORCH_LIBRARY_IMPL(KVSERVE_NS, CPU, m) { m.impl("wide_linear", &wide_linear); }
