// Paged decode attention for CPU: one query token per row, K/V read in place from the
// block-table cache instead of being gathered into a padded copy first. Scores, softmax and
// the weighted sum of V are kept in float32 whatever the cache dtype.
//
// Work is split into (row, kv head) items: the `group` query heads of a kv head (GQA) share
// every K/V row read. Two per-item implementations:
// - generic: ATen's Vectorized<float> (the Python loader compiles this file with the
//   CPU_CAPABILITY torch picked for this machine, so it is AVX-512/AVX2 wide), any dtype/dim;
// - bf16 on AVX512-BF16 CPUs, head_dim 64 or 128: one pass over the context 16 tokens at a
//   time with an online softmax; q.k with vdpbf16ps straight from the bf16 rows (a product
//   of two bf16 is exact in float32, so only the summation order differs), 16 sums reduced
//   at once, and the V accumulators in registers. ~2x faster than the generic one.
//
// Per-layer options (Mistral / Gemma 2 / Qwen sliding-window layers, Gemma 2's soft-cap):
// - window > 0: a row of length L attends to tokens max(0, L - window)..L - 1 only (Hugging
//   Face's sliding_window_overlay for the query at L - 1). Both paths start at that token:
//   whole blocks before it are never read, the block holding it is read from its offset on.
// - soft_cap > 0: each scaled score s becomes soft_cap * tanh(s / soft_cap) before the
//   softmax (Gemma 2's attn_logit_softcapping). The bf16 path takes it as a template
//   parameter, so without a soft-cap its inner loop is the one it always was.
// - sinks (float32 [H], gpt-oss's attention sinks): query head h's softmax denominator gains
//   exp(sinks[h] - max), the max taken over its scores and the sink; the sink has no value.
//   Items with sinks take the generic path (the bf16 one has no sinks).
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxGroup = 16;  // query heads per kv head the kernel accepts
constexpr float kInf = std::numeric_limits<float>::infinity();

// Pointers and sizes of one (row, kv head) item.
template <typename T>
struct HeadTask {
  const T* q[kMaxGroup];  // the group's query vectors, [d] each
  T* out[kMaxGroup];      // each query head's output, [d] each
  int64_t group;          // query heads sharing this kv head
  int64_t d;              // head_dim
  const T* k;             // K cache at (block 0, this kv head, offset 0)
  const T* v;             // V cache, same
  const int64_t* table;   // the row's block table
  int64_t block_size;     // tokens per block
  int64_t len;            // context tokens
  int64_t start;          // first token attended (sliding window; 0 = from the start)
  int64_t block_stride;   // elements from one block to the next (hkv * block_size * d)
  float scale;            // softmax scale
  float cap;              // soft-cap of the scores (0 = none)
  const float* sinks;     // the group's sink logits, [group] (nullptr = none)
};

// Asks the CPU to start loading this head's first `n` vectors of block `blk` (one
// contiguous run): blocks are scattered, so the hardware prefetcher cannot guess the next.
template <typename T>
inline void prefetch_block(const HeadTask<T>& t, const T* cache, int64_t blk, int64_t n) {
  const char* run = reinterpret_cast<const char*>(cache + t.table[blk] * t.block_stride);
  for (int64_t c = 0; c < n * t.d * static_cast<int64_t>(sizeof(T)); c += 64) {
    __builtin_prefetch(run + c, 0, 3);
  }
}

// Calls fn(p, row) for each attended context token p (t.start..t.len - 1), `row` pointing
// at its vector in `cache`. Walks block by block (a division per token costs more than a dot
// product), prefetching the next block while this one is computed on.
template <typename T, typename F>
inline void for_each_token(const HeadTask<T>& t, const T* cache, F&& fn) {
  const int64_t first = t.start / t.block_size;
  for (int64_t blk = first, b0 = first * t.block_size; b0 < t.len; b0 += t.block_size, ++blk) {
    const T* base = cache + t.table[blk] * t.block_stride;
    const int64_t n = std::min(t.block_size, t.len - b0);
    if (b0 + n < t.len) prefetch_block(t, cache, blk + 1, std::min(t.block_size, t.len - b0 - n));
    for (int64_t o = std::max<int64_t>(t.start - b0, 0); o < n; ++o) fn(b0 + o, base + o * t.d);
  }
}

