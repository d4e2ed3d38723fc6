// Fused elementwise ops for the CPU op table (fp32, bf16, fp16): what eager torch runs as 5-10
// separate ops, each a pass over memory and a dispatch, done in one pass per row.
//
// - rms_norm / add_rms_norm: Qwen3RMSNorm (x * rsqrt(mean(x^2) + eps), then * weight), the
//   residual add fused in front;
// - qk_norm_rope: Qwen3's per-head q/k RMSNorm and neox rotary embedding (or the rotary
//   embedding alone), read from the qkv projection's output and written contiguous for attention;
// - silu_and_mul: SwiGLU's silu(gate) * up over the fused gate/up output;
// - quant_rows_int8 / quant_static_int8 / scale_rows: W8A8's activation quantization (per token,
//   or by a static scale and offset) and the epilogue of its int8 GEMM (per-token scale, bias,
//   rounding to the compute dtype), each one pass, as workers/quant/weights.py defines them.
// The math follows the reference's order (multiply by the inverse norm, then by the weight);
// sums of squares are accumulated in a different order than torch's, so results agree to
// float rounding, not bit for bit (tests/workers/test_cpu_kernels.py checks it).
// bf16 / fp16 tensors are read at their width and computed in fp32, rounded back to the
// tensor's dtype where HF's eager ops round (each bf16 op's result): the normalized value before
// the weight, the weight's product, the residual sum, each RoPE product and their sum, silu
// before the up product. A product of two bf16 / fp16 values is exact in fp32, so these
// roundings are torch's own; only the sum of squares' order, rsqrt and exp differ.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kGrainElements = 16384;  // rows per thread chunk: at least this many elements

inline int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_len)); }

// An element type as the kernels see it: S its storage, ld widens to fp32, st rounds fp32 back
// (to nearest even, as torch's casts do), rnd(v) = ld(st(v)). Plain code: a loop of these vectorizes.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using S = float;
  static float ld(float v) { return v; }
  static float st(float v) { return v; }
  static float rnd(float v) { return v; }
};

template <>
struct Elem<at::BFloat16> {
  using S = uint16_t;  // bf16 is fp32's top half
  static float ld(uint16_t v) { return raylm::BF16::widen(v); }
  static uint16_t st(float f) {  // c10::BFloat16's round_to_nearest_even, NaN -> 0x7FC0
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
  }
  static float rnd(float v) { return ld(st(v)); }
};

template <>
struct Elem<at::Half> {
#ifdef __FLT16_MAX__
  using S = _Float16;  // the compiler's own fp16 (F16C / AVX512-FP16 conversions)
  static float ld(_Float16 v) { return static_cast<float>(v); }
  static _Float16 st(float v) { return static_cast<_Float16>(v); }
#else
  using S = at::Half;
  static float ld(at::Half v) { return static_cast<float>(v); }
  static at::Half st(float v) { return at::Half(v); }
#endif
  static float rnd(float v) { return ld(st(v)); }
};

template <typename T>
using S_t = typename Elem<T>::S;

template <typename T>
const S_t<T>* in_ptr(const at::Tensor& t) { return reinterpret_cast<const S_t<T>*>(t.const_data_ptr()); }
template <typename T>
S_t<T>* out_ptr(at::Tensor& t) { return reinterpret_cast<S_t<T>*>(t.mutable_data_ptr()); }

// The row kernels below ask for 512-bit vectors where -march=native prefers 256 (as silu_mul_row does): bf16's
// rounding, emulated in integer ops at every product, makes them compute-bound, not memory-bound.
#define RAYLM_WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))

// out[i] = w[i] * (x[i] * inv_rms(x)), one row of n; for bf16 / fp16 as HF: the normalized value
// rounded, then the weight's product rounded
template <typename T>
RAYLM_WIDE_VECTORS inline void norm_row(S_t<T>* __restrict out, const S_t<T>* __restrict x,
                                        const S_t<T>* __restrict w, int64_t n, float eps) {
  using E = Elem<T>;
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += E::ld(x[i]) * E::ld(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = E::st(E::ld(w[i]) * E::rnd(E::ld(x[i]) * r));
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " like x");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have unit stride along its last dim");
}

