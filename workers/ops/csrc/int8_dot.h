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
#include <vector>

#include "amx_tiles.h"

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

#ifdef RAYLM_INT8_VNNI
// -- panels: int8 weights packed in blocks of 16 rows, four columns of each row side by side ([K / 4][16][4]
// bytes a block, AMX-INT8's layout for its second operand), so one VPDPBUSD adds 4 columns' products into 16
// rows' sums at once: no horizontal sum per (row, token), which the row-wise dot pays at every output.
constexpr int64_t PR = 16;  // rows a panel holds

// out[n * ldo + 16p + j] for the P panels from w (each `stride` bytes on) and N tokens (rows of x, 4-byte
// aligned groups of columns), minus 128 x the row sums `wsum` (the tokens' +128). `valid`: rows of the
// last panel to store.
template <int P, int N>
inline void panel_block(const int8_t* w, int64_t stride, int64_t Kq, const xq_t* const* x, const int32_t* wsum,
                        int32_t* out, int64_t ldo, int64_t valid) {
  vi acc[P][N];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) acc[p][n] = vzero();
  for (int64_t q = 0; q < Kq; ++q) {
    vi wv[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_si512(w + p * stride + q * 64);
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      int32_t four;
      __builtin_memcpy(&four, x[n] + 4 * q, 4);
      const vi xb = _mm512_set1_epi32(four);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[p][n] = vdot(acc[p][n], wv[p], xb);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    const vi bias = _mm512_slli_epi32(_mm512_loadu_si512(wsum + p * PR), 7);
    const __mmask16 mask = p + 1 < P || valid >= PR ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) _mm512_mask_storeu_epi32(out + n * ldo + p * PR, mask, _mm512_sub_epi32(acc[p][n], bias));
  }
}

template <int P>
inline void panel_tokens(int64_t n, const int8_t* w, int64_t stride, int64_t Kq, const xq_t* const* x,
                         const int32_t* wsum, int32_t* out, int64_t ldo, int64_t valid) {
  if (n == 4) return panel_block<P, 4>(w, stride, Kq, x, wsum, out, ldo, valid);
  if (n == 3) return panel_block<P, 3>(w, stride, Kq, x, wsum, out, ldo, valid);
  if (n == 2) return panel_block<P, 2>(w, stride, Kq, x, wsum, out, ldo, valid);
  panel_block<P, 1>(w, stride, Kq, x, wsum, out, ldo, valid);
}

