// One MoE layer's routed experts in one call: kvserve.moe.experts.grouped_experts in C++.
//
// The step's T * k (token, expert) pairs are counting-sorted by expert (stable: each expert's
// rows keep token order), gathered once, and each expert that got tokens runs its gate/up
// projection, the activation and its down projection over all of its rows; each row's output
// is scaled by its routing weight and added to its token in expert order. No Python per
// expert: the grouped path's loop over the active experts cost ~3 ops x up to min(E, T * k)
// dispatches per layer (128 experts at a 32-sequence top-8 decode step).
//
// The matmuls are kvserve's own kernels, called through the dispatcher as
// decode_layers.cpp calls them (the very functions QuantLinear / WideLinear call):
//   quant (1):  kvserve::quant_linear     int8/int4 codes (pack_codes), x in the model dtype
//   a8 (0):     kvserve::quant_linear_a8  int8 activations (pack_a8)
//   wide (4):   kvserve::wide_linear      a dense expert ([N, K] float32, bf16 or fp16) with
//               float32 sums; bf16 x is widened exactly and the product rounded once to bf16
//               (packed bf16 experts: bf16 x straight into wide_linear_packed's vdpbf16ps)
// The activation: kvserve::silu_and_mul / gelu_tanh_and_mul, or gpt-oss's clamped SwiGLU as
// the same ATen op chain clamped_swiglu_and_mul runs (the same kernels, the same numbers).
//
// Rounding follows grouped_experts (and transformers): each projection's output is in the
// model dtype (a bias added to it there), the expert output times its weight (float32 math)
// is rounded to the model dtype, and each token's contributions are summed in float32 in
// expert order and rounded once to the model dtype (what index_add_ into zeros does). With the
// quantized kernels every number equals the PyTorch path's (the same kernel calls on the same
// rows); dense experts sum in wide_linear's order, not F.linear's (float32 within ~1e-6).
//
// Work split: an expert holding at least 1/threads of the step's rows runs alone, each kernel
// parallel over its output channels; the others run side by side, each thread taking the next
// expert (most rows first) with single-threaded kernels (a nested at::parallel_for runs
// inline). A decode step's experts hold a few rows each, too few to split one product well
// across threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernel_ops.h"  // LinearKind, op<Sig>, the kernels' signatures