// the element type x's dtype names (float32, bfloat16, float16), as T
template <typename F>
void dispatch(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  const auto dt = x.scalar_type();
  check_rows(x, "x", dt);
  check_rows(out, "out", dt);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), "out must be contiguous, shaped like x");
  TORCH_CHECK(weight.scalar_type() == dt && weight.is_contiguous() && weight.numel() == x.size(-1),
              "weight must be a contiguous [n] of x's dtype");
  TORCH_CHECK(x.dim() == 2 || (x.dim() == 3 && x.stride(1) == x.size(2)),
              "x must be [T, n] or [T, H, n] with each token's heads contiguous");
  const int64_t n = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1, rows = x.size(0) * heads, xs = x.stride(0);
  const float e = static_cast<float>(eps);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const auto* xp = in_ptr<T>(x);
    const auto* wp = in_ptr<T>(weight);
    auto* op = out_ptr<T>(out);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) norm_row<T>(op + r * n, xp + (r / heads) * xs + (r % heads) * n, wp, n, e);
    });
  });
}

// one row of add_rms_norm: s = x + residual (rounded), out = norm_row(s)
template <typename T>
RAYLM_WIDE_VECTORS __attribute__((noinline)) void add_norm_row(
    S_t<T>* __restrict out, S_t<T>* __restrict s, const S_t<T>* __restrict a, const S_t<T>* __restrict c,
    const S_t<T>* __restrict w, int64_t n, float eps) {
  using E = Elem<T>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = E::st(E::ld(a[i]) + E::ld(c[i]));  // the sum rounded, as HF adds
  norm_row<T>(out, s, w, n, eps);
}

void add_rms_norm(at::Tensor out, at::Tensor sum, at::Tensor x, at::Tensor residual, at::Tensor weight,
                  double eps) {
  const auto dt = x.scalar_type();
  check_rows(x, "x", dt);
  check_rows(residual, "residual", dt);
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be the same [T, n]");
  TORCH_CHECK(out.is_contiguous() && sum.is_contiguous() && out.sizes() == x.sizes() && sum.sizes() == x.sizes(),
              "out and sum must be contiguous, shaped like x");
  TORCH_CHECK(out.scalar_type() == dt && sum.scalar_type() == dt, "out and sum must be of x's dtype");
  TORCH_CHECK(weight.scalar_type() == dt && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be a contiguous [n] of x's dtype");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  const float e = static_cast<float>(eps);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const auto* xp = in_ptr<T>(x);
    const auto* rp = in_ptr<T>(residual);
    const auto* wp = in_ptr<T>(weight);
    auto* op = out_ptr<T>(out);
    auto* sp = out_ptr<T>(sum);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) add_norm_row<T>(op + r * n, sp + r * n, xp + r * xs, rp + r * rs, wp, n, e);
    });
  });
}

// per head: RMSNorm over head_dim (none where w is null), then rotate-half RoPE with this token's
// cos / sin; for bf16 / fp16 as HF's x * cos + rotate_half(x) * sin: each product rounded, then their sum
template <typename T>
inline void norm_rope_head(S_t<T>* __restrict out, const S_t<T>* __restrict x, const S_t<T>* __restrict w,
                           const S_t<T>* __restrict cos, const S_t<T>* __restrict sin, int64_t d, float eps,
                           S_t<T>* __restrict tmp) {
  using E = Elem<T>;
  if (w != nullptr)
    norm_row<T>(tmp, x, w, d, eps);
  else
    std::memcpy(tmp, x, d * sizeof(S_t<T>));
  const int64_t half = d / 2;
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      out[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
      out[i + half] = tmp[i + half] * cos[i + half] + tmp[i] * sin[i + half];
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = E::ld(tmp[i]), b = E::ld(tmp[i + half]);
      out[i] = E::st(E::rnd(a * E::ld(cos[i])) - E::rnd(b * E::ld(sin[i])));
      out[i + half] = E::st(E::rnd(b * E::ld(cos[i + half])) + E::rnd(a * E::ld(sin[i + half])));
    }
  }
}