inline float reduce_sum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// In place: s[p] = cap * tanh(s[p] / cap), transformers' order (divide, tanh, multiply).
inline void soft_cap_scores(float* s, int64_t n, float cap) {
  const Vec capv(cap);
  int64_t p = 0;
  for (; p + Vec::size() <= n; p += Vec::size()) {
    ((Vec::loadu(s + p) / capv).tanh() * capv).store(s + p);
  }
  for (; p < n; ++p) s[p] = std::tanh(s[p] / cap) * cap;
}

// In place over each of the group's score rows: s[p] = exp(s[p] - max); inv[g] = 1 / sum.
// With sinks, sink g joins the max and the sum as one more score (and gets no slot in s).
inline void softmax_numerators(float* scores, int64_t group, int64_t len, float* inv,
                               const float* sinks) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float mx = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < len; ++p) mx = std::max(mx, s[p]);
    const Vec mxv(mx);
    Vec sumv(0.f);
    int64_t p = 0;
    for (; p + Vec::size() <= len; p += Vec::size()) {
      Vec e = (Vec::loadu(s + p) - mxv).exp_u20();
      e.store(s + p);
      sumv = sumv + e;
    }
    float sum = reduce_sum(sumv);
    if (sinks) sum += std::exp(sinks[g] - mx);
    for (; p < len; ++p) {
      s[p] = std::exp(s[p] - mx);
      sum += s[p];
    }
    inv[g] = 1.f / sum;
  }
}

// Widen `d` elements to float (d % Vec::size() == 0). bf16 -> float is exact.
inline void load_row(const float* src, float* dst, int64_t d) { std::copy(src, src + d, dst); }
inline void load_row(const c10::BFloat16* src, float* dst, int64_t d) {
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  for (int64_t i = 0; i < d; i += BVec::size()) {
    const int64_t n = std::min<int64_t>(BVec::size(), d - i);  // never read past the row
    auto [lo, hi] = at::vec::convert_to_float<c10::BFloat16>(BVec::loadu(src + i, n));
    lo.store(dst + i);
    if (i + Vec::size() < d) hi.store(dst + i + Vec::size());
  }
}

// Scratch of one thread for head_generic: scaled float queries, accumulators, one row, scores.
struct Scratch {
  std::vector<float> qf, acc, row;
  std::vector<float> scores;  // [group * len]: scores, then softmax numerators
};

template <typename T>
void head_generic(const HeadTask<T>& t, Scratch& w) {
  const int64_t d = t.d, len = t.len - t.start;  // len: tokens attended
  w.qf.resize(t.group * d);
  w.acc.assign(t.group * d, 0.f);
  w.row.resize(d);
  w.scores.resize(t.group * len);
  float* scores = w.scores.data();
  float *qf = w.qf.data(), *acc = w.acc.data(), *row = w.row.data();
  for (int64_t g = 0; g < t.group; ++g) {
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = static_cast<float>(t.q[g][i]) * t.scale;
  }
  for_each_token(t, t.k, [&](int64_t p, const T* k) {  // scores[g, p] = q_g . k_p
    load_row(k, row, d);
    for (int64_t g = 0; g < t.group; ++g) {
      Vec s(0.f);
      for (int64_t i = 0; i < d; i += Vec::size()) {
        s = at::vec::fmadd(Vec::loadu(qf + g * d + i), Vec::loadu(row + i), s);
      }
      scores[g * len + p - t.start] = reduce_sum(s);
    }
  });
  if (t.cap > 0.f) soft_cap_scores(scores, t.group * len, t.cap);
  float inv[kMaxGroup];
  softmax_numerators(scores, t.group, len, inv, t.sinks);
  for_each_token(t, t.v, [&](int64_t p, const T* v) {  // acc[g] = sum_p w[g, p] * v_p
    load_row(v, row, d);
    for (int64_t g = 0; g < t.group; ++g) {
      const Vec wv(scores[g * len + p - t.start]);
      float* a = acc + g * d;
      for (int64_t i = 0; i < d; i += Vec::size()) {
        at::vec::fmadd(wv, Vec::loadu(row + i), Vec::loadu(a + i)).store(a + i);
      }
    }
  });
  for (int64_t g = 0; g < t.group; ++g) {
    for (int64_t i = 0; i < d; ++i) t.out[g][i] = static_cast<T>(acc[g * d + i] * inv[g]);
  }
}

