// The packed-panel GEMM micro-kernel shared by the narrow linear (narrow_linear.cpp) and the fused
// MoE's packed experts (fused_moe.cpp): y [m, rows] = x [m, K] (fp32) @ w [rows, K]^T with w packed
// once into panels of NR = 2 vectors of rows, k-major (panel p holds w[p * NR + j][k] at [p][k][j],
// rows past the end zero; bf16 panels interleave their two halves, see pack_panels), read at its
// own width (fp32, bf16, fp16) and widened in registers. Per k the micro-kernel loads the panel's
// two weight vectors, broadcasts x[i][k] for MR tokens and adds 2 * MR FMAs into accumulators held
// in registers; each KC-wide slice's sum is one fp32 chain, added to the sum of the earlier slices.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "moe_gemv.h"

#ifndef KC_
#define KC_ 256
#endif

namespace raylm::panel {

using raylm::moe::vf;
using raylm::moe::vfma;
using raylm::moe::VL;
using raylm::moe::vload;
using raylm::moe::vzero;

constexpr int64_t NR = 2 * VL;  // weight rows a panel holds: two vectors
constexpr int64_t KC = KC_;     // k a pass over a panel's tokens takes (its panel and tokens stay in L1)
// A panel's NR values at one k, as two fp32 vectors (rows [0, VL) and [VL, NR)). bf16 panels are
// packed interleaved (row j at 2j, row VL + j at 2j + 1: see pack_panels), so one full-width load
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

// out[i * ldo + j] (j < n) = x[i] . w[p * NR + j] for m tokens (x rows by pointer) and one packed
// panel of K columns: the slices in order, MR tokens at a time
template <typename W>
inline void panel_gemm(const W* panel, int64_t K, int64_t n, const float* const* x, int64_t m, float* out,
                       int64_t ldo) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int64_t i = 0; i < m; i += MR)
      panel_rows<W>(static_cast<int>(std::min<int64_t>(MR, m - i)), panel + k0 * NR, kc, k0 > 0, x + i, k0,
                    out + i * ldo, ldo, n);
  }
}

// w [..., rows, K] -> [..., ceil(rows / NR), K, NR] in w's dtype, rows past the end zero; bf16 panels
// interleave their two halves (slot 2j: row j, slot 2j + 1: row VL + j), as vload2 reads them
inline at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() >= 2, "packing takes a weight of at least 2 dims");
  const int64_t rows = w.size(-2), K = w.size(-1), panels = (rows + NR - 1) / NR;
  std::vector<int64_t> lead(w.sizes().begin(), w.sizes().end() - 2);
  std::vector<int64_t> padded_shape(lead), panel_shape(lead);
  padded_shape.insert(padded_shape.end(), {panels * NR, K});
  panel_shape.insert(panel_shape.end(), {panels, NR, K});
  at::Tensor padded = at::zeros(padded_shape, w.options());
  padded.narrow(-2, 0, rows).copy_(w);
  at::Tensor p = padded.view(panel_shape);
  if (w.scalar_type() == at::kBFloat16) {
    std::vector<int64_t> order(NR);
    for (int64_t e = 0; e < NR; ++e) order[e] = e % 2 == 0 ? e / 2 : VL + e / 2;
    p = p.index_select(-2, at::tensor(order, at::kLong));
  }
  return p.transpose(-2, -1).contiguous();
}

}  // namespace raylm::panel
