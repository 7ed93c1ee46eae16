// Paged decode attention for CPU: one query token per row, K/V read in place from the
// block-table cache instead of being gathered into a padded copy first. Scores, softmax and
// the weighted sum of V are accumulated in float32 whatever the cache dtype (as SDPA does).
//
// Vector code uses ATen's Vectorized<float>; the Python loader compiles this file with the
// CPU_CAPABILITY torch itself picked for this machine, so Vectorized is AVX-512/AVX2 wide.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Widen `d` cache elements (d % Vec::size() == 0) to float. bf16 -> float is exact.
inline void load_row(const float* src, float* dst, int64_t d) { std::copy(src, src + d, dst); }
inline void load_row(const c10::BFloat16* src, float* dst, int64_t d) {
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  int64_t i = 0;
  for (; i + BVec::size() <= d; i += BVec::size()) {
    auto [lo, hi] = at::vec::convert_to_float<c10::BFloat16>(BVec::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + Vec::size());
  }
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t d) {
  Vec acc(0.f);
  for (int64_t i = 0; i < d; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

// acc[i] += w * v[i]
inline void axpy(float w, const float* v, float* acc, int64_t d) {
  const Vec wv(w);
  for (int64_t i = 0; i < d; i += Vec::size()) {
    at::vec::fmadd(wv, Vec::loadu(v + i), Vec::loadu(acc + i)).store(acc + i);
  }
}

// In place: s[p] = exp(s[p] - max); returns the sum.
inline float exp_and_sum(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < n; ++p) mx = std::max(mx, s[p]);
  const Vec mxv(mx);
  Vec sumv(0.f);
  int64_t p = 0;
  for (; p + Vec::size() <= n; p += Vec::size()) {
    Vec e = (Vec::loadu(s + p) - mxv).exp_u20();
    e.store(s + p);
    sumv = sumv + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sumv);
  for (; p < n; ++p) {
    s[p] = std::exp(s[p] - mx);
    sum += s[p];
  }
  return sum;
}

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& rows, double scale) {
  const int64_t num_rows = block_tables.size(0), table_stride = block_tables.stride(0);
  const int64_t bs = k_cache.size(1), hkv = k_cache.size(2), d = k_cache.size(3);
  const int64_t group = q.size(1) / hkv;  // query heads sharing one kv head (GQA)
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t slot_stride = hkv * d;  // elements between consecutive tokens of one head
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();
  const int64_t* row_idx = rows.numel() ? rows.const_data_ptr<int64_t>() : nullptr;
  const float fscale = static_cast<float>(scale);

  // A work item is one row and a chunk of its kv heads. Whole rows (all heads) when there are
  // enough rows to keep every thread busy: a token's K (or V) for all heads is one contiguous
  // run, so reading it whole streams through memory; one head at a time strides by
  // hkv * d elements and runs at a third of the bandwidth (measured).
  const int64_t heads_per_item = num_rows >= 2 * at::get_num_threads() ? hkv : 1;
  const int64_t chunks = hkv / heads_per_item;
  at::parallel_for(0, num_rows * chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t nh = heads_per_item * group;  // query heads of one item
    std::vector<float> qf(nh * d), acc(nh * d), row(heads_per_item * d), inv(nh), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / chunks, kh0 = (item % chunks) * heads_per_item;
      const int64_t tok = row_idx ? row_idx[r] : r;
      const int64_t len = lens[r];
      const int64_t* table = tables + r * table_stride;
      for (int64_t j = 0; j < nh; ++j) {  // query head kh0 * group + j, scaled, as float
        const T* src = qp + tok * q_row + (kh0 * group + j) * q_head;
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = static_cast<float>(src[i]) * fscale;
      }
      scores.resize(nh * len);
      // Walk block by block: a division per token costs more than the dot products.
      for (int64_t b0 = 0, blk = 0; b0 < len; b0 += bs, ++blk) {  // scores[j, p] = q_j . k_p
        const T* base = kp + table[blk] * bs * slot_stride + kh0 * d;
        for (int64_t p = b0; p < std::min(len, b0 + bs); ++p) {
          load_row(base + (p - b0) * slot_stride, row.data(), heads_per_item * d);
          for (int64_t j = 0; j < nh; ++j) {
            scores[j * len + p] = dot(qf.data() + j * d, row.data() + (j / group) * d, d);
          }
        }
      }
      for (int64_t j = 0; j < nh; ++j) inv[j] = 1.f / exp_and_sum(scores.data() + j * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b0 = 0, blk = 0; b0 < len; b0 += bs, ++blk) {  // acc[j] = sum_p w[j,p] v_p
        const T* base = vp + table[blk] * bs * slot_stride + kh0 * d;
        for (int64_t p = b0; p < std::min(len, b0 + bs); ++p) {
          load_row(base + (p - b0) * slot_stride, row.data(), heads_per_item * d);
          for (int64_t j = 0; j < nh; ++j) {
            axpy(scores[j * len + p], row.data() + (j / group) * d, acc.data() + j * d, d);
          }
        }
      }
      for (int64_t j = 0; j < nh; ++j) {
        T* dst = op + tok * o_row + (kh0 * group + j) * o_head;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[j * d + i] * inv[j]);
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(k_cache.size(3) % Vec::size() == 0, "head_dim must be a multiple of ", Vec::size());
  TORCH_CHECK(block_tables.stride(1) == 1 && block_tables.scalar_type() == at::kLong, "tables");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong, "seq_lens");
  TORCH_CHECK(rows.numel() == 0 || rows.numel() == block_tables.size(0), "rows");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, cache and out must share a dtype");
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(out, q, k_cache, v_cache, block_tables, seq_lens, rows, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, rows, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor rows, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
