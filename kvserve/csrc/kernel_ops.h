// What the C++ loops that call kvserve's kernels share (decode_layers.cpp, moe_experts.cpp):
// the linear kinds' numbers (the Python side passes them: model/decode_loop.py,
// moe/experts_kernel.py), the typed handles of registered ops and the kernels' C++ signatures.
// Header-only.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>

namespace kvserve_ops {

// A linear layer's kind: a8 = int8 activations (pack_a8's buffer), quant = weight-only codes
// (pack_codes), packed = oneDNN's packed weight, dense = the [N, K] weight through
// at::linear, wide = 16-bit packed weights (wide_linear.cpp: widened to float32 in registers,
// or times bf16 activations with vdpbf16ps), invariant =
// batch-invariant mode's linear.
enum LinearKind : int64_t {
  kA8 = 0, kQuant = 1, kPacked = 2, kDense = 3, kWide = 4, kInvariant = 5
};

// The registered op `name`'s typed handle (looked up once by each caller's static Ops).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The C++ signatures the kernels were registered with.
using Act = void(at::Tensor, const at::Tensor&);  // silu_and_mul, gelu_tanh_and_mul
using QuantA8 = void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                     int64_t, int64_t, bool);  // ..., scale_format, has_zeros
using Wide = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        int64_t, int64_t);  // wide_linear and wide_linear_packed alike
using Quant = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, int64_t, int64_t, int64_t, int64_t);

}  // namespace kvserve_ops
