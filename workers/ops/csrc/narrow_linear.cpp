// A linear whose weight is narrower than its activations: y [m, rows] = x [m, K] @ w [rows, K]^T with
// x in fp32 and w in bf16 / fp16 (or fp32), read at its own width and widened in registers. For the
// weights of a bf16 checkpoint computing in fp32 on a CPU: bf16 -> fp32 is exact, so the arithmetic
// is fp32's while a step reads half the bytes.
//
// The weight is packed once (narrow_pack) into panels of NR = 2 vectors of rows, k-major: panel p
// holds w[p * NR + j][k] at [p][k][j] (rows past the end are zeros). A panel's slice of KC columns
// stays in L1 while the micro-kernel, an outer product, runs over the tokens: per k it loads the
// panel's two weight vectors, broadcasts x[i][k] for MR tokens and adds 2 * MR FMAs into
// accumulators held in registers (each slice's sum one fp32 chain over its k in order, added to the
// sum of the earlier slices). Tokens go in blocks whose rows of x stay in L2 while the
// thread's panels stream past them; small batches are one block, bound by reading the weight once.
// Panels are split among torch's threads.
#include <ATen/Parallel.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "moe_gemv.h"

#ifndef KC_
#define KC_ 256
#endif
#ifndef XBLOCK_BYTES_
#define XBLOCK_BYTES_ (256 * 1024)
#endif

namespace {

using raylm::moe::vf;
using raylm::moe::vfma;
using raylm::moe::VL;
using raylm::moe::vload;
using raylm::moe::vzero;

constexpr int64_t NR = 2 * VL;  // weight rows a panel holds: two vectors
constexpr int64_t KC = KC_;     // k a pass over a panel's tokens takes (its panel and tokens stay in L1)
constexpr int64_t XBLOCK_BYTES = XBLOCK_BYTES_;  // x a block of tokens may take (half a small L2)
// A panel's NR values at one k, as two fp32 vectors (rows [0, VL) and [VL, NR)). bf16 panels are
// packed interleaved (row j at 2j, row VL + j at 2j + 1: see narrow_pack), so one full-width load
// splits into the two by a shift and a mask, with no lane-crossing widen.
template <typename W>
inline void vload2(const W* p, vf& w0, vf& w1) {
  w0 = vload(p);
  w1 = vload(p + VL);
}
#if defined(__AVX512F__)
constexpr int MR = 12;  // 24 accumulators + 2 weight vectors + 1 broadcast of 32 registers
inline vf vbroadcast(float v) { return _mm512_set1_ps(v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
template <>
inline void vload2(const c10::BFloat16* p, vf& w0, vf& w1) {
  const __m512i v = _mm512_loadu_si512(p);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  w1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int MR = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
inline vf vbroadcast(float v) { return _mm256_set1_ps(v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
template <>
inline void vload2(const c10::BFloat16* p, vf& w0, vf& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
constexpr int MR = 4;
inline vf vbroadcast(float v) { return v; }
inline vf vadd(vf a, vf b) { return a + b; }
inline void vstore(float* p, vf v) { *p = v; }
#endif

// out[i * ldo + j] (j < n) (+)= sum over k in [0, kc) of x[i][k0 + k] * panel[k][j], for M tokens:
// each slice's sum is one fp32 chain, added to out's sum of the earlier slices when accumulate (two
// levels, so the rounding error grows with KC + K / KC terms rather than with K)
template <int M, typename W>
inline void panel_block(const W* __restrict panel, int64_t kc, bool accumulate, const float* const* x,
                        int64_t k0, float* out, int64_t ldo, int64_t n) {
  vf acc[M][2];
  alignas(64) float tmp[NR];
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = vzero();
  const float* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = x[i] + k0;
  for (int64_t k = 0; k < kc; ++k) {
    vf w0, w1;
    vload2(panel + k * NR, w0, w1);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const vf xb = vbroadcast(xr[i][k]);
      acc[i][0] = vfma(w0, xb, acc[i][0]);
      acc[i][1] = vfma(w1, xb, acc[i][1]);
    }
  }
  if (n == NR) {
    for (int i = 0; i < M; ++i) {
      float* o = out + i * ldo;
      vstore(o, accumulate ? vadd(vload(o), acc[i][0]) : acc[i][0]);
      vstore(o + VL, accumulate ? vadd(vload(o + VL), acc[i][1]) : acc[i][1]);
    }
    return;
  }
  for (int i = 0; i < M; ++i) {
    vstore(tmp, acc[i][0]);
    vstore(tmp + VL, acc[i][1]);
    for (int64_t j = 0; j < n; ++j) out[i * ldo + j] = accumulate ? out[i * ldo + j] + tmp[j] : tmp[j];
  }
}

// panel_block<m> for a run-time m in [1, MR]
template <typename W, int M = MR>
inline void panel_rows(int m, const W* panel, int64_t kc, bool accumulate, const float* const* x, int64_t k0,
                       float* out, int64_t ldo, int64_t n) {
  if constexpr (M > 1) {
    if (m < M) return panel_rows<W, M - 1>(m, panel, kc, accumulate, x, k0, out, ldo, n);
  }
  panel_block<M>(panel, kc, accumulate, x, k0, out, ldo, n);
}

template <typename W>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& packed) {
  const int64_t m = x.size(0), K = x.size(1), rows = y.size(1);
  std::vector<const float*> xs(m);
  for (int64_t i = 0; i < m; ++i) xs[i] = x.data_ptr<float>() + i * x.stride(0);
  const W* wp = packed.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0), panels = (rows + NR - 1) / NR;
  // tokens a block takes: its rows of x stay in L2 while the thread's panels stream past them
  const int64_t mc = std::max<int64_t>(MR, XBLOCK_BYTES / (K * static_cast<int64_t>(sizeof(float))) / MR * MR);
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += mc) {
      const int64_t i1 = std::min(m, i0 + mc);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n = std::min(NR, rows - p * NR);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min(KC, K - k0);
          for (int64_t i = i0; i < i1; i += MR)
            panel_rows<W>(static_cast<int>(std::min<int64_t>(MR, i1 - i)), wp + (p * K + k0) * NR, kc, k0 > 0,
                          xs.data() + i, k0, yp + i * ldy + p * NR, ldy, n);
        }
      }
    }
  });
}

