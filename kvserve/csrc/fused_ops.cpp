// Fused elementwise ops for the CPU decoder layer. Each replaces a chain of PyTorch ops that
// costs ~20 us of dispatch per op at small batches and a round trip through memory per op at
// large ones. Every op rounds where the PyTorch chain it replaces rounds (bf16 after each
// elementwise op; float32 math in between) and never contracts a*b+c into an FMA (the
// loader passes -ffp-contract=off), so results equal that chain except where a reduction
// (the RMSNorm sum of squares) adds in a different order.
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Gelu.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

// Rows per parallel chunk so that each chunk has at least ATen's grain of work (32768
// elements): small batches run on the calling thread instead of waking the pool, which
// costs more than the work and, on a busy machine, can wait a whole scheduler slice.
inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, row_elems));
}

// Round a float to the tensor dtype and back: what storing an intermediate tensor does.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// 16-lane chunks as float vectors: load n <= 16 elements of T, store rounded to T, and round
// in registers. bf16 <-> float uses AVX512-BF16 instructions where compiled for them
// (vcvtneps2bf16 rounds to nearest even, as c10::BFloat16 does), scalar loops otherwise.
static_assert(Vec::size() == 16 || Vec::size() == 8, "vector width");

inline Vec load_f(const float* p, int64_t n) { return Vec::loadu(p, n); }
inline void store_t(float* p, Vec v, int64_t n) { v.store(p, n); }
inline Vec round_t(Vec v, float*) { return v; }

inline Vec load_f(const c10::BFloat16* p, int64_t n) {
#if defined(__AVX512BF16__)
  if (n == 16 && Vec::size() == 16) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
#endif
  float buf[Vec::size()] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return Vec::loadu(buf);
}
inline void store_t(c10::BFloat16* p, Vec v, int64_t n) {
#if defined(__AVX512BF16__)
  if (n == 16 && Vec::size() == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
    return;
  }
#endif
  float buf[Vec::size()];
  v.store(buf);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<c10::BFloat16>(buf[i]);
}
inline Vec round_t(Vec v, c10::BFloat16*) {
#if defined(__AVX512BF16__)
  if constexpr (Vec::size() == 16) {
    __m256i r = (__m256i)_mm512_cvtneps_pbh(v);
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
  }
#endif
  float buf[Vec::size()];
  v.store(buf);
  for (float& x : buf) x = round_to<c10::BFloat16>(x);
  return Vec::loadu(buf);
}
// round(v) to T's precision, staying in float: round_t(v, (T*)nullptr).
template <typename T>
inline Vec rnd(Vec v) {
  return round_t(v, static_cast<T*>(nullptr));
}

// Hugging Face's Llama RMSNorm: y = w * T(x * rsqrt(mean(x^2) + eps)), math in float32.
// With `unit_offset` it is Gemma's: y = T((x * rsqrt(mean(x^2) + eps)) * (1 + w)), all in
// float32 and rounded once at the end, as GemmaRMSNorm computes it.
// With `residual` defined, first residual = T(residual + x) in place (the decoder layer's
// skip connection) and the norm is taken of that sum.
template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps,
                   at::Tensor* residual, bool unit_offset) {
  const int64_t rows = x.size(0), h = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), os = out.stride(0), rs = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      T* orow = op + r * os;
      Vec ss(0.f);
      for (int64_t i = 0; i < h; i += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), h - i);
        Vec v = load_f(xr + i, n);
        if (rp) {
          v = rnd<T>(load_f(rp + r * rs + i, n) + v);
          store_t(rp + r * rs + i, v, n);
        }
        ss = ss + v * v;
      }
      if (rp) xr = rp + r * rs;  // normalise the sum
      const float mean =
          at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, ss) / h;
      const float inv = 1.f / std::sqrt(mean + static_cast<float>(eps));
      const Vec invv(inv);
      for (int64_t i = 0; i < h; i += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), h - i);
        if (unit_offset) {
          store_t(orow + i, (load_f(xr + i, n) * invv) * (Vec(1.f) + load_f(wp + i, n)), n);
        } else {
          const Vec normed = rnd<T>(load_f(xr + i, n) * invv);
          store_t(orow + i, load_f(wp + i, n) * normed, n);
        }
      }
    }
  });
}

