// Paged attention for the CPU op table: every query token attends over its sequence's keys
// where they lie in the paged pool (no gather, no padding). q, the pool and the output share one
// dtype, fp32, bf16 or fp16; a half-precision pool is read at its own width (half the bytes a decode
// step streams) and widened in registers: scores, softmax and the weighted sum are fp32, and only
// the output is rounded back.
//
// A token t reads the block table row token_rows[t] and sees its first token_lens[t] keys
// (a decode row: all of its context; a prefill chunk's token i after `cached` tokens:
// cached + i + 1, which is the causal mask). Two passes over the context (scores, then the
// weighted sum of values) with one token's scores in a per-thread buffer: the context is
// read twice, never copied.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

using raylm::BF16;
using raylm::F16;
using raylm::F32;

template <typename E>
inline float dot(const float* __restrict a, const typename E::T* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * E::widen(b[i]);
  return s;
}

template <typename E>
inline void axpy(float* __restrict y, const typename E::T* __restrict x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * E::widen(x[i]);
}

// the cache lines of `n` elements from p, asked for ahead of their use
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  constexpr int64_t per_line = 64 / sizeof(T);
  for (int64_t i = 0; i < n; i += per_line) __builtin_prefetch(p + i);
}

// a token's query heads in fp32: q itself when it is fp32, else widened into buf
template <typename E>
inline const float* query_f32(const typename E::T* q, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<E, F32>) {
    return q;
  } else {
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = E::widen(q[i]);
    return buf.data();
  }
}

// out[i] = acc[i] * r, stored as E
template <typename E>
inline void store_scaled(typename E::T* __restrict out, const float* __restrict acc, float r, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = E::narrow(acc[i] * r);
}

// fn(first position, positions in the block, the block's base) for a token's first len positions.
// Each block sits where the block table puts it, so the hardware prefetchers, which follow one
// address stream at a time, start cold at every block: the next block's lines are asked for while
// this one is computed on.
template <typename T, typename F>
inline void for_each_block(const T* pool, const int32_t* table, int64_t len, int64_t block_size,
                           int64_t block_stride, int64_t row_stride, F&& fn) {
  for (int64_t p0 = 0, b = 0; p0 < len; p0 += block_size, ++b) {
    if (p0 + block_size < len)
      prefetch(pool + static_cast<int64_t>(table[b + 1]) * block_stride,
               std::min(block_size, len - p0 - block_size) * row_stride);
    fn(p0, std::min(block_size, len - p0), pool + static_cast<int64_t>(table[b]) * block_stride);
  }
}

}  // namespace

