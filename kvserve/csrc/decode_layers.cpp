// The decoder layers of a decode step in one call: kvserve's CPU analog of a CUDA graph.
//
// A decode step of a small model is mostly Python: for the built-in 135M model (30 layers, 4
// linears each) the ops took 3.3 ms of a 5.1 ms step (torch.profiler; AMD EPYC Zen 5, 2
// threads), the rest being module calls, argument parsing and tensor bookkeeping around ~10
// kernel calls per layer. This class holds each layer's weights once (built by
// kvserve.model.decode_loop) and runs the very kernels the Python layers call, in the same
// order with the same arguments, through the dispatcher: the same numbers, bit for bit (tests
// compare the two paths token by token and the KV caches byte by byte).
//
// Per layer (Llama family: kvserve.model.llama.DecoderLayer with fused ops):
//   h = rms_norm(x) (first layer) or add_rms_norm(x, residual)   [T, hidden]
//   q = rope_write_kv(qkv_proj(h), ...)                          [T, H, D], K/V written
//   o = paged_decode_attention(q, ...)                           [T, H, D]
//   h = add_rms_norm(o_proj(o), residual)
//   x = down_proj(silu_and_mul(gate_up_proj(h)))
// or, for a mixture-of-experts layer (set_moe: kvserve.model.moe's SparseMoeBlock,
// gpt_oss's GptOssMoeBlock), the router and the layer's experts op:
//   weights, ids = route(router(h))                             [T, k] each (moe/router.py)
//   x = moe_experts_run(experts, h, weights, ids)               (csrc/moe_experts.cpp)
//   x = x + sigmoid(shared_gate(h)) * down(silu_and_mul(gate_up(h)))   (Qwen2-MoE's shared
//                                                                       expert, if any)
// and attention sinks where the layer has them (set_sinks: gpt-oss). OLMoE's q/k norms span
// the whole projections (set_whole_qk_norm): after qkv_proj, as OlmoeAttention.project,
//   qkv = cat(rms_norm(q), rms_norm(k), v), clamped to +-clip_qkv where it has one.
// Linears: kvserve's quantized kernels (int8 activations or the model dtype), 16-bit packed
// weights (wide_linear.cpp: widened to float32, or bf16 math), oneDNN's prepacked weights, or a plain weight through
// at::linear (nn.Linear's own call: float32
// layers that packing does not win on, and bf16 on CPUs whose oneDNN cannot pack bf16, i.e.
// AVX2-only ones), with an optional bias (added as the Python layers add it).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernel_ops.h"  // LinearKind, op<Sig>, the kernels' signatures

namespace {

using namespace kvserve_ops;

// One linear layer's weights as its Python module holds them (see add_linear).
struct Linear {
  LinearKind kind;
  at::Tensor w;  // a8: pack_a8's buffer; quant: pack_codes' codes; packed: oneDNN weight;
                // dense: the [N, K] weight; wide: the [ceil(N / 16), K, 16] bf16/fp16
                // packed weight (wide_linear.cpp's packed layout);
                // invariant: the [N, K] weight (float32/bf16/fp16), bias float32
  at::Tensor scales;  // quant only: [K / g, N] (else undefined)
  at::Tensor zeros;   // quant only: [K / g, N] or empty
  std::optional<at::Tensor> bias;  // [N]
  int64_t out_features, bits, group, offset, direct_rows;
  int64_t scale_format;  // a8: quant_linear_a8's (0 float32, 1 float16, 2 super-blocks)
  bool has_zeros;
  // Multi-LoRA slot weights (add_lora), or undefined: A [S, n*R, K], Bt_i [S, R, N_i]
  at::Tensor lora_a;
  std::vector<at::Tensor> lora_bts;
};

// A mixture-of-experts MLP: the router's logits, the top-k routing (kvserve.moe.router.route,
// the same ATen calls) and the layer's MoEExperts op (a torch.classes.kvserve.MoEExperts).
struct Moe {
  c10::IValue experts;
  int64_t top_k;
  bool topk_softmax;     // Scoring.TOPK_SOFTMAX (else softmax over all experts, then top-k)
  bool norm_topk_prob;   // renormalise the k weights (SOFTMAX_TOPK)
  bool float32_weights;  // keep the weights in float32 (Mixtral), else the logits' dtype
  // Qwen2-MoE's shared expert (its gate/up and down, a gated MLP) and its [1, H] gate, or none
  std::optional<Linear> shared_gate_up, shared_down, shared_gate;
};

// OLMoE's q/k norms over the whole projections, then its clip_qkv (OlmoeAttention.project).
struct WholeQkNorm {
  at::Tensor q_norm, k_norm;  // [H * D], [Hkv * D]
  double eps;
  std::optional<double> clip;  // clamp q, k and v to [-clip, clip]
};

struct Layer {
  at::Tensor in_norm, post_norm;  // [hidden] each
  double in_eps, post_eps;
  Linear qkv, o, gate_up, down;  // with moe: gate_up is the router, down unused
  std::optional<at::Tensor> q_norm, k_norm;  // [D] each (Qwen3), or none
  double qk_eps;
  int64_t window;   // sliding window (0: none)
  double soft_cap;  // attention logit soft-cap (0: none)
  double scale;     // softmax scale
  std::optional<Moe> moe;             // the MLP is these experts (else gate_up, down)
  std::optional<at::Tensor> sinks;    // [H] float32 attention sinks, or none
  std::optional<WholeQkNorm> whole_qk;  // OLMoE's q/k norms (q_norm / k_norm then none)
};

// The ops, with the C++ signatures their kernels were registered with.
using RmsNorm = void(at::Tensor, const at::Tensor&, const at::Tensor&, double, bool);
using AddRmsNorm = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, double,
                        bool);