// out = T(T(silu(gate)) * up) for gate_up = [gate | up]; silu(x) = x / (1 + exp(-x)) with
// ATen's vectorized exp, the formula of PyTorch's own silu kernel.
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const T* gp = gate_up.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * gs;
      const T* u = g + inter;
      T* o = op + r * os;
      for (int64_t i = 0; i < inter; i += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), inter - i);
        const Vec x = load_f(g + i, n);
        const Vec silu = rnd<T>(x / (one + x.neg().exp()));
        store_t(o + i, silu * load_f(u + i, n), n);
      }
    }
  });
}

// out = T(T(gelu_tanh(gate)) * up) (Gemma's GeGLU), with ATen's own tanh-approximation
// formula (ATen/native/cpu/Gelu.h). PyTorch's elementwise loop runs the vectorised formula
// over whole pairs of its vectors (32 floats, 64 bf16) and the scalar one (std::tanh) on a
// row's tail; doing the same keeps the tail's last bits equal too.
template <typename T>
void gelu_tanh_and_mul_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const T* gp = gate_up.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  const int64_t step = 2 * at::vec::Vectorized<T>::size();
  const int64_t vec_end = inter - inter % step;
  at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * gs;
      const T* u = g + inter;
      T* o = op + r * os;
      for (int64_t i = 0; i < vec_end; i += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), vec_end - i);
        const Vec gelu = rnd<T>(at::native::vectorized_gelu_approximated_with_tanh(load_f(g + i, n)));
        store_t(o + i, gelu * load_f(u + i, n), n);
      }
      for (int64_t i = vec_end; i < inter; ++i) {
        const float gelu = round_to<T>(
            at::native::scalar_gelu_approximated_with_tanh(static_cast<float>(g[i])));
        o[i] = static_cast<T>(gelu * static_cast<float>(u[i]));
      }
    }
  });
}

// Per-head RMSNorm of one head's d values (Qwen3's and Gemma3's q/k norms) into dst, rounded
// as rms_norm_impl rounds a row (Llama style, or Gemma's unit offset).
template <typename T>
void norm_head(const T* x, const T* w, int64_t d, float eps, bool unit_offset, T* dst) {
  Vec ss(0.f);
  for (int64_t i = 0; i < d; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), d - i);
    const Vec v = load_f(x + i, n);
    ss = ss + v * v;
  }
  const float mean = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, ss) / d;
  const Vec invv(1.f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < d; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), d - i);
    if (unit_offset) {
      store_t(dst + i, (load_f(x + i, n) * invv) * (Vec(1.f) + load_f(w + i, n)), n);
    } else {
      store_t(dst + i, load_f(w + i, n) * rnd<T>(load_f(x + i, n) * invv), n);
    }
  }
}

