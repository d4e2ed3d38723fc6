// Paged attention for the CPU op table: every query token attends over its sequence's keys
// where they lie in the paged pool (no gather, no padding), fp32.
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
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// the cache lines of `n` floats from p, asked for ahead of their use
inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

// fn(first position, positions in the block, the block's base) for a token's first len positions.
// Each block sits where the block table puts it, so the hardware prefetchers, which follow one
// address stream at a time, start cold at every block: the next block's lines are asked for while
// this one is computed on.
template <typename F>
inline void for_each_block(const float* pool, const int32_t* table, int64_t len, int64_t block_size,
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
template <int64_t HEAD_DIM>
void attend_all(float* op, const float* qp, const float* kp, const float* vp, const int32_t* tables,
                const int32_t* rows, const int32_t* lens, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim_rt, int64_t block_size, int64_t max_blocks, int64_t out_stride, float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // one key position's heads
  const int64_t block_stride = block_size * row_stride;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H, len]
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> inv(num_heads);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t len = lens[t];
      const int32_t* table = tables + static_cast<int64_t>(rows[t]) * max_blocks;
      const float* qt = qp + t * num_heads * head_dim;
      scores.resize(num_heads * len);
      float* sc = scores.data();
      // pass 1: scaled scores of every visible key, every query head
      for_each_block(kp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const float* base) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const float* kb = base + h * head_dim;
          for (int64_t j = 0; j < group; ++j) {
            const int64_t qh = h * group + j;
            const float* __restrict q = qt + qh * head_dim;
            float* srow = sc + qh * len + p0;
            int64_t o = 0;
            for (; o + 4 <= m; o += 4) {
              const float* __restrict k0 = kb + o * row_stride;
              const float* __restrict k1 = k0 + row_stride;
              const float* __restrict k2 = k1 + row_stride;
              const float* __restrict k3 = k2 + row_stride;
              float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
              for (int64_t i = 0; i < head_dim; ++i) {
                s0 += q[i] * k0[i];
                s1 += q[i] * k1[i];
                s2 += q[i] * k2[i];
                s3 += q[i] * k3[i];
              }
              srow[o] = s0 * scale;
              srow[o + 1] = s1 * scale;
              srow[o + 2] = s2 * scale;
              srow[o + 3] = s3 * scale;
            }
            for (; o < m; ++o) srow[o] = dot(q, kb + o * row_stride, head_dim) * scale;
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
      for_each_block(vp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const float* base) {
        for (int64_t o = 0; o < m; ++o) {
          const float* vrow = base + o * row_stride;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            for (int64_t j = 0; j < group; ++j) {
              const int64_t qh = h * group + j;
              axpy(acc.data() + qh * head_dim, vrow + h * head_dim, sc[qh * len + p0 + o], head_dim);
            }
          }
        }
      });
      float* ot = op + t * out_stride;
      for (int64_t qh = 0; qh < num_heads; ++qh) {
        const float* a = acc.data() + qh * head_dim;
        float* dst = ot + qh * head_dim;
        const float r = inv[qh];
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) dst[i] = a[i] * r;
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

// lane p of the result: the sum of a[p]'s eight lanes
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 low halves | high halves]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k for eight key positions (k, k + stride, ...): eight independent FMA chains, one reduction
template <int64_t HEAD_DIM>
inline __m256 scores8(const float* q, const float* k, int64_t stride, int64_t head_dim_rt) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  __m256 a[8];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) a[p] = _mm256_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) a[p] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + p * stride + c), a[p]);
  }
  return sum8(a);
}

// acc[g][0 .. 8 NV) += sum over the block's m positions of w[g][o] * v[o][0 .. 8 NV), for GS query
// heads, the accumulators held in registers across the block
template <int GS, int NV>
inline void weigh_values(float* acc, int64_t acc_stride, const float* v, int64_t stride, int64_t m, const float* w,
                         int64_t w_stride) {
  __m256 r[GS][NV];
#pragma GCC unroll 2
  for (int g = 0; g < GS; ++g)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) r[g][n] = _mm256_loadu_ps(acc + g * acc_stride + 8 * n);
  for (int64_t o = 0; o < m; ++o) {
    __m256 x[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) x[n] = _mm256_loadu_ps(v + o * stride + 8 * n);
#pragma GCC unroll 2
    for (int g = 0; g < GS; ++g) {
      const __m256 s = _mm256_broadcast_ss(w + g * w_stride + o);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) r[g][n] = _mm256_fmadd_ps(s, x[n], r[g][n]);
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < GS; ++g)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) _mm256_storeu_ps(acc + g * acc_stride + 8 * n, r[g][n]);
}

template <int GS>
inline void weigh_values_chunks(float* acc, int64_t head_dim, const float* v, int64_t stride, int64_t m,
                                const float* w, int64_t w_stride) {
  int64_t c = 0;
  for (; c + 32 <= head_dim; c += 32) weigh_values<GS, 4>(acc + c, head_dim, v + c, stride, m, w, w_stride);
  if (c + 16 <= head_dim) {
    weigh_values<GS, 2>(acc + c, head_dim, v + c, stride, m, w, w_stride);
    c += 16;
  }
  if (c < head_dim) weigh_values<GS, 1>(acc + c, head_dim, v + c, stride, m, w, w_stride);
}