// Every query token, split over torch's threads. A token's keys are read block by block in memory
// order (the pool's layout, [N, block_size, KVH, D]: one key position's heads are contiguous).
// Scores take four key positions at a time, each its own accumulator (one chain of dependent
// FMAs per dot waited on the FMA's latency: 1.4x slower at Qwen3-0.6B's heads); each value
// row is read once, for all of its query heads. HEAD_DIM > 0 fixes the head size at compile
// time (the loops then unroll and vectorize whole); 0 takes it at run time.
template <int64_t HEAD_DIM, typename E>
void attend_all(typename E::T* op, const typename E::T* qp, const typename E::T* kp, const typename E::T* vp,
                const int32_t* tables, const int32_t* rows, const int32_t* lens, int64_t n, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim_rt, int64_t block_size, int64_t max_blocks, int64_t out_stride,
                float scale) {
  using T = typename E::T;
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // one key position's heads
  const int64_t block_stride = block_size * row_stride;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H, len]
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> inv(num_heads);
    std::vector<float> qbuf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t len = lens[t];
      const int32_t* table = tables + static_cast<int64_t>(rows[t]) * max_blocks;
      const float* qt = query_f32<E>(qp + t * num_heads * head_dim, num_heads * head_dim, qbuf);
      scores.resize(num_heads * len);
      float* sc = scores.data();
      // pass 1: scaled scores of every visible key, every query head
      for_each_block(kp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const T* base) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* kb = base + h * head_dim;
          for (int64_t j = 0; j < group; ++j) {
            const int64_t qh = h * group + j;
            const float* __restrict q = qt + qh * head_dim;
            float* srow = sc + qh * len + p0;
            int64_t o = 0;
            for (; o + 4 <= m; o += 4) {
              const T* __restrict k0 = kb + o * row_stride;
              const T* __restrict k1 = k0 + row_stride;
              const T* __restrict k2 = k1 + row_stride;
              const T* __restrict k3 = k2 + row_stride;
              float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
              for (int64_t i = 0; i < head_dim; ++i) {
                s0 += q[i] * E::widen(k0[i]);
                s1 += q[i] * E::widen(k1[i]);
                s2 += q[i] * E::widen(k2[i]);
                s3 += q[i] * E::widen(k3[i]);
              }
              srow[o] = s0 * scale;
              srow[o + 1] = s1 * scale;
              srow[o + 2] = s2 * scale;
              srow[o + 3] = s3 * scale;
            }
            for (; o < m; ++o) srow[o] = dot<E>(q, kb + o * row_stride, head_dim) * scale;
          }
        }
      });
      // softmax numerators in place, and 1 / their sum
      for (int64_t qh = 0; qh < num_heads; ++qh) {
        float* s = sc + qh * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < len; ++p) mx = std::max(mx, s[p]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; ++p) {
          s[p] = raylm::fast_exp(s[p] - mx);
          sum += s[p];
        }
        inv[qh] = 1.f / sum;
      }
      // pass 2: the weighted sum of values, each value row read once for its query heads
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block(vp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const T* base) {
        for (int64_t o = 0; o < m; ++o) {
          const T* vrow = base + o * row_stride;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            for (int64_t j = 0; j < group; ++j) {
              const int64_t qh = h * group + j;
              axpy<E>(acc.data() + qh * head_dim, vrow + h * head_dim, sc[qh * len + p0 + o], head_dim);
            }
          }
        }
      });
      T* ot = op + t * out_stride;
      for (int64_t qh = 0; qh < num_heads; ++qh)
        store_scaled<E>(ot + qh * head_dim, acc.data() + qh * head_dim, inv[qh], head_dim);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace {

// One vector of W fp32 lanes: eight (AVX2) or sixteen (AVX-512). load<E> widens W elements of a
// pool / q of element type E; fold8 sums a vector down to eight lanes.
struct V8 {
  using R = __m256;
  static constexpr int W = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold8(R x) { return x; }
  template <typename E>
  static R load(const typename E::T* p) {
    if constexpr (std::is_same_v<E, F32>) {
      return _mm256_loadu_ps(p);
    } else if constexpr (std::is_same_v<E, BF16>) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    } else {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
  }
};

#if defined(__AVX512F__)
// sixteen lanes, for head_dim % 16 == 0 where the build has AVX-512: half the instructions per
// key, and (for a bf16 / fp16 pool) half the widening work per byte
struct V16 {
  using R = __m512;
  static constexpr int W = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold8(R x) { return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1)); }
  template <typename E>
  static R load(const typename E::T* p) {
    if constexpr (std::is_same_v<E, F32>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<E, BF16>) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    } else {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
  }
};
#endif

// lane p of the result: the sum of a[p]'s eight lanes
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 low halves | high halves]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k for eight key positions (k, k + stride, ...): eight independent FMA chains, one reduction
template <typename V, int64_t HEAD_DIM, typename E>
inline __m256 scores8(const float* q, const typename E::T* k, int64_t stride, int64_t head_dim_rt) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  typename V::R a[8];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) a[p] = V::zero();
  for (int64_t c = 0; c < head_dim; c += V::W) {
    const typename V::R qv = V::loadf(q + c);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) a[p] = V::fmadd(qv, V::template load<E>(k + p * stride + c), a[p]);
  }
  __m256 h[8];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) h[p] = V::fold8(a[p]);
  return sum8(h);
}

#if defined(__AVX512BF16__)
#define RAYLM_ATTENTION_DPBF16 1
// q . k for eight key positions and GS query heads that share them, a bf16 q and pool multiplied in
// pairs by vdpbf16ps (a product of two bf16 is exact in fp32; the sums are fp32 as elsewhere): each
// key vector is loaded once for the GS heads and never widened. head_dim % 32 == 0.
template <int GS, int64_t HEAD_DIM>
inline void scores8_dpbf16(const uint16_t* const* q, const uint16_t* k, int64_t stride, int64_t head_dim_rt,
                           __m256* out) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  __m512 a[GS][8];
#pragma GCC unroll 2
  for (int g = 0; g < GS; ++g)
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) a[g][p] = _mm512_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += 32) {
    __m512bh qv[GS];
#pragma GCC unroll 2
    for (int g = 0; g < GS; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(q[g] + c);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + p * stride + c);
#pragma GCC unroll 2
      for (int g = 0; g < GS; ++g) a[g][p] = _mm512_dpbf16_ps(a[g][p], qv[g], kv);
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < GS; ++g) {
    __m256 h[8];
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) h[p] = V16::fold8(a[g][p]);
    out[g] = sum8(h);
  }
}

