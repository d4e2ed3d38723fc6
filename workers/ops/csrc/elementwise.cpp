// Fused elementwise ops for the CPU op table (fp32): what eager torch runs as 5-10 separate
// ops, each a pass over memory and a dispatch, done in one pass per row.
//
// - rms_norm / add_rms_norm: Qwen3RMSNorm (x * rsqrt(mean(x^2) + eps), then * weight), the
//   residual add fused in front;
// - qk_norm_rope: Qwen3's per-head q/k RMSNorm and neox rotary embedding, read from the qkv
//   projection's output and written contiguous for attention;
// - silu_and_mul: SwiGLU's silu(gate) * up over the fused gate/up output.
// The math follows the reference's order (multiply by the inverse norm, then by the weight);
// sums of squares are accumulated in a different order than torch's, so results agree to
// float rounding, not bit for bit (tests/workers/test_cpu_kernels.py checks it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kGrainElements = 16384;  // rows per thread chunk: at least this many elements

inline int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_len)); }

// out[i] = w[i] * (x[i] * inv_rms(x)), one row of n
inline void norm_row(float* __restrict out, const float* __restrict x, const float* __restrict w, int64_t n,
                     float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have unit stride along its last dim");
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), "out must be contiguous, shaped like x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(-1),
              "weight must be a contiguous float32 [n]");
  TORCH_CHECK(x.dim() == 2 || (x.dim() == 3 && x.stride(1) == x.size(2)),
              "x must be [T, n] or [T, H, n] with each token's heads contiguous");
  const int64_t n = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1, rows = x.size(0) * heads, xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) norm_row(op + r * n, xp + (r / heads) * xs + (r % heads) * n, wp, n, e);
  });
}

void add_rms_norm(at::Tensor out, at::Tensor sum, at::Tensor x, at::Tensor residual, at::Tensor weight,
                  double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be the same [T, n]");
  TORCH_CHECK(out.is_contiguous() && sum.is_contiguous() && out.sizes() == x.sizes() && sum.sizes() == x.sizes(),
              "out and sum must be contiguous, shaped like x");
  TORCH_CHECK(out.scalar_type() == at::kFloat && sum.scalar_type() == at::kFloat, "out and sum must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be a contiguous float32 [n]");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      float* s = sp + r * n;
      const float* a = xp + r * xs;
      const float* c = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = a[i] + c[i];
      norm_row(op + r * n, s, wp, n, e);
    }
  });
}

// per head: RMSNorm over head_dim, then rotate-half RoPE with this token's cos / sin
inline void norm_rope_head(float* __restrict out, const float* __restrict x, const float* __restrict w,
                           const float* __restrict cos, const float* __restrict sin, int64_t d, float eps,
                           float* __restrict tmp) {
  norm_row(tmp, x, w, d, eps);
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
    out[i + half] = tmp[i + half] * cos[i + half] + tmp[i] * sin[i + half];
  }
}

void qk_norm_rope(at::Tensor q_out, at::Tensor k_out, at::Tensor q, at::Tensor k, at::Tensor q_weight,
                  at::Tensor k_weight, double eps, at::Tensor cos, at::Tensor sin) {
  for (const auto* t : {&q, &k, &cos, &sin}) check_rows(*t, "q / k / cos / sin");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [T, H, D] and k [T, KVH, D] must agree on T and D");
  const int64_t t = q.size(0), nh = q.size(1), nkv = k.size(1), d = q.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(q.stride(1) == d && k.stride(1) == d, "each token's heads must be contiguous");
  TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous() && q_out.sizes() == q.sizes() &&
                  k_out.sizes() == k.sizes() && q_out.scalar_type() == at::kFloat && k_out.scalar_type() == at::kFloat,
              "q_out / k_out must be contiguous float32, shaped like q / k");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d && sin.sizes() == cos.sizes() &&
                  cos.stride(0) == sin.stride(0),
              "cos / sin must be [T, D]");
  TORCH_CHECK(q_weight.numel() == d && k_weight.numel() == d && q_weight.is_contiguous() && k_weight.is_contiguous() &&
                  q_weight.scalar_type() == at::kFloat && k_weight.scalar_type() == at::kFloat,
              "q / k norm weights must be contiguous float32 [D]");
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* qw = q_weight.data_ptr<float>();
  const float* kw = k_weight.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), cs = cos.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, grain_rows((nh + nkv) * d), [&](int64_t b, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t i = b; i < end; ++i) {
      const float* c = cp + i * cs;
      const float* s = sp + i * cs;
      for (int64_t h = 0; h < nh; ++h) norm_rope_head(qo + (i * nh + h) * d, qp + i * qs + h * d, qw, c, s, d, e, tmp.data());
      for (int64_t h = 0; h < nkv; ++h) norm_rope_head(ko + (i * nkv + h) * d, kp + i * ks + h * d, kw, c, s, d, e, tmp.data());
    }
  });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2I] (gate, then up)");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, xs = x.stride(0);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == inter,
              "out must be a contiguous float32 [T, I]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const float* g = xp + r * xs;
      const float* u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + raylm::fast_exp(-g[i])) * u[i];
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps) -> ()");
  m.def("qk_norm_rope(Tensor(a!) q_out, Tensor(b!) k_out, Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
        "float eps, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("silu_and_mul", &silu_and_mul);
}
