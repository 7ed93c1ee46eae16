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
// The packed op also takes bf16 x with bf16 weights (a bf16 model on a CPU with AVX512-BF16):
// bf16 y, the products summed in float32 by vdpbf16ps on the same layout (packed_bf16 below,
// wide_packed_bf16.h).
//
// Weights packed at load (WideLinear; wide_linear_packed): [ceil(N / 16), K, 16], strips of
// 16 output channels with the 16 channels of each k contiguous, so up to kPackedDirectRows
// rows every call runs register tiles straight on the strips, widening as it loads
// (wide_packed_avx2.h: 6 rows x 16 channels, the last 1-5 rows over 2-4 strips; 256-K
// chunks; blocks of kPackedRowBlock rows). Every output is one FMA chain along K in k order
// whatever M: batch-invariant mode takes it at every row count. Above kPackedDirectRows a
// widened [N, K] copy goes to at::linear.
// One 2048 x 2048 bf16 linear, one thread, CPU time (min of 9, loaded 2-core AVX2 EPYC),
// [N, K] path below -> packed: 8 rows 1.42 -> 1.03 ms; 24: 3.40 -> 2.62; 32: 4.47 -> 3.80;
// 64: 7.17 -> 6.48; 128: 13.2 -> 13.0 (both near the core's FMA peak there).
//
// Plain [N, K] weights (wide_linear; batch-invariant mode's other layers, float32 weights
// too), three paths by row count M:
// * M < kPanelRows (decode at low concurrency): weight-stationary, W read once per block of 4
//   output channels and widened in registers for every row (memory-bound: half the bytes).
// * kPanelRows <= M <= kDirectRows (decode at high concurrency, short prefill chunks): panels,
//   64 channels x 256 of K widened once into a 64 KB float32 buffer laid out [k][16] per 16
//   channels, then every row through the register-blocked 6 x 16 FMA micro-kernel shared with
//   the quantized kernels (f32_micro_avx2.h). At 32 rows a step is compute-bound, and the
//   weight-stationary loop spends 12 widening uops per 8 FMAs in its inner loop; the panels
//   widen each weight once per step and run 12 FMAs per 2 loads and 6 broadcasts.
// * M > kDirectRows: a widened float32 copy of W goes to at::linear (oneDNN's GEMM).
//
// Batch-invariant mode (kvserve/ops/batch_invariant.py) calls it with direct_rows 0 and float32
// or bf16 weights too: every row through the weight-stationary loop (never the panels), whose
// per-output order never depends on the number of rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVSERVE_WIDE_AVX2 1
#endif
#if defined(KVSERVE_WIDE_AVX2) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <cstring>
#define KVSERVE_WIDE_BF16 1  // bf16 activations through vdpbf16ps (wide_packed_bf16.h)
#endif

