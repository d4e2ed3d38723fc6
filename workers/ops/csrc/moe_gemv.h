// Register-blocked dot products of weight rows with token rows, for the fused MoE kernel
// (fused_moe.cpp): the weights read where they lie in their own dtype (fp32, bf16 or fp16) and
// widened to fp32 in registers, the tokens in fp32. An RB x NB block (RB weight rows, NB tokens)
// runs along the rows' contiguous axis, each weight vector loaded once for NB tokens. AVX-512 and
// AVX2 (+FMA, F16C) by -march=native; a portable one-lane fallback elsewhere.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace raylm::moe {

// -- fp32 vectors, loaded from fp32 / bf16 / fp16 and widened in registers --------------------------
#if defined(__AVX512F__)
constexpr int64_t VL = 16;
constexpr int RB = 4, NB = 6;  // 24 accumulators + 4 weight vectors + 1 token vector of 32 registers
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {  // bf16 is fp32's top half: widen, shift into place
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t VL = 8;
constexpr int RB = 2, NB = 6;  // 12 accumulators + 2 weight vectors + 1 token vector of 16 registers
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
constexpr const char* kIsa = "avx2";
#else  // portable: one lane, what the compiler makes of it
constexpr int64_t VL = 1;
constexpr int RB = 4, NB = 2;
using vf = float;
inline vf vzero() { return 0.f; }
template <typename W>
inline vf vload(const W* p) { return static_cast<float>(*p); }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline float vsum(vf a) { return a; }
constexpr const char* kIsa = "scalar";
#endif

// out[n * ldo + r] = dot(w[r * K ...], x[n][...]) over K, for R rows and N tokens. A block of R > 1
// rows also asks for its share of the next block's rows into L2 (pf: where this pass's share
// starts, same row stride; pf_step: elements it advances per iteration, 16.16 fixed point). Each
// weight row of a real layer is a page or more, where the hardware prefetchers start cold; asked
// for across all of a block's passes over its tokens, the next block arrives while this one is
// computed on, at the pace memory gives.
template <int R, int N, typename W>
inline void dot_block(const W* __restrict w, int64_t K, const float* const* x, float* out, int64_t ldo,
                      const W* pf, int64_t pf_step) {
  vf acc[R][N];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) acc[r][n] = vzero();
  int64_t k = 0, pf_at = 0;
  for (; k + VL <= K; k += VL) {
    if constexpr (R > 1) {
      const W* p = pf + (pf_at >> 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) __builtin_prefetch(p + r * K, 0, 2);
      pf_at += pf_step;
    }
    vf wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = vload(w + r * K + k);
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      const vf xv = vload(x[n] + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][n] = vfma(wv[r], xv, acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) {
      float s = vsum(acc[r][n]);
      for (int64_t t = k; t < K; ++t) s += static_cast<float>(w[r * K + t]) * x[n][t];
      out[n * ldo + r] = s;
    }
}

template <int R, typename W>
inline void dot_rows(int64_t n, const W* w, int64_t K, const float* const* x, float* out, int64_t ldo,
                     const W* pf, int64_t pf_step) {
  if constexpr (NB >= 6) {
    if (n == 6) return dot_block<R, 6>(w, K, x, out, ldo, pf, pf_step);
    if (n == 5) return dot_block<R, 5>(w, K, x, out, ldo, pf, pf_step);
  }
  if constexpr (NB >= 4) {
    if (n == 4) return dot_block<R, 4>(w, K, x, out, ldo, pf, pf_step);
    if (n == 3) return dot_block<R, 3>(w, K, x, out, ldo, pf, pf_step);
  }
  if (n == 2) return dot_block<R, 2>(w, K, x, out, ldo, pf, pf_step);
  dot_block<R, 1>(w, K, x, out, ldo, pf, pf_step);
}

// y[n * ldy + r] = dot(w row r, x[n]) for `rows` consecutive weight rows of length K and m tokens:
// RB rows at a time (that block stays in L1 while it meets every token), NB tokens a pass; the
// passes over a block prefetch the next block, or after the last `next` (the rows the caller
// reads next, or null)
template <typename W>
void gemv_rows(const W* w, int64_t rows, int64_t K, const float* const* x, int64_t m, float* y, int64_t ldy,
               const W* next) {
  const int64_t passes = (m + NB - 1) / NB, share = (K + passes - 1) / passes;
  const int64_t step = (VL << 16) / passes;
  int64_t r = 0;
  for (; r + RB <= rows; r += RB) {
    const W* pf = r + RB < rows ? w + (r + RB) * K : (next ? next : w + r * K);
    for (int64_t n = 0, p = 0; n < m; n += NB, ++p)
      dot_rows<RB>(std::min<int64_t>(NB, m - n), w + r * K, K, x + n, y + n * ldy + r, ldy, pf + p * share, step);
  }
  for (; r < rows; ++r)
    for (int64_t n = 0; n < m; n += NB)
      dot_rows<1>(std::min<int64_t>(NB, m - n), w + r * K, K, x + n, y + n * ldy + r, ldy, w, 0);
}

}  // namespace raylm::moe