// w [rows, K] -> [ceil(rows / NR), K, NR] in w's dtype, rows past the end zero; bf16 panels
// interleave their two halves (slot 2j: row j, slot 2j + 1: row VL + j), as vload2 reads them
at::Tensor narrow_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "narrow_pack takes a 2-d weight");
  const int64_t rows = w.size(0), K = w.size(1), panels = (rows + NR - 1) / NR;
  at::Tensor padded = at::zeros({panels * NR, K}, w.options());
  padded.narrow(0, 0, rows).copy_(w);
  at::Tensor p = padded.view({panels, NR, K});
  if (w.scalar_type() == at::kBFloat16) {
    std::vector<int64_t> order(NR);
    for (int64_t e = 0; e < NR; ++e) order[e] = e % 2 == 0 ? e / 2 : VL + e / 2;
    p = p.index_select(1, at::tensor(order, at::kLong));
  }
  return p.transpose(1, 2).contiguous();
}

// y [m, rows] (fp32, row stride >= rows) = x [m, K] (fp32, contiguous rows) @ w[:rows]^T, w packed
void narrow_linear(at::Tensor y, at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && packed.dim() == 3, "narrow_linear takes 2-d x, y and a packed w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "x and y must be float32");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && packed.is_contiguous(),
              "x and y rows, and the packed w, must be contiguous");
  TORCH_CHECK(packed.size(2) == NR && packed.size(1) == x.size(1), "w must be packed by narrow_pack for x's width");
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) <= packed.size(0) * NR, "y must be [x rows, <= w rows]");
  if (x.size(0) == 0 || y.size(1) == 0) return;
  switch (packed.scalar_type()) {
    case at::kBFloat16: return run<c10::BFloat16>(y, x, packed);
    case at::kHalf: return run<c10::Half>(y, x, packed);
    case at::kFloat: return run<float>(y, x, packed);
    default: TORCH_CHECK(false, "w must be bfloat16, float16 or float32, got ", packed.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("narrow_linear(Tensor(a!) y, Tensor x, Tensor w) -> ()");
  m.def("narrow_pack(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("narrow_linear", &narrow_linear);
  m.impl("narrow_pack", &narrow_pack);
}