namespace {

// Rows the kernel takes; more go through a widened copy (see the file comment). Measured on
// a TinyLlama-1.1B layer's four linears plus its LM head, bf16 weights (AMD EPYC, AVX2 only,
// 2 threads, medians): kernel / widened copy + F.linear / float32 weights in F.linear
//   1 row 11.3 / 248 / 27.0 ms; 16 rows 44.6 / 337 / 133; 128 rows 317 / 573 / 346;
//   256 rows 728 / 949 / 782; 512 rows 1507 / 1367 / 1012.
// The panels (kPanelRows below) against this weight-stationary loop, the same layer and head
// (benchmarks/wide_linear_ab.py linears, alternating in one process, medians of 5, on a shared
// machine at load average 12-13 on its 2 cores, so read the ratios, not the milliseconds):
//   1 thread:  16 rows 169 -> 177 ms (0.92x); 32 rows 328 -> 252 (1.17x faster);
//              64 rows 531 -> 402 (1.26x faster)
//   2 threads: 16 rows 213 -> 240 (0.84x); 32 rows 320 -> 320 (1.00x); 64 rows 783 -> 579
//              (1.35x faster); float32 weights in F.linear: 677, 1042, 1168 ms.
// Probed one-threaded beside it: 24 rows 339 -> 287 ms (1.18x faster). Again with the panels
// from 24 rows, load average ~10: 1 thread 24 rows 237 -> 219 ms, 32 rows 363 -> 298 (1.25x),
// 64 rows 654 -> 500 (1.32x); 2 threads 24 rows 1.11x, 32 rows 1.05x, 64 rows 1.28x faster.
// Each panel is widened (8 x 8 transposes) once per call, which is why few rows lose: at 1 row
// the panels took 141 ms against the loop's 51.
constexpr int64_t kDirectRows = 256;
// The packed op's float32 rows on its AVX2 tiles before the widened copy to at::linear: the
// tiles stream the strips as they lie and beat the copy (whose widening pass is ~40% of a
// call). One N 5632 x K 2048 bf16 layer, 2 threads, Zen 3 kind, min of 3 x 3 (ms, tiles /
// widened copy / float32 weights in F.linear): 256 rows 37.3 / - / 48.3; 384 61.8 / 93.0 /
// 65.3; 512 80.8 / 113.8 / 93.1; 1024 179.5 / 217.3 / 182.3; 2048 395.4 / 364.4 / 344.2.
// Past 512 rows a 256-K chunk of every row's x (1 KB a row) outgrew L2 while 4 strips
// passed over it, so the tiles now take rows in blocks of kPackedRowBlock, each block a pass
// over the weights; the same layer, min of 3 rounds alternating with the unblocked build
// (ms, blocked tiles / unblocked tiles / widened copy / float32 F.linear): 1024 rows 147.0 /
// 153.9 / - / 163.7; 2048 313.2 / 355.9 / 356.6 / 330.0; 4096 641.2 / 850.5 / 696.6 /
// 655.6. So the tiles take every prefill chunk up to 8192 rows (max_num_batched_tokens is
// 2048 by default); the copy is left for more, unmeasured.
#if defined(KVSERVE_WIDE_AVX2)
constexpr int64_t kPackedDirectRows = 8192;
#else
constexpr int64_t kPackedDirectRows = kDirectRows;  // the scalar sums: at::linear sooner
#endif
// Rows per pass of the packed op over the weights: a block's x chunk (512 rows x 256 K x 4
// bytes = 512 KB) stays in L2 while the panel's strips pass over it.
constexpr int64_t kPackedRowBlock = 512;
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

#include "f32_micro_avx2.h"  // micro_f32_avx2, rows_f32_avx2 (shared with quant_linear)

// 8 x 8 floats transposed in registers: r[i] holds row i, then r[j] holds column j.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}

// The panel of channels [n0, n0 + nv * 16) x K [k0, k0 + kc) widened into buf [nv][kc][16]
// (the micro-kernel's layout; channels at or past n are zeros).
template <typename W>
void widen_panel(const W* w, int64_t k, int64_t n, int64_t n0, int64_t nv, int64_t k0,
                 int64_t kc, float* buf) {
  for (int64_t g = 0; g < 2 * nv; ++g) {  // groups of 8 channels
    const int64_t c0 = n0 + 8 * g;
    float* dst = buf + (g / 2) * kc * 16 + (g % 2) * 8;  // [kc][16], this group's 8 lanes
    int64_t kk = 0;
    if (c0 + 8 <= n) {
      for (; kk + 8 <= kc; kk += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = load8(w + (c0 + i) * k + k0 + kk);
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (kk + j) * 16, r[j]);
      }
    }
    for (; kk < kc; ++kk) {
      for (int i = 0; i < 8; ++i) {
        dst[kk * 16 + i] = c0 + i < n ? widen(w[(c0 + i) * k + k0 + kk]) : 0.0f;
      }
    }
  }
}

constexpr int64_t kPanelVecs = 4;    // 16-channel vectors per panel: 64 output channels
constexpr int64_t kPanelK = 256;     // K per panel: 64 KB of float32, 16 KB per 16 channels
constexpr int64_t kPanelRows = 24;   // the fewest rows that take the panels (measured above)