// scaled scores of a block's m positions for the group of query heads from qh0 that share one KV
// head's keys kb (bf16 q and pool), two heads at a time; sc[qh * len + o] for position o
template <int64_t HEAD_DIM>
inline void scores_dpbf16(const uint16_t* qbf, const float* qt, const uint16_t* kb, int64_t qh0, int64_t group,
                          int64_t head_dim, int64_t m, int64_t row_stride, float* sc, int64_t len, float scale) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < group; j += 2) {
    const int gs = j + 2 <= group ? 2 : 1;
    const int64_t qh = qh0 + j;
    const uint16_t* q2[2] = {qbf + qh * head_dim, qbf + (qh + gs - 1) * head_dim};
    int64_t o = 0;
    for (; o + 8 <= m; o += 8) {
      __m256 s8[2];
      if (gs == 2) {
        scores8_dpbf16<2, HEAD_DIM>(q2, kb + o * row_stride, row_stride, head_dim, s8);
      } else {
        scores8_dpbf16<1, HEAD_DIM>(q2, kb + o * row_stride, row_stride, head_dim, s8);
      }
      for (int g = 0; g < gs; ++g) _mm256_storeu_ps(sc + (qh + g) * len + o, _mm256_mul_ps(s8[g], vscale));
    }
    for (; o < m; ++o)
      for (int g = 0; g < gs; ++g)
        sc[(qh + g) * len + o] = dot<BF16>(qt + (qh + g) * head_dim, kb + o * row_stride, head_dim) * scale;
  }
}
#endif

// acc[g][0 .. W NV) += sum over the block's m positions of w[g][o] * v[o][0 .. W NV), for GS query
// heads, the accumulators held in registers across the block
template <typename V, int GS, int NV, typename E>
inline void weigh_values(float* acc, int64_t acc_stride, const typename E::T* v, int64_t stride, int64_t m,
                         const float* w, int64_t w_stride) {
  typename V::R r[GS][NV];
#pragma GCC unroll 2
  for (int g = 0; g < GS; ++g)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) r[g][n] = V::loadf(acc + g * acc_stride + V::W * n);
  for (int64_t o = 0; o < m; ++o) {
    typename V::R x[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) x[n] = V::template load<E>(v + o * stride + V::W * n);
#pragma GCC unroll 2
    for (int g = 0; g < GS; ++g) {
      const typename V::R s = V::set1(w[g * w_stride + o]);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) r[g][n] = V::fmadd(s, x[n], r[g][n]);
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < GS; ++g)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) V::storef(acc + g * acc_stride + V::W * n, r[g][n]);
}

template <typename V, int GS, typename E>
inline void weigh_values_chunks(float* acc, int64_t head_dim, const typename E::T* v, int64_t stride, int64_t m,
                                const float* w, int64_t w_stride) {
  constexpr int64_t W = V::W;
  int64_t c = 0;
  for (; c + 4 * W <= head_dim; c += 4 * W) weigh_values<V, GS, 4, E>(acc + c, head_dim, v + c, stride, m, w, w_stride);
  if (c + 2 * W <= head_dim) {
    weigh_values<V, GS, 2, E>(acc + c, head_dim, v + c, stride, m, w, w_stride);
    c += 2 * W;
  }
  if (c < head_dim) weigh_values<V, GS, 1, E>(acc + c, head_dim, v + c, stride, m, w, w_stride);
}

// the widest vectors this build and head size allow
template <int64_t HEAD_DIM, typename E>
inline __m256 scores8_isa(const float* q, const typename E::T* k, int64_t stride, int64_t head_dim) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) return scores8<V16, HEAD_DIM, E>(q, k, stride, head_dim);
#endif
  return scores8<V8, HEAD_DIM, E>(q, k, stride, head_dim);
}

template <int GS, typename E>
inline void weigh_values_chunks_isa(float* acc, int64_t head_dim, const typename E::T* v, int64_t stride, int64_t m,
                                    const float* w, int64_t w_stride) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) return weigh_values_chunks<V16, GS, E>(acc, head_dim, v, stride, m, w, w_stride);
#endif
  weigh_values_chunks<V8, GS, E>(acc, head_dim, v, stride, m, w, w_stride);
}