// attend_all for head_dim % 8 == 0 on AVX2 + FMA (AVX-512 machines run it too): the same two passes
// and prefetches, written so that eight key positions' scores come out of one reduction (not a
// horizontal sum each: at head_dim 32 those sums were most of the score pass) and the value pass
// keeps a pair of query heads' accumulators in registers across a block instead of loading and
// storing them at every position. 1.1-1.2x at the tiny model's heads, 1.3-1.5x at Qwen3's
// (benchmarks/bench_attention.py; the pool read from DRAM bounds both).
template <int64_t HEAD_DIM>
void attend_all_avx2(float* op, const float* qp, const float* kp, const float* vp, const int32_t* tables,
                     const int32_t* rows, const int32_t* lens, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim_rt, int64_t block_size, int64_t max_blocks, int64_t out_stride, float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * row_stride;
  const __m256 vscale = _mm256_set1_ps(scale);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> inv(num_heads);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t len = lens[t];
      const int32_t* table = tables + static_cast<int64_t>(rows[t]) * max_blocks;
      const float* qt = qp + t * num_heads * head_dim;
      scores.resize(num_heads * len);
      float* sc = scores.data();
      for_each_block(kp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const float* base) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const float* kb = base + h * head_dim;
          for (int64_t j = 0; j < group; ++j) {
            const int64_t qh = h * group + j;
            const float* q = qt + qh * head_dim;
            float* srow = sc + qh * len + p0;
            int64_t o = 0;
            for (; o + 8 <= m; o += 8)
              _mm256_storeu_ps(srow + o, _mm256_mul_ps(scores8<HEAD_DIM>(q, kb + o * row_stride, row_stride, head_dim), vscale));
            for (; o < m; ++o) srow[o] = dot(q, kb + o * row_stride, head_dim) * scale;
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
      for_each_block(vp, table, len, block_size, block_stride, row_stride, [&](int64_t p0, int64_t m, const float* base) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const float* vb = base + h * head_dim;
          int64_t j = 0;
          for (; j + 2 <= group; j += 2) {
            const int64_t qh = h * group + j;
            weigh_values_chunks<2>(acc.data() + qh * head_dim, head_dim, vb, row_stride, m, sc + qh * len + p0, len);
          }
          if (j < group) {
            const int64_t qh = h * group + j;
            weigh_values_chunks<1>(acc.data() + qh * head_dim, head_dim, vb, row_stride, m, sc + qh * len + p0, len);
          }
        }
      });
      float* ot = op + t * out_stride;
      for (int64_t qh = 0; qh < num_heads; ++qh) {
        const float* a = acc.data() + qh * head_dim;
        float* dst = ot + qh * head_dim;
        const float r = inv[qh];
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) dst[i] = a[i] * r;
      }
    }
  });
}

}  // namespace
#define RAYLM_ATTENTION_AVX2 1
#endif


namespace {

void attend(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache, at::Tensor block_tables,
            at::Tensor token_rows, at::Tensor token_lens, double scale, bool vectorized) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_attention computes in float32");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the caches must be contiguous [N, block_size, KVH, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(token_rows.scalar_type() == at::kInt && token_lens.scalar_type() == at::kInt,
              "token_rows / token_lens: int32");
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == num_heads * head_dim && out.stride(1) == 1,
              "out must be [T, H * D] with unit stride along its rows");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t out_stride = out.stride(0);
  const float* qp = q.data_ptr<float>();
  const float* kp = key_cache.data_ptr<float>();
  const float* vp = value_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const at::Tensor rows_c = token_rows.contiguous(), lens_c = token_lens.contiguous();
  TORCH_CHECK(rows_c.numel() == n && lens_c.numel() == n, "one token_rows / token_lens entry per query token");
  const int32_t* rows = rows_c.data_ptr<int32_t>();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  auto run = [&](auto fixed) {
#ifdef RAYLM_ATTENTION_AVX2
    if (vectorized && head_dim % 8 == 0) {
      attend_all_avx2<decltype(fixed)::value>(op, qp, kp, vp, tables, rows, lens, n, num_heads, num_kv_heads, head_dim,
                                              block_size, max_blocks, out_stride, fscale);
      return;
    }
#endif
    attend_all<decltype(fixed)::value>(op, qp, kp, vp, tables, rows, lens, n, num_heads, num_kv_heads, head_dim,
                                       block_size, max_blocks, out_stride, fscale);
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

}  // namespace

// the vectorized path where this build has it (AVX2 + FMA, head_dim % 8 == 0), else the plain loops
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

// torch.ops.raylm.paged_attention (registered when the library is loaded)
TORCH_LIBRARY(raylm, m) {
  const char* args = "(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
                     "Tensor token_rows, Tensor token_lens, float scale) -> ()";
  m.def((std::string("paged_attention") + args).c_str());
  m.def((std::string("paged_attention_portable") + args).c_str());
  m.def("paged_attention_vectorized() -> bool", &paged_attention_vectorized);
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_portable", &paged_attention_portable);
}