// one token's heads (nh of q, nkv of k) through norm_rope_head
template <typename T>
RAYLM_WIDE_VECTORS __attribute__((noinline)) void norm_rope_token(
    S_t<T>* qo, S_t<T>* ko, const S_t<T>* q, const S_t<T>* k, const S_t<T>* qw, const S_t<T>* kw, const S_t<T>* c,
    const S_t<T>* s, int64_t nh, int64_t nkv, int64_t d, float eps, S_t<T>* tmp) {
  for (int64_t h = 0; h < nh; ++h) norm_rope_head<T>(qo + h * d, q + h * d, qw, c, s, d, eps, tmp);
  for (int64_t h = 0; h < nkv; ++h) norm_rope_head<T>(ko + h * d, k + h * d, kw, c, s, d, eps, tmp);
}

// q_weight / k_weight absent: RoPE alone (a model without q/k norms: an EAGLE-3 head)
void qk_norm_rope(at::Tensor q_out, at::Tensor k_out, at::Tensor q, at::Tensor k, std::optional<at::Tensor> q_weight,
                  std::optional<at::Tensor> k_weight, double eps, at::Tensor cos, at::Tensor sin) {
  const auto dt = q.scalar_type();
  for (const auto* t : {&q, &k, &cos, &sin}) check_rows(*t, "q / k / cos / sin", dt);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [T, H, D] and k [T, KVH, D] must agree on T and D");
  const int64_t t = q.size(0), nh = q.size(1), nkv = k.size(1), d = q.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(q.stride(1) == d && k.stride(1) == d, "each token's heads must be contiguous");
  TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous() && q_out.sizes() == q.sizes() &&
                  k_out.sizes() == k.sizes() && q_out.scalar_type() == dt && k_out.scalar_type() == dt,
              "q_out / k_out must be contiguous, of q's dtype, shaped like q / k");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d && sin.sizes() == cos.sizes() &&
                  cos.stride(0) == sin.stride(0),
              "cos / sin must be [T, D]");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "q / k norm weights: both or neither");
  if (q_weight)
    TORCH_CHECK(q_weight->numel() == d && k_weight->numel() == d && q_weight->is_contiguous() &&
                    k_weight->is_contiguous() && q_weight->scalar_type() == dt && k_weight->scalar_type() == dt,
                "q / k norm weights must be contiguous [D] of q's dtype");
  const int64_t qs = q.stride(0), ks = k.stride(0), cs = cos.stride(0);
  const float e = static_cast<float>(eps);
  dispatch(q, [&](auto tag) {
    using T = decltype(tag);
    const auto* qp = in_ptr<T>(q);
    const auto* kp = in_ptr<T>(k);
    const auto* cp = in_ptr<T>(cos);
    const auto* sp = in_ptr<T>(sin);
    const S_t<T>* qw = q_weight ? in_ptr<T>(*q_weight) : nullptr;
    const S_t<T>* kw = k_weight ? in_ptr<T>(*k_weight) : nullptr;
    auto* qo = out_ptr<T>(q_out);
    auto* ko = out_ptr<T>(k_out);
    at::parallel_for(0, t, grain_rows((nh + nkv) * d), [&](int64_t b, int64_t end) {
      std::vector<S_t<T>> tmp(d);
      for (int64_t i = b; i < end; ++i)
        norm_rope_token<T>(qo + i * nh * d, ko + i * nkv * d, qp + i * qs, kp + i * ks, qw, kw, cp + i * cs,
                           sp + i * cs, nh, nkv, d, e, tmp.data());
    });
  });
}

// o[i] = silu(g[i]) * u[i] for bf16 / fp16, as torch: silu in fp32, rounded, then the product rounded
// (exp and the divide make this compute-bound)
template <typename T>
RAYLM_WIDE_VECTORS __attribute__((noinline)) void silu_mul_row(S_t<T>* __restrict o, const S_t<T>* __restrict g,
                                                               const S_t<T>* __restrict u, int64_t n) {
  using E = Elem<T>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = E::ld(g[i]);
    o[i] = E::st(E::rnd(gi / (1.f + raylm::fast_exp(-gi))) * E::ld(u[i]));
  }
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  const auto dt = x.scalar_type();
  check_rows(x, "x", dt);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2I] (gate, then up)");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, xs = x.stride(0);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dt && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == inter,
              "out must be a contiguous [T, I] of x's dtype");
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const auto* xp = in_ptr<T>(x);
    auto* op = out_ptr<T>(out);
    at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) {
        const auto* g = xp + r * xs;
        const auto* u = g + inter;
        auto* o = op + r * inter;
        if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
          for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + raylm::fast_exp(-g[i])) * u[i];
        } else {
          silu_mul_row<T>(o, g, u, inter);
        }
      }
    });
  });
}