// attend_all for head_dim % 8 == 0 on AVX2 + FMA (AVX-512 machines run it too): the same two passes
// and prefetches, written so that eight key positions' scores come out of one reduction (not a
// horizontal sum each: at head_dim 32 those sums were most of the score pass) and the value pass
// keeps a pair of query heads' accumulators in registers across a block instead of loading and
// storing them at every position. 1.1-1.2x at the tiny model's heads, 1.3-1.5x at Qwen3's
// (benchmarks/bench_attention.py; the pool read from DRAM bounds both).
template <int64_t HEAD_DIM, typename E>
void attend_all_avx2(typename E::T* op, const typename E::T* qp, const typename E::T* kp, const typename E::T* vp,
                     const int32_t* tables, const int32_t* rows, const int32_t* lens, int64_t n, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim_rt, int64_t block_size, int64_t max_blocks,
                     int64_t out_stride, float scale) {
  using T = typename E::T;
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * row_stride;
  const __m256 vscale = _mm256_set1_ps(scale);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> inv(num_heads);
    std::vector<float> qbuf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t len = lens[t];
      const int32_t* table = tables + static_cast<int64_t>(rows[t]) * max_blocks;
      const float* qt = query_f32<E>(qp + t * num_heads * head_dim, num_heads * head_dim, qbuf);
      scores.resize(num_heads * len);
      float* sc = scores.data();
      for_each_block(kp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const T* base) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* kb = base + h * head_dim;
#ifdef RAYLM_ATTENTION_DPBF16
          if constexpr (std::is_same_v<E, BF16>) {
            if (head_dim % 32 == 0) {
              scores_dpbf16<HEAD_DIM>(qp + t * num_heads * head_dim, qt, kb, h * group, group, head_dim, m,
                                      row_stride, sc + p0, len, scale);
              continue;
            }
          }
#endif
          for (int64_t j = 0; j < group; ++j) {
            const int64_t qh = h * group + j;
            const float* q = qt + qh * head_dim;
            float* srow = sc + qh * len + p0;
            int64_t o = 0;
            for (; o + 8 <= m; o += 8)
              _mm256_storeu_ps(srow + o, _mm256_mul_ps(scores8_isa<HEAD_DIM, E>(q, kb + o * row_stride, row_stride,
                                                                                 head_dim), vscale));
            for (; o < m; ++o) srow[o] = dot<E>(q, kb + o * row_stride, head_dim) * scale;
          }
        }
      });
      for (int64_t qh = 0; qh < num_heads; ++qh) {
        float* s = sc + qh * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < len; ++p) mx = std::max(mx, s[p]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; ++p) {
          s[p] = raylm::fast_exp(s[p] - mx);
          sum += s[p];
        }
        inv[qh] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block(vp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const T* base) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* vb = base + h * head_dim;
          int64_t j = 0;
          for (; j + 2 <= group; j += 2) {
            const int64_t qh = h * group + j;
            weigh_values_chunks_isa<2, E>(acc.data() + qh * head_dim, head_dim, vb, row_stride, m, sc + qh * len + p0, len);
          }
          if (j < group) {
            const int64_t qh = h * group + j;
            weigh_values_chunks_isa<1, E>(acc.data() + qh * head_dim, head_dim, vb, row_stride, m, sc + qh * len + p0, len);
          }
        }
      });
      T* ot = op + t * out_stride;
      for (int64_t qh = 0; qh < num_heads; ++qh)
        store_scaled<E>(ot + qh * head_dim, acc.data() + qh * head_dim, inv[qh], head_dim);
    }
  });
}

}  // namespace
#define RAYLM_ATTENTION_AVX2 1
#endif