using RopeWriteKv = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         at::Tensor, at::Tensor, const at::Tensor&, int64_t, int64_t,
                         const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                         double, bool);
using PagedDecode = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                         int64_t, double, const std::optional<at::Tensor>&);
using LoraAdd = void(at::Tensor, const at::Tensor&, const at::Tensor&, at::TensorList,
                     const at::Tensor&);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = op<RmsNorm>("kvserve::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm =
      op<AddRmsNorm>("kvserve::add_rms_norm");
  c10::TypedOperatorHandle<Act> silu_and_mul =
      op<Act>("kvserve::silu_and_mul");
  c10::TypedOperatorHandle<RopeWriteKv> rope_write_kv =
      op<RopeWriteKv>("kvserve::rope_write_kv");
  c10::TypedOperatorHandle<PagedDecode> paged_decode =
      op<PagedDecode>("kvserve::paged_decode_attention");
  c10::TypedOperatorHandle<QuantA8> quant_a8 = op<QuantA8>("kvserve::quant_linear_a8");
  c10::TypedOperatorHandle<Quant> quant = op<Quant>("kvserve::quant_linear");
  c10::TypedOperatorHandle<Wide> wide = op<Wide>("kvserve::wide_linear");
  c10::TypedOperatorHandle<Wide> wide_packed = op<Wide>("kvserve::wide_linear_packed");
  c10::TypedOperatorHandle<LoraAdd> lora_add = op<LoraAdd>("kvserve::lora_add");
  // The experts op's run (its object passed boxed: moe_experts.cpp registers both).
  c10::OperatorHandle moe_run =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvserve::moe_experts_run", "");
  // oneDNN's packed linear has no C++ API in ATen: called boxed (one call per linear).
  c10::OperatorHandle packed =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
};

const Ops& ops() {
  static const Ops o;  // looked up once, after every library has registered
  return o;
}

class DecodeLayers : public torch::CustomClassHolder {
 public:
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {}

  // One linear layer, appended; add_layer takes the last four (qkv, o, gate_up, down).
  // kind 0 (a8): w = pack_a8's buffer; 1 (quant): w = codes, scales/zeros transposed;
  // 2 (packed): w = oneDNN's packed weight; 3 (dense): w = the [N, K] weight, bias passed to
  // at::linear as F.linear takes it; 4 (wide): w = WideLinear's packed 16-bit weight, bias
  // likewise, direct_rows WideLinear's; 5 (invariant): batch-invariant mode's BatchInvariantLinear,
  // wide_linear on float32 x with no row limit (ops/batch_invariant.invariant_linear's calls).
  // Unused tensors may be empty.
  void add_linear(int64_t kind, at::Tensor w, at::Tensor scales, at::Tensor zeros,
                  std::optional<at::Tensor> bias, int64_t out_features, int64_t bits,
                  int64_t group, int64_t offset, int64_t direct_rows, int64_t scale_format,
                  bool has_zeros) {
    TORCH_CHECK(kind >= kA8 && kind <= kInvariant, "DecodeLayers: unknown linear kind ",
                kind);
    pending_.push_back(Linear{static_cast<LinearKind>(kind), std::move(w), std::move(scales),
                              std::move(zeros), std::move(bias), out_features, bits, group,
                              offset, direct_rows, scale_format, has_zeros,
                              at::Tensor(), {}});
  }