#if defined(__AVX512BF16__)
// Sums of each of 16 vectors, as one vector: r[j] = sum of a[j]'s lanes. A transpose-and-add
// tree: ~3 instructions per sum instead of ~8 for a horizontal reduction each.
inline __m512 hsum16(const __m512* a) {
  __m512 s8[8], s4[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                          _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum of a, b, c, d
    const __m512d x = _mm512_castps_pd(s8[2 * i]), y = _mm512_castps_pd(s8[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], 0x88),
                                   _mm512_shuffle_f32x4(s4[0], s4[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], 0x88),
                                   _mm512_shuffle_f32x4(s4[2], s4[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88),
                       _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// bf16 -> float without widening instructions: each 32-bit lane of a 32-element load holds
// an even element in its low half and an odd one in its high half, so shifting left by 16
// gives the even elements as floats and masking the low half the odd ones.
inline void widen_even_odd(const c10::BFloat16* src, __m512* out) {
  const __m512i raw = _mm512_loadu_si512(src);
  out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  out[1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(0xFFFF0000)));
}

// The inverse: 32 elements from their even and odd halves, each rounded to nearest even (as
// static_cast<BFloat16> rounds), back in element order.
inline void store_even_odd(__m512 even, __m512 odd, c10::BFloat16* dst) {
  const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
  const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
  _mm512_storeu_si512(dst, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
}

// One pass over the context, 16 tokens at a time, with an online softmax (running max and
// sum per query head), so each K and V run is read once, while it is in L1. The V
// accumulators hold even/odd halves (see widen_even_odd): acc[g][2c] has elements 32c + 2l,
// acc[g][2c + 1] elements 32c + 2l + 1. The first block read is the one holding t.start,
// from that offset on; kCap applies the soft-cap t.cap to each chunk's scores.
template <int D, bool kCap>
void head_bf16(const HeadTask<c10::BFloat16>& t) {
  static_assert(D % 32 == 0, "head_dim");
  constexpr int NQ = D / 32, NV = D / 16;
  const int64_t group = t.group;
  __m512i qv[kMaxGroup][NQ];
  __m512 acc[kMaxGroup][NV];
  float mx[kMaxGroup], sum[kMaxGroup];
  alignas(64) float p[kMaxGroup][16];
  for (int64_t g = 0; g < group; ++g) {
    for (int i = 0; i < NQ; ++i) qv[g][i] = _mm512_loadu_si512(t.q[g] + 32 * i);
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_setzero_ps();
    mx[g] = -kInf;
    sum[g] = 0.f;
  }
  const __m512 scale = _mm512_set1_ps(t.scale);
  [[maybe_unused]] const Vec cap(t.cap);
  const int64_t first = t.start / t.block_size;
  for (int64_t blk = first, b0 = first * t.block_size; b0 < t.len; b0 += t.block_size, ++blk) {
    const int64_t n_blk = std::min(t.block_size, t.len - b0);
    const int64_t off = t.table[blk] * t.block_stride;
    if (b0 + n_blk < t.len) {
      const int64_t nn = std::min(t.block_size, t.len - b0 - n_blk);
      prefetch_block(t, t.k, blk + 1, nn);
      prefetch_block(t, t.v, blk + 1, nn);
    }
    for (int64_t c0 = std::max<int64_t>(t.start - b0, 0); c0 < n_blk; c0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, n_blk - c0));
      const c10::BFloat16* kb = t.k + off + c0 * D;
      const c10::BFloat16* vb = t.v + off + c0 * D;
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t g = 0; g < group; ++g) {
        __m512 a[16];
        for (int j = 0; j < 16; ++j) {
          a[j] = _mm512_setzero_ps();
          if (j < n) {
            for (int i = 0; i < NQ; ++i) {
              a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)qv[g][i],
                                      (__m512bh)_mm512_loadu_si512(kb + j * D + 32 * i));
            }
          }
        }
        __m512 s = _mm512_mul_ps(hsum16(a), scale);
        if constexpr (kCap) s = (Vec(s) / cap).tanh() * cap;
        s = _mm512_mask_mov_ps(_mm512_set1_ps(-kInf), valid, s);  // past the chunk's end
        const float m_new = std::max(mx[g], _mm512_reduce_max_ps(s));
        const __m512 e = Vec(_mm512_sub_ps(s, _mm512_set1_ps(m_new))).exp_u20();
        const float corr = std::exp(mx[g] - m_new);  // 0 on the first chunk (mx = -inf)
        sum[g] = sum[g] * corr + _mm512_reduce_add_ps(e);
        mx[g] = m_new;
        const __m512 cv = _mm512_set1_ps(corr);
        for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], cv);
        _mm512_store_ps(p[g], e);
      }
      for (int j = 0; j < n; ++j) {  // acc[g] += p[g, j] * v_j
        __m512 vf[NV];
        for (int c = 0; c < NV / 2; ++c) widen_even_odd(vb + j * D + 32 * c, vf + 2 * c);
        for (int64_t g = 0; g < group; ++g) {
          const __m512 w = _mm512_set1_ps(p[g][j]);
          for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(w, vf[i], acc[g][i]);
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m512 s = _mm512_set1_ps(1.f / sum[g]);
    for (int c = 0; c < NV / 2; ++c) {
      store_even_odd(_mm512_mul_ps(acc[g][2 * c], s), _mm512_mul_ps(acc[g][2 * c + 1], s),
                     t.out[g] + 32 * c);
    }
  }
}
#endif