// Panels [p0, p1) of every row: each 64-channel x 256-K panel widened once into buf, then
// every row's 16 channels at a time by the micro-kernel (6 rows x 16 channels of FMAs).
template <typename W>
void panels(const float* x, int64_t m, const W* w, int64_t k, float* y, int64_t n, int64_t p0,
            int64_t p1) {
  std::vector<float> buf(kPanelVecs * kPanelK * 16);
  std::vector<float> acc(m * kPanelVecs * 16);  // [m][width]
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanelVecs * 16;
    const int64_t nv = std::min(kPanelVecs, (n - n0 + 15) / 16), width = nv * 16;
    std::fill(acc.begin(), acc.begin() + m * width, 0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += kPanelK) {
      const int64_t kc = std::min(kPanelK, k - k0);
      widen_panel(w, k, n, n0, nv, k0, kc, buf.data());
      rows_f32_avx2(x + k0, k, m, buf.data(), kc, nv, acc.data());
    }
    const int64_t cols = std::min(width, n - n0);
    for (int64_t r = 0; r < m; ++r)
      std::copy(acc.data() + r * width, acc.data() + r * width + cols, y + r * n + n0);
  }
}

#endif

constexpr int64_t kStrip = 16;       // output channels per strip of the packed layout
constexpr int64_t kStripsPerPanel = 4;  // 64 channels per task and per accumulator block
// K per chunk: a strip's chunk is 8 KB of bf16 (stays in L1 across the 6-row passes). Chunks
// sized to keep every row's x in L1 too (64-256 by M) measured no faster (2048 x 2048, one
// thread, CPU time: 7.06 against 6.48 ms at 64 rows, 14.1 against 13.0 at 128).
constexpr int64_t kPackedK = 256;
#if defined(KVSERVE_WIDE_AVX2)
#include "wide_packed_avx2.h"  // micro_packed, rows_packed: the packed path's micro-kernels
#endif
#if defined(KVSERVE_WIDE_BF16)
#include "wide_packed_bf16.h"  // rows_bf16: the same layout times bf16 activations
#endif

// The packed weights' panels [p0, p1) (64 output channels each) of every row. Packed layout
// [ceil(N / 16)][K][16] (pack_wide_weight in kvserve/model/wide_linear.py); every output one
// chain along k in k order (wide_packed_avx2.h; the scalar build: one scalar sum in k order).
template <typename W>
void packed_panels(const float* x, int64_t m, const W* wp, int64_t k, float* y, int64_t n,
                   int64_t p0, int64_t p1) {
  const int64_t strips = (n + kStrip - 1) / kStrip, ldw = k * kStrip;
#if defined(KVSERVE_WIDE_AVX2)
  std::vector<float> acc(m * kStripsPerPanel * kStrip);  // [m][width]
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t s0 = p * kStripsPerPanel, nv = std::min(kStripsPerPanel, strips - s0);
    const int64_t width = nv * kStrip;
    std::fill(acc.begin(), acc.begin() + m * width, 0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += kPackedK) {
      const int64_t kc = std::min(kPackedK, k - k0);
      rows_packed(x + k0, k, m, wp + s0 * ldw + k0 * kStrip, ldw, kc, nv, acc.data());
    }
    const int64_t cols = std::min(width, n - s0 * kStrip);
    for (int64_t r = 0; r < m; ++r)
      std::copy(acc.data() + r * width, acc.data() + r * width + cols, y + r * n + s0 * kStrip);
  }
#else
  const int64_t c1 = std::min(n, p1 * kStripsPerPanel * kStrip);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = p0 * kStripsPerPanel * kStrip; c < c1; ++c) {
      const W* ws = wp + (c / kStrip) * ldw + c % kStrip;
      float s = 0.f;
      for (int64_t i = 0; i < k; ++i) s += x[r * k + i] * widen(ws[i * kStrip]);
      y[r * n + c] = s;
    }
  }
  (void)strips;
#endif
}

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

template <typename F>
void dispatch(const at::Tensor& w, F&& f) {
  if (w.scalar_type() == at::kBFloat16) {
    f(w.const_data_ptr<c10::BFloat16>());
  } else if (w.scalar_type() == at::kFloat) {
    f(w.const_data_ptr<float>());
  } else {
    f(w.const_data_ptr<c10::Half>());
  }
}