namespace {

using namespace kvserve_ops;
enum ActKind : int64_t { kSilu = 0, kGeluTanh = 1, kClampedSwiglu = 2 };

struct Linear {
  LinearKind kind;
  at::Tensor w;       // quant: pack_codes' codes; a8: pack_a8's buffer; wide: the [N, K] weight
  at::Tensor scales;  // quant: [K / g, N] (else undefined)
  at::Tensor zeros;   // quant: [K / g, N] or empty
  int64_t out_features, bits, group, offset, direct_rows;
  int64_t scale_format;  // a8: quant_linear_a8's (0 float32, 1 float16, 2 super-blocks)
  bool has_zeros;
};


struct Ops {
  c10::TypedOperatorHandle<Act> silu_and_mul = op<Act>("kvserve::silu_and_mul");
  c10::TypedOperatorHandle<Act> gelu_tanh_and_mul =
      op<Act>("kvserve::gelu_tanh_and_mul");
  c10::TypedOperatorHandle<QuantA8> quant_a8 = op<QuantA8>("kvserve::quant_linear_a8");
  c10::TypedOperatorHandle<Quant> quant = op<Quant>("kvserve::quant_linear");
  c10::TypedOperatorHandle<Wide> wide = op<Wide>("kvserve::wide_linear");
  c10::TypedOperatorHandle<Wide> wide_packed = op<Wide>("kvserve::wide_linear_packed");
};

const Ops& ops() {
  static const Ops o;  // looked up once, after every library has registered
  return o;
}

// The step's pairs sorted by expert: order[i] is the flat (t * k + j) index of the i-th pair,
// experts' rows start at offsets[e]; pos[p] is pair p's place in the order.
struct Grouping {
  std::vector<int64_t> order, offsets, pos;
};

Grouping group_pairs(const at::Tensor& ids, int64_t num_experts) {
  const at::Tensor flat = ids.contiguous().to(at::kLong).view(-1);
  const int64_t* id = flat.const_data_ptr<int64_t>();
  const int64_t pairs = flat.numel();
  Grouping g{std::vector<int64_t>(pairs), std::vector<int64_t>(num_experts + 1, 0),
             std::vector<int64_t>(pairs)};
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "MoEExperts.run: expert id ", id[p],
                " out of range: the layer has ", num_experts);
    ++g.offsets[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {  // counting sort: stable
    const int64_t i = next[id[p]]++;
    g.order[i] = p;
    g.pos[p] = i;
  }
  return g;
}

// out[t] = the sum over t's pairs in expert order of T(ys[pos] * w), as `(ys * w).to(T)` then
// `zeros.index_add_(0, tokens, scaled)` compute it: index_add_ on bf16 adds in float32 and
// rounds each output once (checked against it: rounding after every add differs).
template <typename T>
void scatter(const at::Tensor& ys, const at::Tensor& w, const Grouping& g, int64_t k,
             at::Tensor& out) {
  const int64_t t = out.size(0), h = out.size(1);
  const T* yp = ys.const_data_ptr<T>();
  const float* wp = w.const_data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, t, std::max<int64_t>(1, at::internal::GRAIN_SIZE / (k * h + 1)),
                   [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> rows(k);
    std::vector<float> acc(h);
    for (int64_t tok = t0; tok < t1; ++tok) {
      for (int64_t j = 0; j < k; ++j) rows[j] = g.pos[tok * k + j];
      std::sort(rows.begin(), rows.end());  // expert order (then slot order), as the sort's
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i : rows) {
        const float wt = wp[g.order[i]];
        const T* y = yp + i * h;
        for (int64_t c = 0; c < h; ++c) {
          acc[c] += static_cast<float>(static_cast<T>(static_cast<float>(y[c]) * wt));
        }
      }
      T* o = op + tok * h;
      for (int64_t c = 0; c < h; ++c) o[c] = static_cast<T>(acc[c]);
    }
  });
}

class MoEExperts : public torch::CustomClassHolder {
 public:
  // act: 0 SiLU(gate) * up, 1 GELU-tanh(gate) * up, 2 gpt-oss's clamped SwiGLU (alpha, limit)
  MoEExperts(int64_t act, double alpha, double limit) : act_(act), alpha_(alpha), limit_(limit) {
    TORCH_CHECK(act >= kSilu && act <= kClampedSwiglu, "MoEExperts: unknown activation ", act);
  }

  // One projection, appended: expert e's gate/up is linear 2e, its down 2e + 1. kind 0 (a8):
  // w = pack_a8's buffer; 1 (quant): w = codes, scales/zeros transposed ([K / g, N]); 4 (wide):
  // w = the [N, K] weight, or a 16-bit one packed as [ceil(N / 16), K, 16]
  // (wide_linear.cpp's packed layout, read by wide_linear_packed). Unused tensors may be empty.
  void add_linear(int64_t kind, at::Tensor w, at::Tensor scales, at::Tensor zeros,
                  int64_t out_features, int64_t bits, int64_t group, int64_t offset,
                  int64_t direct_rows, int64_t scale_format, bool has_zeros) {
    TORCH_CHECK(kind == kA8 || kind == kQuant || kind == kWide,
                "MoEExperts: unknown linear kind ", kind);
    if (kind == kWide) {
      const bool plain = w.dim() == 2 && w.size(0) == out_features;
      const bool packed = w.dim() == 3 && w.size(2) == 16 && w.size(0) * 16 >= out_features &&
                          (w.size(0) - 1) * 16 < out_features;
      TORCH_CHECK(w.is_contiguous() && (plain || packed),
                  "MoEExperts: a dense expert weight must be a contiguous [N, K] tensor or a "
                  "[ceil(N / 16), K, 16] packed one");
    }
    linears_.push_back(Linear{static_cast<LinearKind>(kind), std::move(w), std::move(scales),
                              std::move(zeros), out_features, bits, group, offset, direct_rows,
                              scale_format, has_zeros});
  }