// Rotate-half RoPE on q and k as Hugging Face computes it in the model dtype:
// T(T(x * cos) + T(rotate_half(x) * sin)). q goes to q_out [T, H, D]; rotated k and v are
// written to their slots of the paged cache [num_blocks, Hkv, block_size, D]. With q/k norm
// weights ([D] each; Qwen3, Gemma3) every q and k head is first normalised (norm_head) into
// a scratch head, rounded to T as the norm's output tensor would be, and rotated from there.
// Measured at Qwen3-0.6B's shapes (16 q / 8 kv heads of 128, bf16, 1 thread): 6.6 us per
// decode token against 126 us for the PyTorch chain (two norms, RoPE, KV write), 121 vs
// 838 us at 64 tokens; the norms add 2.5 us to the bare RoPE + KV write.
template <typename T>
void rope_write_kv_impl(at::Tensor& q_out, const at::Tensor& qkv, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads,
                        const at::Tensor* q_norm, const at::Tensor* k_norm, double eps,
                        bool unit_offset) {
  const T* qw = q_norm ? q_norm->const_data_ptr<T>() : nullptr;
  const T* kw = k_norm ? k_norm->const_data_ptr<T>() : nullptr;
  const int64_t tokens = qkv.size(0), d = q_out.size(2), half = d / 2;
  const T* src = qkv.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  T* qo = q_out.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t row = qkv.stride(0), bs = k_cache.size(2);
  // rotate_half(x) = [-x2, x1] for x = [x1, x2]; both halves computed from the same loads.
  auto rotate = [&](const T* x, const T* c, const T* s, T* dst) {
    for (int64_t i = 0; i < half; i += Vec::size()) {
      const int64_t n = std::min<int64_t>(Vec::size(), half - i);
      const Vec x1 = load_f(x + i, n), x2 = load_f(x + half + i, n);
      const Vec lo = rnd<T>(x1 * load_f(c + i, n)) + rnd<T>(x2.neg() * load_f(s + i, n));
      const Vec hi = rnd<T>(x2 * load_f(c + half + i, n)) + rnd<T>(x1 * load_f(s + half + i, n));
      store_t(dst + i, lo, n);
      store_t(dst + half + i, hi, n);
    }
  };
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, tokens, row_grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    std::vector<T> scratch(d);
    // The head to rotate: x itself, or its normalised copy in scratch.
    auto normed = [&](const T* x, const T* w) -> const T* {
      if (!w) return x;
      norm_head(x, w, d, feps, unit_offset, scratch.data());
      return scratch.data();
    };
    for (int64_t t = begin; t < end; ++t) {
      const T* x = src + t * row;
      const T* c = cp + t * cos.stride(0);
      const T* s = sp + t * sin.stride(0);
      for (int64_t h = 0; h < num_heads; ++h) {
        rotate(normed(x + h * d, qw), c, s, qo + (t * num_heads + h) * d);
      }
      const T* k = x + num_heads * d;
      const T* v = k + num_kv_heads * d;
      // Cache layout [num_blocks, Hkv, block_size, D]: head h of slot (block, offset).
      const int64_t block = slot[t] / bs, offset = slot[t] % bs;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t at = ((block * num_kv_heads + h) * bs + offset) * d;
        rotate(normed(k + h * d, kw), c, s, kc + at);
        std::copy(v + h * d, v + (h + 1) * d, vc + at);
      }
    }
  });
}

// Index of the first maximum of each row, as torch.max(dim=-1).indices gives it (a NaN is
// the maximum). Lane-wise running max with strict > keeps each lane's first maximum; the
// lanes are then merged by value and, on ties, by the smaller index.
template <typename T>
void argmax_rows_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1), rs = x.stride(0);
  const T* xp = x.const_data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  constexpr int64_t W = Vec::size();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * rs;
      float best[W], lane[W];
      int64_t idx[W];
      Vec bv(-std::numeric_limits<float>::infinity());
      bv.store(best);
      std::fill(idx, idx + W, int64_t{-1});
      bool has_nan = false;
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        const Vec v = load_f(row + i, W);
        has_nan |= (v != v).zero_mask() != (1 << W) - 1;  // a lane unequal to itself
        const Vec gt = v > Vec::loadu(best);
        if (gt.zero_mask() == (1 << W) - 1) continue;  // no lane improved
        v.store(lane);
        for (int64_t j = 0; j < W; ++j) {
          if (lane[j] > best[j]) {
            best[j] = lane[j];
            idx[j] = i + j;
          }
        }
      }
      int64_t arg = -1;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < W; ++j) {
        if (idx[j] >= 0 && (best[j] > mx || (best[j] == mx && idx[j] < arg))) {
          mx = best[j];
          arg = idx[j];
        }
      }
      for (; i < n; ++i) {  // tail, in order
        const float v = static_cast<float>(row[i]);
        has_nan |= v != v;
        if (v > mx) {
          mx = v;
          arg = i;
        }
      }
      if (has_nan) {  // rare: the first NaN wins, as in torch.max
        for (int64_t j = 0; j < n; ++j) {
          const float v = static_cast<float>(row[j]);
          if (v != v) {
            arg = j;
            break;
          }
        }
      }
      op[r] = arg < 0 ? 0 : arg;  // arg < 0 only if every value is -inf: index 0, as torch
    }
  });
}