// x [M, K] float32, w [N, K] bf16, fp16 or float32, bias [N] float32 or none -> [M, N] float32.
// direct_rows: the most rows the kernel takes (-1: kDirectRows; benchmarks move it; 0: all,
// always on the weight-stationary path). panel_rows: the fewest rows that take the widened
// panels instead (-1: kPanelRows; more than direct_rows: never, the path before panels).
// On the weight-stationary path each output is one fixed sequence of operations (8-wide FMA
// sums along K, the same horizontal sum, the scalar tail, then the bias) whatever M, the row's
// place in its block of rows, the channel block or the thread; on the panel path it is one
// FMA chain along K (f32_micro_avx2.h), whatever M too. Either way a row's result never
// depends on the other rows' values; which path runs depends on M, so only direct_rows 0
// (batch-invariant mode) gives the same result for a row whatever M.
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias, int64_t direct_rows,
                       int64_t panel_rows) {
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
  const float* xp = xc.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(KVSERVE_WIDE_AVX2)
  const bool use_panels = direct_rows != 0 && m >= (panel_rows < 0 ? kPanelRows : panel_rows);
#else
  const bool use_panels = false;  // the scalar build has the weight-stationary loop only
#endif
  if (m > 0 && use_panels) {
#if defined(KVSERVE_WIDE_AVX2)
    // one panel (64 channels) per task at least: each is >= 64 x K x 8 rows of FMAs
    const int64_t count = (n + kPanelVecs * 16 - 1) / (kPanelVecs * 16);
    at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
      dispatch(w, [&](auto wp) { panels(xp, m, wp, k, yp, n, p0, p1); });
    });
#endif
  } else if (m > 0) {
    // Channels per task: at least ATen's grain of weights, so small layers stay on the
    // calling thread (waking the pool costs more than ~32K multiply-adds).
    const int64_t grain =
        std::max<int64_t>(kBlockN, at::internal::GRAIN_SIZE / std::max<int64_t>(1, k));
    const int64_t blocks = (n + kBlockN - 1) / kBlockN;
    at::parallel_for(0, blocks, (grain + kBlockN - 1) / kBlockN, [&](int64_t b0, int64_t b1) {
      const int64_t n0 = b0 * kBlockN, n1 = std::min(n, b1 * kBlockN);
      dispatch(w, [&](auto wp) { channels(xp, m, wp, k, yp, n, n0, n1); });
    });
  }
  if (bias.has_value()) {
    y.add_(*bias);  // after the sums
  }
  return y;
}

at::Tensor packed_bf16(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t direct_rows);

// The packed path's tasks: panels of kStripsPerPanel strips, at least ATen's grain of weights
// per task, so small layers stay on the calling thread (waking the pool costs more than ~32K
// multiply-adds).
int64_t panel_count(int64_t strips) { return (strips + kStripsPerPanel - 1) / kStripsPerPanel; }
int64_t panel_grain(int64_t k) {
  return std::max<int64_t>(
      1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, kStripsPerPanel * kStrip * k));
}

// x [M, K] float32, w [ceil(N / 16), K, 16] bf16 or fp16 (the packed layout), bias [N] float32
// or none, n = N -> [M, N] float32. direct_rows as wide_linear's (-1: kPackedDirectRows; 0:
// every row count here, batch-invariant mode). Every output is one sum along k in k order whatever
// M, so a row's result never depends on the other rows nor on their number, up to
// direct_rows; above it a widened [N, K] copy goes to at::linear.
// x bf16 (with bf16 w): bf16 [M, N], see packed_bf16.
at::Tensor wide_linear_packed(const at::Tensor& x, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias, int64_t n,
                              int64_t direct_rows) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "wide_linear_packed: x must be a float32 or bfloat16 [M, K] CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), strips = (n + kStrip - 1) / kStrip;
  TORCH_CHECK(n > 0 && w.dim() == 3 && w.is_contiguous() && w.size(0) == strips &&
                  w.size(1) == k && w.size(2) == kStrip,
              "wide_linear_packed: w must be a contiguous [ceil(N / 16), K, 16] tensor");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
              "wide_linear_packed: w must be bfloat16 or float16");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n,
                "wide_linear_packed: bias must be float32 [N]");
  }
  if (x.scalar_type() == at::kBFloat16) {
    return packed_bf16(x, w, bias, n, direct_rows);
  }
  if (direct_rows != 0 && m > (direct_rows < 0 ? kPackedDirectRows : direct_rows)) {
    at::Tensor wide = at::empty({strips * kStrip, k}, x.options());  // [N16, K] float32
    wide.view({strips, kStrip, k}).copy_(w.permute({0, 2, 1}));
    return at::linear(x, wide.slice(0, 0, n), bias);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r0 = 0; r0 < m; r0 += kPackedRowBlock) {
    const int64_t mb = std::min(kPackedRowBlock, m - r0);
    const float* xb = xp + r0 * k;
    float* yb = yp + r0 * n;
    at::parallel_for(0, panel_count(strips), panel_grain(k), [&](int64_t p0, int64_t p1) {
      if (w.scalar_type() == at::kBFloat16) {
        packed_panels(xb, mb, w.const_data_ptr<c10::BFloat16>(), k, yb, n, p0, p1);
      } else {
        packed_panels(xb, mb, w.const_data_ptr<c10::Half>(), k, yb, n, p0, p1);
      }
    });
  }
  if (bias.has_value()) {
    y.add_(*bias);  // after the sums
  }
  return y;
}