  // Multi-LoRA slot weights of layer `layer`'s linear `which` (0 qkv, 1 o, 2 gate_up, 3 down),
  // the LoRAManager's own tensors (slots are loaded in place): steps with adapters then add
  // each linear's delta with the same kvserve::lora_add call the Python layers make.
  void add_lora(int64_t layer, int64_t which, at::Tensor a, std::vector<at::Tensor> bts) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && which >= 0 &&
                    which < 4,
                "DecodeLayers.add_lora: no linear ", which, " in layer ", layer);
    Layer& l = layers_[layer];
    Linear* lins[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    lins[which]->lora_a = std::move(a);
    lins[which]->lora_bts = std::move(bts);
  }

  // The next layer's MLP is a mixture of experts: `experts` its MoEExperts op, routed as
  // kvserve.moe.router.route with these settings. The layer then takes 3 linears (qkv, o and
  // the router, a dense [E, H] weight with an optional bias) instead of 4, or 6 with a
  // shared expert (then its gate/up, down and [1, H] gate too).
  void set_moe(c10::IValue experts, int64_t top_k, bool topk_softmax, bool norm_topk_prob,
               bool float32_weights, bool shared_expert) {
    TORCH_CHECK(experts.isObject() && top_k >= 1,
                "DecodeLayers.set_moe: experts must be a MoEExperts op and top_k at least 1");
    pending_moe_ = Moe{std::move(experts), top_k, topk_softmax, norm_topk_prob, float32_weights,
                       std::nullopt, std::nullopt, std::nullopt};
    pending_shared_ = shared_expert;
  }

  void add_layer(at::Tensor in_norm, double in_eps, at::Tensor post_norm, double post_eps,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 double qk_eps, int64_t window, double soft_cap, double scale) {
    const size_t want = pending_moe_.has_value() ? (pending_shared_ ? 6 : 3) : 4;
    TORCH_CHECK(pending_.size() == want, "DecodeLayers: a layer takes exactly ", want,
                " linears, got ", pending_.size());
    if (pending_moe_.has_value() && pending_shared_) {
      pending_moe_->shared_gate_up = pending_[3];
      pending_moe_->shared_down = pending_[4];
      pending_moe_->shared_gate = pending_[5];
      pending_.resize(3);
    }
    if (pending_moe_.has_value()) pending_.push_back(pending_[2]);  // the unused down's place
    layers_.push_back(Layer{std::move(in_norm), std::move(post_norm), in_eps, post_eps,
                            pending_[0], pending_[1], pending_[2], pending_[3],
                            std::move(q_norm), std::move(k_norm), qk_eps, window, soft_cap,
                            scale, std::move(pending_moe_), std::nullopt, std::nullopt});
    pending_.clear();
    pending_moe_.reset();
    pending_shared_ = false;
  }

  // Layer `layer`'s q/k norms over the whole projections and its clip_qkv (OLMoE).
  void set_whole_qk_norm(int64_t layer, at::Tensor q_norm, at::Tensor k_norm, double eps,
                         std::optional<double> clip) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) &&
                    q_norm.dim() == 1 && q_norm.size(0) == num_heads_ * head_dim_ &&
                    k_norm.dim() == 1 && k_norm.size(0) == num_kv_heads_ * head_dim_,
                "DecodeLayers.set_whole_qk_norm: [H * D] and [Hkv * D] weights of an added "
                "layer");
    layers_[layer].whole_qk = WholeQkNorm{std::move(q_norm), std::move(k_norm), eps, clip};
  }

  // Layer `layer`'s attention sinks: [H] float32 (as cpu_kernels.paged_decode_attention
  // hands them to the kernel).
  void set_sinks(int64_t layer, at::Tensor sinks) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) &&
                    sinks.scalar_type() == at::kFloat && sinks.dim() == 1 &&
                    sinks.size(0) == num_heads_ && sinks.is_contiguous(),
                "DecodeLayers.set_sinks: one float32 logit per query head of an added layer");
    layers_[layer].sinks = std::move(sinks);
  }

  // x: [T, hidden] embeddings (T decode rows, one token each); cos, sin: [T, D];
  // slot_mapping: [T]; block_tables: [T, nb]; seq_lens: [T]; caches: one K and one V per
  // layer; lora_slots: each row's adapter slot [T] int64 (-1: none), or none for a step
  // without adapters; stop: the engine's StepInterrupt flag [1] int32 for a background-only
  // step (worker/step_interrupt.py), read between layers, or none. Returns (the last layer's
  // MLP output, the residual stream), as the Python loop, or nothing when the flag was set.
  std::vector<at::Tensor> run(at::Tensor x, at::Tensor cos, at::Tensor sin,
                              at::Tensor slot_mapping, at::Tensor block_tables,
                              at::Tensor seq_lens, std::vector<at::Tensor> k_caches,
                              std::vector<at::Tensor> v_caches,
                              std::optional<at::Tensor> lora_slots,
                              std::optional<at::Tensor> stop) const {
    const int64_t n = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(n > 0 && static_cast<int64_t>(k_caches.size()) == n &&
                    static_cast<int64_t>(v_caches.size()) == n,
                "DecodeLayers.run: one K and one V cache per layer");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecodeLayers.run: x must be [T, hidden]");
    const Ops& o = ops();
    const int64_t t = x.size(0);
    const at::Tensor no_rows = seq_lens.slice(0, 0, 0);  // every row is a decode row
    at::Tensor residual;
    const at::Tensor* slots = lora_slots.has_value() ? &*lora_slots : nullptr;
    TORCH_CHECK(!stop.has_value() || (stop->scalar_type() == at::kInt && stop->numel() == 1),
                "DecodeLayers.run: stop must be one int32");
    // Written by another thread (a plain store through NumPy): read atomically, no ordering
    // needed (a layer later is as good).
    const int32_t* stop_flag = stop.has_value() ? stop->data_ptr<int32_t>() : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      if (stop_flag != nullptr && __atomic_load_n(stop_flag, __ATOMIC_RELAXED) != 0) {
        return {};  // given up: the caller raises StepInterrupted
      }
      const Layer& l = layers_[i];
      at::Tensor h = at::empty_like(x);
      if (i == 0) {
        residual = x;
        o.rms_norm.call(h, x, l.in_norm, l.in_eps, false);
      } else {
        o.add_rms_norm.call(h, residual, x, l.in_norm, l.in_eps, false);
      }
      at::Tensor qkv = linear(l.qkv, h, slots);
      if (l.whole_qk.has_value()) qkv = whole_qk_norm(*l.whole_qk, qkv);
      at::Tensor q = qkv.new_empty({t, num_heads_, head_dim_});
      o.rope_write_kv.call(q, qkv, cos, sin, k_caches[i], v_caches[i], slot_mapping, num_heads_,
                           num_kv_heads_, l.q_norm, l.k_norm, l.qk_eps, false);
      at::Tensor attn = at::empty_like(q);
      o.paged_decode.call(attn, q, k_caches[i], v_caches[i], block_tables, seq_lens, no_rows,
                          l.scale, l.window, l.soft_cap, l.sinks);
      at::Tensor out = linear(l.o, attn.view({t, num_heads_ * head_dim_}), slots);
      h = at::empty_like(out);
      o.add_rms_norm.call(h, residual, out, l.post_norm, l.post_eps, false);
      if (l.moe.has_value()) {
        x = experts(*l.moe, linear(l.gate_up, h), h);
        continue;
      }
      x = gated_mlp(l.gate_up, l.down, h, slots);
    }
    return {x, residual};
  }

 private:
  // OlmoeAttention.project after qkv_proj: each of q and k normalised whole (RMSNorm.forward's
  // kernel call on a contiguous copy), concatenated back with v, then clamped.
  at::Tensor whole_qk_norm(const WholeQkNorm& n, const at::Tensor& qkv) const {
    const int64_t qs = num_heads_ * head_dim_, kvs = num_kv_heads_ * head_dim_;
    std::vector<at::Tensor> parts = qkv.split_with_sizes({qs, kvs, kvs}, -1);
    const at::Tensor q = parts[0].contiguous(), k = parts[1].contiguous();
    at::Tensor qn = at::empty_like(q), kn = at::empty_like(k);
    ops().rms_norm.call(qn, q, n.q_norm, n.eps, false);
    ops().rms_norm.call(kn, k, n.k_norm, n.eps, false);
    at::Tensor out = at::cat({qn, kn, parts[2]}, -1);
    if (n.clip.has_value()) out.clamp_(-*n.clip, *n.clip);
    return out;
  }

  // kvserve.moe.router.route on the router's logits [T, E], then the experts op on h [T, H].
  static at::Tensor experts(const Moe& m, const at::Tensor& logits, const at::Tensor& h) {
    at::Tensor weights, ids;
    if (m.topk_softmax) {  // the k largest logits, softmax over them
      auto [top, idx] = at::topk(logits.to(at::kFloat), m.top_k, -1);
      weights = at::softmax(top, -1);
      ids = idx;
    } else {  // softmax over every expert in float32, the k largest
      std::tie(weights, ids) = at::topk(at::softmax(logits, -1, at::kFloat), m.top_k, -1);
      if (m.norm_topk_prob) weights = weights / weights.sum({-1}, true);
    }
    if (!m.float32_weights) weights = weights.to(logits.scalar_type());
    torch::jit::Stack stack{m.experts, h, weights, ids};
    ops().moe_run.callBoxed(&stack);
    at::Tensor out = stack[0].toTensor();
    if (m.shared_gate_up.has_value()) {  // SparseMoeBlock.forward's shared expert
      const at::Tensor shared = gated_mlp(*m.shared_gate_up, *m.shared_down, h, nullptr);
      out = out + at::sigmoid(linear(*m.shared_gate, h)) * shared;
    }
    return out;
  }

  // MLP.forward with the fused ops: down(silu_and_mul(gate_up(h))), LoRA deltas where given.
  static at::Tensor gated_mlp(const Linear& gate_up_proj, const Linear& down_proj,
                              const at::Tensor& h, const at::Tensor* slots) {
    const at::Tensor gate_up = linear(gate_up_proj, h, slots);
    at::Tensor act = gate_up.new_empty({h.size(0), gate_up.size(1) / 2});
    ops().silu_and_mul.call(act, gate_up);
    return linear(down_proj, act, slots);
  }

  // The linear, then its LoRA delta where the step has adapters (LoRASlotWeights.add_delta).
  static at::Tensor linear(const Linear& lin, const at::Tensor& x, const at::Tensor* slots) {
    at::Tensor y = linear(lin, x);
    if (slots != nullptr && lin.lora_a.defined()) {
      ops().lora_add.call(y, x, lin.lora_a, lin.lora_bts, *slots);
    }
    return y;
  }

  // y = x @ W^T (+ bias), as QuantLinear.forward / PackedLinear.forward / nn.Linear compute it.
  static at::Tensor linear(const Linear& lin, const at::Tensor& x) {
    const Ops& o = ops();
    if (lin.kind == kDense) {
      return at::linear(x, lin.w, lin.bias);
    }
    if (lin.kind == kWide) {
      // WideLinear.forward's call (direct_rows -1: the kernel's default)
      return o.wide_packed.call(x, lin.w, lin.bias, lin.out_features, lin.direct_rows);
    }
    if (lin.kind == kInvariant) {  // invariant_linear: widen, every row in the kernel, round
      return o.wide.call(x.to(at::kFloat), lin.w, lin.bias, 0, -1).to(x.scalar_type());
    }
    if (lin.kind == kPacked) {
      torch::jit::Stack stack{x, lin.w, lin.bias, std::string("none"),
                              c10::List<std::optional<at::Scalar>>(),
                              std::optional<std::string>(std::string(""))};
      o.packed.callBoxed(&stack);
      return stack[0].toTensor();
    }
    at::Tensor out = x.new_empty({x.size(0), lin.out_features});
    if (lin.kind == kA8) {
      o.quant_a8.call(out, x, lin.w, lin.bits, lin.group, lin.offset, lin.scale_format,
                      lin.has_zeros);
    } else {
      o.quant.call(out, x, lin.w, lin.scales, lin.zeros, lin.bits, lin.group, lin.offset,
                   lin.direct_rows);
    }
    if (lin.bias.has_value()) {
      out += *lin.bias;
    }
    return out;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  std::vector<Linear> pending_;
  std::optional<Moe> pending_moe_;  // set_moe's, for the next add_layer
  bool pending_shared_ = false;     // with a shared expert (6 linears)
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("add_linear", &DecodeLayers::add_linear)
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_lora", &DecodeLayers::add_lora)
      .def("set_moe", &DecodeLayers::set_moe)
      .def("set_sinks", &DecodeLayers::set_sinks)
      .def("set_whole_qk_norm", &DecodeLayers::set_whole_qk_norm)
      .def("run", &DecodeLayers::run);
}