template <typename T>
void run_head(const HeadTask<T>& t, Scratch& w) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (t.sinks) return head_generic(t, w);
    const bool cap = t.cap > 0.f;
    if (t.d == 64) return cap ? head_bf16<64, true>(t) : head_bf16<64, false>(t);
    if (t.d == 128) return cap ? head_bf16<128, true>(t) : head_bf16<128, false>(t);
  }
#endif
  head_generic(t, w);
}

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& rows, double scale,
                   int64_t window, double soft_cap, const float* sinks) {
  const int64_t num_rows = block_tables.size(0), table_stride = block_tables.stride(0);
  const int64_t hkv = k_cache.size(1), bs = k_cache.size(2), d = k_cache.size(3);
  const int64_t group = q.size(1) / hkv;
  const T* qp = q.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();
  const int64_t* row_idx = rows.numel() ? rows.const_data_ptr<int64_t>() : nullptr;

  // Each item reads its head's contiguous run in each of the row's blocks. Tiny batches (less
  // than ATen's grain of K/V elements in all) stay on the calling thread: waking the pool
  // costs more than the work.
  int64_t total = 0;
  for (int64_t r = 0; r < num_rows; ++r) total += window > 0 ? std::min(lens[r], window) : lens[r];
  const int64_t items = num_rows * hkv;
  const int64_t grain = total * hkv * d * 2 < at::internal::GRAIN_SIZE ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    HeadTask<T> t{};
    t.group = group;
    t.d = d;
    t.block_size = bs;
    t.block_stride = hkv * bs * d;
    t.scale = static_cast<float>(scale);
    t.cap = static_cast<float>(soft_cap);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / hkv, kh = item % hkv;
      const int64_t tok = row_idx ? row_idx[r] : r;
      t.sinks = sinks ? sinks + kh * group : nullptr;
      for (int64_t g = 0; g < group; ++g) {
        t.q[g] = qp + tok * q.stride(0) + (kh * group + g) * q.stride(1);
        t.out[g] = op + tok * out.stride(0) + (kh * group + g) * out.stride(1);
      }
      t.k = k_cache.const_data_ptr<T>() + kh * bs * d;
      t.v = v_cache.const_data_ptr<T>() + kh * bs * d;
      t.table = tables + r * table_stride;
      t.len = lens[r];
      t.start = window > 0 ? std::max<int64_t>(lens[r] - window, 0) : 0;
      run_head(t, scratch);
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, double scale,
                            int64_t window, double soft_cap,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "K and V caches must have one shape");
  TORCH_CHECK(k_cache.size(3) % Vec::size() == 0, "head_dim must be a multiple of ", Vec::size());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables layout");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.numel() == block_tables.size(0), "seq_lens");
  TORCH_CHECK(rows.numel() == 0 || (rows.numel() == block_tables.size(0) &&
                                    rows.is_contiguous() && rows.scalar_type() == at::kLong),
              "rows");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(1) / k_cache.size(1) <= kMaxGroup, "at most ", kMaxGroup,
              " heads per kv head");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && out.sizes() == q.sizes(), "q/out/cache shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, cache and out must share a dtype");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(soft_cap >= 0, "soft_cap must be >= 0 (0: none), got ", soft_cap);
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == q.size(1),
                "sinks must be a contiguous float32 tensor of one logit per query head");
    sink_ptr = sinks->const_data_ptr<float>();
  }
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(out, q, k_cache, v_cache, block_tables, seq_lens, rows, scale, window,
                         soft_cap, sink_ptr);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, rows, scale,
                                 window, soft_cap, sink_ptr);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor rows, float scale, int window, "
      "float soft_cap, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