// x [M, K] bf16 times the packed bf16 weights -> [M, N] bf16: each output's products summed
// in float32 (vdpbf16ps, wide_packed_bf16.h), the float32 bias added, then rounded once. The
// build without AVX512-BF16 widens x and runs the float32 path (the same sums in another
// order; direct_rows as there).
// The kernel takes every row count, direct_rows or not: against an unpacked [N, K] bf16 copy
// through at::linear (oneDNN reorders it on every call) it measured 1.17x faster at 512 rows
// and 1.31x at 257, and 0.97x oneDNN's prepacked weights at 128-256 rows (22 TinyLlama-1.1B
// layers and the LM head, AMD EPYC Zen 5 kind, 2 threads, medians of 5; near this VM's
// 0.42 TFLOP/s bf16 peak from 32 rows on).
at::Tensor packed_bf16(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t direct_rows) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16,
              "wide_linear_packed: bfloat16 x needs bfloat16 weights");
#if defined(KVSERVE_WIDE_BF16)
  (void)direct_rows;
  const int64_t m = x.size(0), k = x.size(1), strips = (n + kStrip - 1) / kStrip;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const std::optional<at::Tensor> bc =
      bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  if (m > 0) {
    at::parallel_for(0, panel_count(strips), panel_grain(k), [&](int64_t p0, int64_t p1) {
      panels_bf16(xc.const_data_ptr<c10::BFloat16>(), m, w.const_data_ptr<c10::BFloat16>(), k,
                  bc.has_value() ? bc->const_data_ptr<float>() : nullptr,
                  y.data_ptr<c10::BFloat16>(), n, p0, p1, kStripsPerPanel, kPackedK);
    });
  }
  return y;
#else
  return wide_linear_packed(x.to(at::kFloat), w, bias, n, direct_rows).to(at::kBFloat16);
#endif
}

// What bf16 activations run on: "avx512bf16" (vdpbf16ps) or "float32" (widened).
std::string wide_linear_bf16_isa() {
#if defined(KVSERVE_WIDE_BF16)
  return "avx512bf16";
#else
  return "float32";
#endif
}

// The rows the kernel takes (the tests cover both sides of it).
int64_t wide_linear_direct_rows() { return kDirectRows; }

// The float32 rows the packed op's tiles take.
int64_t wide_linear_packed_direct_rows() { return kPackedDirectRows; }

// The fewest rows that take the widened panels (0 where the build has none: scalar).
int64_t wide_linear_panel_rows() {
#if defined(KVSERVE_WIDE_AVX2)
  return kPanelRows;
#else
  return 0;
#endif
}

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
  m.def(
      "wide_linear(Tensor x, Tensor w, Tensor? bias, int direct_rows=-1, int panel_rows=-1) "
      "-> Tensor");
  m.def("wide_linear_packed(Tensor x, Tensor w, Tensor? bias, int n, int direct_rows=-1) -> Tensor");
  m.def("wide_linear_panel_rows() -> int", &wide_linear_panel_rows);
  m.def("wide_linear_direct_rows() -> int", &wide_linear_direct_rows);
  m.def("wide_linear_packed_direct_rows() -> int", &wide_linear_packed_direct_rows);
  m.def("wide_linear_isa() -> str", &wide_linear_isa);
  m.def("wide_linear_bf16_isa() -> str", &wide_linear_bf16_isa);
}

TORCH_LIBRARY_IMPL(KVSERVE_NS, CPU, m) {
  m.impl("wide_linear", &wide_linear);
  m.impl("wide_linear_packed", &wide_linear_packed);
}