namespace {

template <typename E>
void attend_typed(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const int32_t* tables, const int32_t* rows, const int32_t* lens,
                  int64_t max_blocks, float scale, bool vectorized) {
  using T = typename E::T;
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t out_stride = out.stride(0);
  const T* qp = static_cast<const T*>(q.data_ptr());
  const T* kp = static_cast<const T*>(key_cache.data_ptr());
  const T* vp = static_cast<const T*>(value_cache.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  auto run = [&](auto fixed) {
#ifdef RAYLM_ATTENTION_AVX2
    if (vectorized && head_dim % 8 == 0) {
      attend_all_avx2<decltype(fixed)::value, E>(op, qp, kp, vp, tables, rows, lens, n, num_heads, num_kv_heads,
                                                 head_dim, block_size, max_blocks, out_stride, scale);
      return;
    }
#endif
    attend_all<decltype(fixed)::value, E>(op, qp, kp, vp, tables, rows, lens, n, num_heads, num_kv_heads, head_dim,
                                          block_size, max_blocks, out_stride, scale);
  };
  if (head_dim == 128) {
    run(std::integral_constant<int64_t, 128>());
  } else if (head_dim == 64) {
    run(std::integral_constant<int64_t, 64>());
  } else if (head_dim == 32) {
    run(std::integral_constant<int64_t, 32>());
  } else {
    run(std::integral_constant<int64_t, 0>());
  }
}

void attend(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache, at::Tensor block_tables,
            at::Tensor token_rows, at::Tensor token_lens, double scale, bool vectorized) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_attention takes float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_attention: q, the caches and out must share one dtype");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the caches must be contiguous [N, block_size, KVH, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(token_rows.scalar_type() == at::kInt && token_lens.scalar_type() == at::kInt,
              "token_rows / token_lens: int32");
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == num_heads * head_dim && out.stride(1) == 1,
              "out must be [T, H * D] with unit stride along its rows");
  const at::Tensor rows_c = token_rows.contiguous(), lens_c = token_lens.contiguous();
  TORCH_CHECK(rows_c.numel() == n && lens_c.numel() == n, "one token_rows / token_lens entry per query token");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* rows = rows_c.data_ptr<int32_t>();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  const float fscale = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    attend_typed<F32>(out, q, key_cache, value_cache, tables, rows, lens, max_blocks, fscale, vectorized);
  } else if (dtype == at::kBFloat16) {
    attend_typed<BF16>(out, q, key_cache, value_cache, tables, rows, lens, max_blocks, fscale, vectorized);
  } else {
    attend_typed<F16>(out, q, key_cache, value_cache, tables, rows, lens, max_blocks, fscale, vectorized);
  }
}

}  // namespace

// the vectorized path where this build has it (AVX2 + FMA + F16C, head_dim % 8 == 0), else the plain loops
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                     at::Tensor block_tables, at::Tensor token_rows, at::Tensor token_lens, double scale) {
  attend(out, q, key_cache, value_cache, block_tables, token_rows, token_lens, scale, true);
}

// the plain loops always (what a CPU without AVX2 runs): tests hold both paths to the reference
void paged_attention_portable(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                              at::Tensor block_tables, at::Tensor token_rows, at::Tensor token_lens, double scale) {
  attend(out, q, key_cache, value_cache, block_tables, token_rows, token_lens, scale, false);
}

bool paged_attention_vectorized() {
#ifdef RAYLM_ATTENTION_AVX2
  return true;
#else
  return false;
#endif
}

// The step's K and V into the pool: token t's [KVH, D] rows to slot slot_mapping[t] of key_cache and
// value_cache ([blocks, block_size, KVH, D], any dtype, k and v in it). One copy a token, the tokens split
// among torch's threads: index_copy_ over the pool's [slots, KVH, D] view took several times as long.
void kv_write(at::Tensor key_cache, at::Tensor value_cache, at::Tensor k, at::Tensor v, at::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.is_contiguous() && value_cache.scalar_type() == key_cache.scalar_type(),
              "key_cache and value_cache must be contiguous [blocks, block_size, kv_heads, head_dim] of one dtype");
  const int64_t slots = key_cache.size(0) * key_cache.size(1), kvh = key_cache.size(2), d = key_cache.size(3);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == kvh && t->size(2) == d && t->stride(2) == 1 && t->stride(1) == d &&
                    t->scalar_type() == key_cache.scalar_type(),
                "k and v must be [tokens, kv_heads, head_dim] in the pool's dtype, each token's heads contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == k.size(0) &&
                  v.size(0) == k.size(0),
              "slot_mapping must be an int64 [tokens] for k's and v's tokens");
  const at::Tensor sm = slot_mapping.contiguous();
  const int64_t* sp = sm.data_ptr<int64_t>();
  const int64_t n = k.size(0);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot ", sp[t], " of token ", t, " is outside the pool's ", slots, " slots");
  const int64_t row = kvh * d * key_cache.element_size();
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, n, std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, 2 * row)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      std::memcpy(kc + sp[t] * row, kp + t * ks, row);
      std::memcpy(vc + sp[t] * row, vp + t * vs, row);
    }
  });
}

// torch.ops.raylm.paged_attention (registered when the library is loaded)
TORCH_LIBRARY(raylm, m) {
  const char* args = "(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
                     "Tensor token_rows, Tensor token_lens, float scale) -> ()";
  m.def((std::string("paged_attention") + args).c_str());
  m.def((std::string("paged_attention_portable") + args).c_str());
  m.def("paged_attention_vectorized() -> bool", &paged_attention_vectorized);
  m.def("kv_write(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_portable", &paged_attention_portable);
  m.impl("kv_write", &kv_write);
}