void check_cpu_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a CPU matrix with contiguous rows");
}

#define DISPATCH(dtype, fn, ...)                                            \
  if ((dtype) == at::kFloat) {                                              \
    fn<float>(__VA_ARGS__);                                                 \
  } else if ((dtype) == at::kBFloat16) {                                    \
    fn<c10::BFloat16>(__VA_ARGS__);                                         \
  } else {                                                                  \
    TORCH_CHECK(false, "kvserve fused ops support float32 and bfloat16");   \
  }

void check_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  check_cpu_2d(x, "x");
  check_cpu_2d(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(), "dtypes/shapes");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps,
              bool unit_offset) {
  check_rms_norm(out, x, weight);
  DISPATCH(x.scalar_type(), rms_norm_impl, out, x, weight, eps, nullptr, unit_offset)
}

void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps, bool unit_offset) {
  check_cpu_2d(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  check_rms_norm(out, x, weight);
  DISPATCH(x.scalar_type(), rms_norm_impl, out, x, weight, eps, &residual, unit_offset)
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_cpu_2d(gate_up, "gate_up");
  check_cpu_2d(out, "out");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0), "shapes");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "dtypes");
  DISPATCH(out.scalar_type(), silu_and_mul_impl, out, gate_up)
}

void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_cpu_2d(gate_up, "gate_up");
  check_cpu_2d(out, "out");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0), "shapes");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "dtypes");
  DISPATCH(out.scalar_type(), gelu_tanh_and_mul_impl, out, gate_up)
}

void rope_write_kv(at::Tensor q_out, const at::Tensor& qkv, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                   const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, double eps, bool unit_offset) {
  check_cpu_2d(qkv, "qkv");
  check_cpu_2d(cos, "cos");
  check_cpu_2d(sin, "sin");
  TORCH_CHECK(q_out.is_contiguous() && q_out.dim() == 3 && q_out.size(0) == qkv.size(0) &&
                  q_out.size(1) == num_heads, "q_out");
  const int64_t d = q_out.size(2);
  TORCH_CHECK(d % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "qkv width");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == d && sin.sizes() == cos.sizes(), "cos/sin");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.size(1) == num_kv_heads && k_cache.size(3) == d &&
                  v_cache.sizes() == k_cache.sizes(), "cache");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == qkv.size(0), "slot_mapping");
  for (auto* t : {&q_out, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "dtypes");
  }
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "dtypes");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  for (const auto* w : {&q_norm, &k_norm}) {
    TORCH_CHECK(!w->has_value() || ((*w)->is_contiguous() && (*w)->numel() == d &&
                                    (*w)->scalar_type() == qkv.scalar_type()),
                "q/k norm weights must be [head_dim] of the qkv dtype");
  }
  const at::Tensor* qn = q_norm.has_value() ? &*q_norm : nullptr;
  const at::Tensor* kn = k_norm.has_value() ? &*k_norm : nullptr;
  DISPATCH(qkv.scalar_type(), rope_write_kv_impl, q_out, qkv, cos, sin, k_cache, v_cache,
           slot_mapping, num_heads, num_kv_heads, qn, kn, eps, unit_offset)
}

void argmax_rows(at::Tensor out, const at::Tensor& x) {
  check_cpu_2d(x, "x");
  TORCH_CHECK(x.size(1) > 0, "rows must not be empty");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == x.size(0),
              "out must be int64 [rows]");
  DISPATCH(x.scalar_type(), argmax_rows_impl, out, x)
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset=False) "
      "-> ()");
  m.def(
      "add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps, "
      "bool unit_offset=False) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def(
      "rope_write_kv(Tensor(a!) q_out, Tensor qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
      "Tensor? q_norm=None, Tensor? k_norm=None, float eps=1e-6, bool unit_offset=False) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("argmax_rows", &argmax_rows);
}
