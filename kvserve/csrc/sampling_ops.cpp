// Sampler kernels. apply_token_bitmask masks the tokens a grammar forbids (structured
// outputs) in place, reading xgrammar's packed int32 bitmask directly: bit j of word w is
// token 32 * w + j, set = allowed. The pure-PyTorch reference unpacks every bit into a bool
// [rows, V] tensor first (~20 ms for 32 rows of a 49152-token vocabulary on 2 busy cores,
// xgrammar's own CPU apply ~7 ms); this loop skips all-allowed words and writes only the
// forbidden tokens (< 1 ms).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kFloat,
              "logits must be a float32 CPU matrix with contiguous rows");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.scalar_type() == at::kInt,
              "bitmask must be a contiguous int32 CPU matrix");
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == at::kLong &&
                  rows.numel() == bitmask.size(0),
              "rows must be int64, one per bitmask row");
  const int64_t n = logits.size(1), words = bitmask.size(1), rs = logits.stride(0);
  TORCH_CHECK(words * 32 >= n, "the bitmask must cover the vocabulary");
  float* xp = logits.data_ptr<float>();
  const int32_t* bp = bitmask.const_data_ptr<int32_t>();
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < bitmask.size(0); ++g) {
    TORCH_CHECK(rp[g] >= 0 && rp[g] < logits.size(0), "row index out of range");
    float* row = xp + rp[g] * rs;
    const int32_t* mask = bp + g * words;
    for (int64_t w = 0; w < words; ++w) {
      uint32_t forbidden = ~static_cast<uint32_t>(mask[w]);
      const int64_t base = w * 32;
      if (forbidden == 0xFFFFFFFFu) {  // a whole word forbidden (most words, after `{`)
        std::fill(row + base, row + std::min(base + 32, n), neg_inf);
        continue;
      }
      while (forbidden != 0) {  // one iteration per forbidden token of this word
        const int64_t t = base + __builtin_ctz(forbidden);
        if (t >= n) break;  // bits past the vocabulary
        row[t] = neg_inf;
        forbidden &= forbidden - 1;
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