// y[n * ldy + r] = row r . x[n] for `rows` rows starting at a panel (w: its first byte; Kq groups of four
// columns; wsum: the rows' sums) and m tokens: four panels at a time, four tokens a pass
inline void panel_rows(const int8_t* w, int64_t rows, int64_t Kq, const xq_t* const* x, int64_t m,
                       const int32_t* wsum, int32_t* y, int64_t ldy) {
  const int64_t stride = Kq * 64, panels = (rows + PR - 1) / PR;
  for (int64_t p = 0; p < panels; p += 4) {
    const int64_t np = std::min<int64_t>(4, panels - p), valid = rows - (p + np - 1) * PR;
    for (int64_t n = 0; n < m; n += 4) {
      const int64_t nt = std::min<int64_t>(4, m - n);
      const int8_t* wp = w + p * stride;
      int32_t* yp = y + n * ldy + p * PR;
      if (np == 4) panel_tokens<4>(nt, wp, stride, Kq, x + n, wsum + p * PR, yp, ldy, valid);
      else if (np == 3) panel_tokens<3>(nt, wp, stride, Kq, x + n, wsum + p * PR, yp, ldy, valid);
      else if (np == 2) panel_tokens<2>(nt, wp, stride, Kq, x + n, wsum + p * PR, yp, ldy, valid);
      else panel_tokens<1>(nt, wp, stride, Kq, x + n, wsum + p * PR, yp, ldy, valid);
    }
  }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define RAYLM_INT8_AMX 1
// AMX-INT8 over the same panels (a panel's 16 column quads from q on are one 1 KiB tile, TDPBUSD's second
// operand), for panels that meet enough tokens to fill tiles' rows: tokens gathered into a contiguous buffer
// of Kp-byte rows, 32 at a time (two 16-row tiles) against two panels (four sums tiles).
constexpr int64_t AMX_MIN_TOKENS = 4;
constexpr int64_t AMX_K = 64;  // columns a tile takes

// outs[j][n * ldo + r] = row r of panel j . x[n] for np (1 or 2) panels and m tokens, x in xs (Kp-byte rows,
// mp rows: m padded to 16)
inline void amx_two_panels(const int8_t* const* panels, const int32_t* const* sums, int32_t* const* outs, int np,
                           int64_t Kp, const xq_t* xs, int64_t m, int64_t mp, int64_t ldo) {
  alignas(64) int32_t tile[16 * 16];
  for (int64_t i0 = 0; i0 < mp; i0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const bool both = i0 + 16 < m;  // a second 16-token tile has tokens in it
    for (int64_t k = 0; k < Kp; k += AMX_K) {
      _tile_loadd(4, xs + i0 * Kp + k, Kp);
      _tile_loadd(6, panels[0] + k * 16, 64);
      _tile_dpbusd(0, 4, 6);
      if (np == 2) {
        _tile_loadd(7, panels[1] + k * 16, 64);
        _tile_dpbusd(1, 4, 7);
      }
      if (both) {
        _tile_loadd(5, xs + (i0 + 16) * Kp + k, Kp);
        _tile_dpbusd(2, 5, 6);
        if (np == 2) _tile_dpbusd(3, 5, 7);
      }
    }
    for (int t = 0; t < 4; ++t) {
      const int j = t & 1, half = t >> 1;
      if (j >= np) continue;
      const int64_t n0 = i0 + 16 * half;
      if (n0 >= m) continue;
      switch (t) {  // a tile's number must be a constant
        case 0: _tile_stored(0, tile, 64); break;
        case 1: _tile_stored(1, tile, 64); break;
        case 2: _tile_stored(2, tile, 64); break;
        default: _tile_stored(3, tile, 64); break;
      }
      const vi bias = _mm512_slli_epi32(_mm512_loadu_si512(sums[j]), 7);
      for (int64_t n = n0; n < std::min(m, n0 + 16); ++n)
        _mm512_storeu_si512(outs[j] + n * ldo, _mm512_sub_epi32(_mm512_loadu_si512(tile + (n - n0) * 16), bias));
    }
  }
}

// panel_rows by AMX-INT8 tiles, where m >= AMX_MIN_TOKENS and the columns are whole tiles (Kq * 4 a multiple
// of 64); returns false where it does not apply. The output's columns are written 16 a panel (every row of
// the last panel: y must have room for them).
inline bool panel_rows_amx(const int8_t* const* w, int nw, int64_t rows, int64_t Kq, const xq_t* const* x, int64_t m,
                           const int32_t* const* wsum, int32_t* const* y, int64_t ldy) {
  const int64_t Kp = Kq * 4;
  if (m < AMX_MIN_TOKENS || Kp % AMX_K != 0 || !raylm::amx::permitted()) return false;
  const int64_t mp = (m + 15) / 16 * 16;
  thread_local std::vector<xq_t> xs;
  xs.resize(mp * Kp);
  for (int64_t n = 0; n < m; ++n) std::copy(x[n], x[n] + Kp, xs.data() + n * Kp);
  std::fill(xs.data() + m * Kp, xs.data() + mp * Kp, encode(0));
  raylm::amx::configure();
  const int64_t stride = Kq * 64, items = (rows + PR - 1) / PR * nw;  // item i: matrix i % nw's panel i / nw
  for (int64_t i = 0; i < items; i += 2) {  // in pairs: a gate panel beside its up panel
    const int np = i + 1 < items ? 2 : 1;
    const int8_t* pw[2];
    const int32_t* ps[2];
    int32_t* po[2];
    for (int k = 0; k < np; ++k) {
      const int64_t p = (i + k) / nw, j = (i + k) % nw;
      pw[k] = w[j] + p * stride;
      ps[k] = wsum[j] + p * PR;
      po[k] = y[j] + p * PR;
    }
    amx_two_panels(pw, ps, po, np, Kp, xs.data(), m, mp, ldy);
  }
  _tile_release();
  return true;
}
#endif  // AMX-INT8

#endif  // RAYLM_INT8_VNNI

}  // namespace raylm::int8