// x [T, K] -> int8 out: per token and symmetric where `scales` is given (W8A8's dynamic activations,
// as weights.quantize_rows: scale = max(max |x|, FLT_MIN) / 127 written to scales[t], q =
// clamp(round-half-even(x / scale))), else by the one static scale and offset (weights.quantize_static:
// clamp(round(x / scale + offset))); true divisions, as torch's
void quantize_int8(at::Tensor& out, const at::Tensor& x, float* scales, float scale, float offset) {
  check_rows(x, "x", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "x must be [T, K]");
  const int64_t rows = x.size(0), k = x.size(1), xs = x.stride(0);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kChar && out.sizes() == x.sizes(),
              "out must be a contiguous int8 [T, K]");
  auto* op = out.data_ptr<int8_t>();
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    using E = Elem<T>;
    const auto* xp = in_ptr<T>(x);
    at::parallel_for(0, rows, grain_rows(k), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) {
        const S_t<T>* xr = xp + r * xs;
        float s = scale, z = offset;
        if (scales != nullptr) {
          float amax = 0.f;
#pragma omp simd reduction(max : amax)
          for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(E::ld(xr[i])));
          s = scales[r] = std::max(amax, std::numeric_limits<float>::min()) / 127.f;
          z = 0.f;
        }
        int8_t* o = op + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) o[i] = raylm::round_to_int8(E::ld(xr[i]) / s + z);
      }
    });
  });
}

void quant_rows_int8(at::Tensor out, at::Tensor scales, at::Tensor x) {
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == x.size(0),
              "scales must be a contiguous float32 [T]");
  quantize_int8(out, x, scales.data_ptr<float>(), 0.f, 0.f);
}

void quant_static_int8(at::Tensor out, at::Tensor x, double scale, double offset) {
  quantize_int8(out, x, nullptr, static_cast<float>(scale), static_cast<float>(offset));
}

// out[t, j] = dtype((acc[t, j] * row_scale[t]) + col_bias[j]) in fp32, either factor optional: an
// int8 GEMM's fp32 output finished in one pass (the multiply, the add and the rounding torch would
// run as three)
void scale_rows(at::Tensor out, at::Tensor acc, std::optional<at::Tensor> row_scale,
                std::optional<at::Tensor> col_bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kFloat,
              "acc must be a contiguous float32 [T, N]");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == acc.sizes(), "out must be a contiguous [T, N]");
  if (row_scale) TORCH_CHECK(row_scale->is_contiguous() && row_scale->scalar_type() == at::kFloat &&
                                 row_scale->numel() == rows, "row_scale must be a contiguous float32 [T]");
  if (col_bias) TORCH_CHECK(col_bias->is_contiguous() && col_bias->scalar_type() == at::kFloat &&
                                col_bias->numel() == n, "col_bias must be a contiguous float32 [N]");
  const float* ap = acc.data_ptr<float>();
  const float* rs = row_scale ? row_scale->data_ptr<float>() : nullptr;
  const float* cb = col_bias ? col_bias->data_ptr<float>() : nullptr;
  dispatch(out, [&](auto tag) {
    using T = decltype(tag);
    using E = Elem<T>;
    auto* op = out_ptr<T>(out);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) {
        const float* a = ap + r * n;
        S_t<T>* o = op + r * n;
        const float f = rs ? rs[r] : 1.f;
        if (cb) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) o[j] = E::st((rs ? a[j] * f : a[j]) + cb[j]);
        } else {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) o[j] = E::st(a[j] * f);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps) -> ()");
  m.def("qk_norm_rope(Tensor(a!) q_out, Tensor(b!) k_out, Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, "
        "float eps, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("quant_rows_int8(Tensor(a!) out, Tensor(b!) scales, Tensor x) -> ()");
  m.def("quant_static_int8(Tensor(a!) out, Tensor x, float scale, float offset) -> ()");
  m.def("scale_rows(Tensor(a!) out, Tensor acc, Tensor? row_scale, Tensor? col_bias) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("quant_rows_int8", &quant_rows_int8);
  m.impl("quant_static_int8", &quant_static_int8);
  m.impl("scale_rows", &scale_rows);
}