  // gate_up_bias [E, 2I] and down_bias [E, H] in the model dtype (gpt-oss), or none.
  void set_biases(std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down_bias) {
    gate_up_bias_ = std::move(gate_up_bias);
    down_bias_ = std::move(down_bias);
  }

  int64_t num_experts() const { return static_cast<int64_t>(linears_.size()) / 2; }

  // x [T, H] float32 or bf16; weights [T, k] (float32 or the model dtype); ids [T, k] -> [T, H]
  at::Tensor run(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const {
    const int64_t e_count = num_experts();
    TORCH_CHECK(e_count > 0 && linears_.size() % 2 == 0, "MoEExperts.run: no experts");
    TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() &&
                    ids.size(0) == x.size(0),
                "MoEExperts.run: x must be [T, H], weights and ids [T, k]");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "MoEExperts.run: x must be float32 or bfloat16");
    const int64_t t = x.size(0), k = ids.size(1), h = x.size(1);
    at::Tensor out = at::empty({t, h}, x.options());
    if (t == 0) return out;
    const Grouping g = group_pairs(ids, e_count);
    at::Tensor tokens = at::empty({t * k}, at::kLong);  // [T * k] each sorted pair's token
    int64_t* tp = tokens.data_ptr<int64_t>();
    for (int64_t i = 0; i < t * k; ++i) tp[i] = g.order[i] / k;
    const at::Tensor xs = x.contiguous().index_select(0, tokens);  // [T * k, H]
    at::Tensor ys = at::empty_like(xs);                            // [T * k, H]
    std::vector<int64_t> big, small;  // active experts: alone / side by side
    const int64_t threads = at::get_num_threads();
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t n = g.offsets[e + 1] - g.offsets[e];
      if (n > 0) (threads > 1 && n * threads >= t * k ? big : small).push_back(e);
    }
    for (int64_t e : big) expert(e, xs, ys, g);
    if (!small.empty()) {
      // One task per thread taking the next expert, most rows first, until none is left:
      // a thread the (shared) host preempts takes fewer, instead of holding up a fixed share.
      std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) {
        return g.offsets[a + 1] - g.offsets[a] > g.offsets[b + 1] - g.offsets[b];
      });
      const int64_t count = static_cast<int64_t>(small.size());
      std::atomic<int64_t> next{0};
      const at::ThreadLocalState state;  // grad/inference mode for the pool's threads
      at::parallel_for(0, std::min(threads, count), 1, [&](int64_t, int64_t) {
        at::ThreadLocalStateGuard guard(state);
        for (int64_t i = next++; i < count; i = next++) expert(small[i], xs, ys, g);
      });
    }
    const at::Tensor w = weights.contiguous().to(at::kFloat);
    if (x.scalar_type() == at::kFloat) {
      scatter<float>(ys, w, g, k, out);
    } else {
      scatter<c10::BFloat16>(ys, w, g, k, out);
    }
    return out;
  }

 private:
  // Expert e over its rows of xs, into the same rows of ys.
  void expert(int64_t e, const at::Tensor& xs, at::Tensor& ys, const Grouping& g) const {
    const int64_t start = g.offsets[e], n = g.offsets[e + 1] - start;
    const at::Tensor rows = xs.narrow(0, start, n);  // [n, H] contiguous
    at::Tensor gate_up = linear(linears_[2 * e], rows, std::nullopt);  // [n, 2I]
    if (gate_up_bias_.has_value()) gate_up.add_((*gate_up_bias_)[e]);
    const at::Tensor act = activation(gate_up);  // [n, I]
    at::Tensor dst = ys.narrow(0, start, n);     // [n, H]
    linear(linears_[2 * e + 1], act, dst);
    if (down_bias_.has_value()) dst.add_((*down_bias_)[e]);
  }

  // act(gate) * up for gate_up [n, 2I] -> [n, I], rounded as the PyTorch chain rounds.
  at::Tensor activation(const at::Tensor& gate_up) const {
    const int64_t inter = gate_up.size(1) / 2;
    if (act_ == kClampedSwiglu) {  // clamped_swiglu_and_mul's chain, op for op
      const at::Tensor gate = gate_up.narrow(1, 0, inter).clamp(std::nullopt, limit_);
      const at::Tensor up = gate_up.narrow(1, inter, inter).clamp(-limit_, limit_);
      return (up + 1) * (gate * at::sigmoid(gate * alpha_));
    }
    at::Tensor out = gate_up.new_empty({gate_up.size(0), inter});
    (act_ == kSilu ? ops().silu_and_mul : ops().gelu_tanh_and_mul).call(out, gate_up);
    return out;
  }

  // x [n, K] @ W^T in x's dtype, into dst when given (a contiguous [n, N] view), as
  // QuantLinear.forward / WideLinear.forward compute it.
  static at::Tensor linear(const Linear& lin, const at::Tensor& x,
                           std::optional<at::Tensor> dst) {
    const Ops& o = ops();
    if (lin.kind == kWide) {
      // bf16 x on packed bf16 weights: bf16 math (vdpbf16ps where the build has it; float32
      // sums rounded once either way); other 16-bit x is widened exactly, rounded after
      const bool packed = lin.w.dim() == 3;
      const bool keep = x.scalar_type() == at::kFloat ||
                        (packed && x.scalar_type() == at::kBFloat16 &&
                         lin.w.scalar_type() == at::kBFloat16);
      const at::Tensor xin = keep ? x : x.to(at::kFloat);
      at::Tensor y = packed ? o.wide_packed.call(xin, lin.w, std::nullopt, lin.out_features, -1)
                            : o.wide.call(xin, lin.w, std::nullopt, -1, -1);
      if (!dst.has_value()) return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
      dst->copy_(y);  // rounds to bf16 once
      return *dst;
    }
    at::Tensor out = dst.has_value() ? *dst : x.new_empty({x.size(0), lin.out_features});
    if (lin.kind == kA8) {
      o.quant_a8.call(out, x, lin.w, lin.bits, lin.group, lin.offset, lin.scale_format,
                      lin.has_zeros);
    } else {
      o.quant.call(out, x, lin.w, lin.scales, lin.zeros, lin.bits, lin.group, lin.offset,
                   lin.direct_rows);
    }
    return out;
  }

  int64_t act_;
  double alpha_, limit_;
  std::vector<Linear> linears_;
  std::optional<at::Tensor> gate_up_bias_, down_bias_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<MoEExperts>("MoEExperts")
      .def(torch::init<int64_t, double, double>())
      .def("add_linear", &MoEExperts::add_linear)
      .def("set_biases", &MoEExperts::set_biases)
      .def("num_experts", &MoEExperts::num_experts)
      .def("run", &MoEExperts::run);
  // The op's run as a registered op, so the C++ decode loop (decode_layers.cpp), which holds
  // each layer's op as a generic object, calls it through the dispatcher.
  m.def(
      "moe_experts_run(__torch__.torch.classes.kvserve.MoEExperts experts, Tensor x, "
      "Tensor weights, Tensor ids) -> Tensor",
      [](const c10::intrusive_ptr<MoEExperts>& experts, const at::Tensor& x,
         const at::Tensor& weights, const at::Tensor& ids) {
        return experts->run(x, weights, ids);
      });
}
