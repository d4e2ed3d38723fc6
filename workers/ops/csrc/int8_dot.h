// Register-blocked int8 dot products for the int8 fused MoE (fused_moe.cpp's fused_moe_int8): int8
// weight rows against token rows already quantized to int8, exact int32 sums. A weight vector is loaded
// once for NB tokens. With AVX512-VNNI, tokens are held as unsigned bytes (value + 128) and VPDPBUSD
// multiplies 64 byte pairs and sums them by fours into int32 in one instruction; the bias comes off as
// 128 x the weight row's sum, taken by the same instruction against ones. Without it (AVX-512BW, AVX2),
// tokens are held widened to int16 and each weight vector is widened in registers, multiplied pairwise
// and pair-summed (madd: two products of at most 2^14 each, no saturation). A portable one-lane
// fallback elsewhere.
#pragma once

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace raylm::int8 {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RAYLM_INT8_VNNI 1
constexpr int64_t VL = 64;  // byte lanes
constexpr int RB = 4, NB = 4;
using xq_t = uint8_t;  // a token's int8 value + 128
inline xq_t encode(int8_t v) { return static_cast<xq_t>(static_cast<int32_t>(v) + 128); }
inline int32_t decode(xq_t v) { return static_cast<int32_t>(v) - 128; }
using vi = __m512i;
inline vi vzero() { return _mm512_setzero_si512(); }
inline vi wload(const int8_t* p) { return _mm512_loadu_si512(p); }
inline vi xload(const xq_t* p) { return _mm512_loadu_si512(p); }
inline vi vdot(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, x, w); }  // unsigned x, signed w
inline int32_t vsum(vi a) { return _mm512_reduce_add_epi32(a); }
constexpr const char* kIsa = "avx512vnni";
#elif defined(__AVX512BW__)
constexpr int64_t VL = 32;  // int16 lanes
using xq_t = int16_t;
inline xq_t encode(int8_t v) { return v; }
inline int32_t decode(xq_t v) { return v; }
constexpr int RB = 4, NB = 4;
using vi = __m512i;
inline vi vzero() { return _mm512_setzero_si512(); }
inline vi wload(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vi xload(const xq_t* p) { return _mm512_loadu_si512(p); }
inline vi vdot(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
inline int32_t vsum(vi a) { return _mm512_reduce_add_epi32(a); }
constexpr const char* kIsa = "avx512bw";
#elif defined(__AVX2__)
constexpr int64_t VL = 16;
constexpr int RB = 2, NB = 4;
using xq_t = int16_t;
inline xq_t encode(int8_t v) { return v; }
inline int32_t decode(xq_t v) { return v; }
using vi = __m256i;
inline vi vzero() { return _mm256_setzero_si256(); }
inline vi wload(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi xload(const xq_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi vdot(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline int32_t vsum(vi a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
constexpr const char* kIsa = "avx2";
#else
constexpr int64_t VL = 1;
constexpr int RB = 4, NB = 2;
using xq_t = int16_t;
inline xq_t encode(int8_t v) { return v; }
inline int32_t decode(xq_t v) { return v; }
using vi = int32_t;
inline vi vzero() { return 0; }
inline vi wload(const int8_t* p) { return *p; }
inline vi xload(const xq_t* p) { return *p; }
inline vi vdot(vi acc, vi a, vi b) { return acc + a * b; }
inline int32_t vsum(vi a) { return a; }
constexpr const char* kIsa = "scalar";
#endif

// out[n * ldo + r] = sum_k w[r * K + k] * x[n][k] for R rows and N tokens
template <int R, int N>
inline void dot_block(const int8_t* __restrict w, int64_t K, const xq_t* const* x, int32_t* out, int64_t ldo) {
  vi acc[R][N];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) acc[r][n] = vzero();
#ifdef RAYLM_INT8_VNNI
  vi wsum[R];  // each weight row's sum, for the tokens' +128
  const vi ones = _mm512_set1_epi8(1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) wsum[r] = vzero();
#endif
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vi wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = wload(w + r * K + k);
#ifdef RAYLM_INT8_VNNI
      wsum[r] = vdot(wsum[r], wv[r], ones);
#endif
    }
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      const vi xv = xload(x[n] + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][n] = vdot(acc[r][n], wv[r], xv);
    }
  }
#ifdef RAYLM_INT8_VNNI
  if (k < K) {  // the last K % 64 columns by masked loads (zeros elsewhere add nothing to either sum). Not a
    // scalar loop: GCC 12 -O3 turns one into its own VPDPBUSD pattern and gets it wrong
    const __mmask64 mask = (~0ULL) >> (64 - (K - k));
    vi wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_maskz_loadu_epi8(mask, w + r * K + k);
      wsum[r] = vdot(wsum[r], wv[r], ones);
    }
    for (int n = 0; n < N; ++n) {
      const vi xv = _mm512_maskz_loadu_epi8(mask, x[n] + k);
      for (int r = 0; r < R; ++r) acc[r][n] = vdot(acc[r][n], wv[r], xv);
    }
    k = K;
  }
#endif
  for (int r = 0; r < R; ++r) {
#ifdef RAYLM_INT8_VNNI
    const int32_t bias = 128 * vsum(wsum[r]);
#else
    const int32_t bias = 0;
#endif
    for (int n = 0; n < N; ++n) {
      int32_t s = vsum(acc[r][n]) - bias;
      for (int64_t t = k; t < K; ++t) s += static_cast<int32_t>(w[r * K + t]) * decode(x[n][t]);
      out[n * ldo + r] = s;
    }
  }
}

template <int R>
inline void dot_rows(int64_t n, const int8_t* w, int64_t K, const xq_t* const* x, int32_t* out, int64_t ldo) {
  if constexpr (NB >= 4) {
    if (n == 4) return dot_block<R, 4>(w, K, x, out, ldo);
    if (n == 3) return dot_block<R, 3>(w, K, x, out, ldo);
  }
  if (n == 2) return dot_block<R, 2>(w, K, x, out, ldo);
  dot_block<R, 1>(w, K, x, out, ldo);
}

// y[n * ldy + r] = w row r . x[n] for `rows` consecutive int8 rows of length K and m tokens: RB rows at
// a time (they stay in L1 while they meet every token), NB tokens a pass
inline void gemv_rows(const int8_t* w, int64_t rows, int64_t K, const xq_t* const* x, int64_t m, int32_t* y,
                      int64_t ldy) {
  int64_t r = 0;
  for (; r + RB <= rows; r += RB)
    for (int64_t n = 0; n < m; n += NB)
      dot_rows<RB>(std::min<int64_t>(NB, m - n), w + r * K, K, x + n, y + n * ldy + r, ldy);
  for (; r < rows; ++r)
    for (int64_t n = 0; n < m; n += NB)
      dot_rows<1>(std::min<int64_t>(NB, m - n), w + r * K, K, x + n, y + n * ldy + r, ldy);
}

}  // namespace raylm::int8
