// Prefill attention on AMX tiles: each prompt chunk's queries against its sequence's keys where they lie
// in the paged pool (a cached prefix and the chunk's own keys, already written), causal, bf16. It is a
// GEMM-shaped problem (every query of a chunk against up to its whole context) that the decode kernel's
// per-token dot products (paged_attention.cpp) run far below the machine's bf16 rate, and that SDPA
// runs without the pool (the chunk's own keys only, or a gathered copy of the prefix).
//
// Per chunk and KV head: the visible keys are packed once into the layouts the tiles multiply (K
// transposed in pairs of dims, V in pairs of key positions), then for each of the group's query heads
// and each tile of 16 queries, two passes: the scores of the tile against every key it may see (one
// fp32 row per query, kept in L2), an exact softmax over each row (fp32, rounded to bf16 once as P),
// then P times V. Scores and sums are fp32, as in torch's flash attention on the same tiles; only P
// and the output are rounded to bf16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RAYLM_PREFILL_AMX 1
#include <immintrin.h>
#include "amx_tiles.h"
#endif

namespace {

#ifdef RAYLM_PREFILL_AMX
constexpr int64_t QT = 16;  // queries a tile takes (its rows)
constexpr int64_t KT = 16;  // keys a score tile takes (its columns)
constexpr int64_t KP = 32;  // keys a P.V step takes (16 pairs: the depth of one tile product)
constexpr int64_t DT = 32;  // head dims a score product takes (16 pairs)
constexpr int64_t VT = 16;  // head dims an output tile takes (its columns)
constexpr int64_t TILE = 512;  // bf16 elements in one 16 x 64-byte operand tile

using raylm::BF16;

// The context's first kend keys of one KV head, packed for the tiles (keys at or past ctx are zeros):
// kt: per 16 keys and 32 dims a tile [16 dim pairs][16 keys][2]: the score product's second operand;
// vv: per 32 keys and 16 dims a tile [16 key pairs][16 dims][2]: P.V's second operand.
void pack_context(uint16_t* kt, uint16_t* vv, const uint16_t* kp, const uint16_t* vp, const int32_t* table,
                  int64_t ctx, int64_t kend, int64_t block_size, int64_t row_stride, int64_t head_off,
                  int64_t head_dim) {
  const int64_t nd = head_dim / DT, nv = head_dim / VT;
  const int64_t block_stride = block_size * row_stride;
  auto key_at = [&](const uint16_t* pool, int64_t p) {
    return pool + static_cast<int64_t>(table[p / block_size]) * block_stride + (p % block_size) * row_stride +
           head_off;
  };
  for (int64_t k0 = 0; k0 < kend; k0 += KT) {
    uint32_t* dst = reinterpret_cast<uint32_t*>(kt + (k0 / KT) * nd * TILE);  // [nd][16 pairs][16 keys]
    for (int64_t j = 0; j < KT; ++j) {
      const int64_t p = k0 + j;
      if (p >= ctx) {
        for (int64_t w = 0; w < head_dim / 2; ++w) dst[(w / 16) * 256 + (w % 16) * 16 + j] = 0;
        continue;
      }
      const uint32_t* src = reinterpret_cast<const uint32_t*>(key_at(kp, p));
      for (int64_t w = 0; w < head_dim / 2; ++w) dst[(w / 16) * 256 + (w % 16) * 16 + j] = src[w];
    }
  }
  for (int64_t k0 = 0; k0 < kend; k0 += KP) {
    uint16_t* dst = vv + (k0 / KP) * nv * TILE;  // [nv][16 pairs][16 dims][2]
    for (int64_t r = 0; r < KP / 2; ++r) {
      const int64_t p = k0 + 2 * r;
      const uint16_t* a = p < ctx ? key_at(vp, p) : nullptr;
      const uint16_t* b = p + 1 < ctx ? key_at(vp, p + 1) : nullptr;
      for (int64_t c = 0; c < nv; ++c) {
        uint16_t* row = dst + c * TILE + r * 32;
#pragma omp simd
        for (int64_t d = 0; d < VT; ++d) {
          row[2 * d] = a ? a[c * VT + d] : 0;
          row[2 * d + 1] = b ? b[c * VT + d] : 0;
        }
      }
    }
  }
}

// 2^t for 16 lanes of t <= 0: 2^n (vscalefps) times a degree-4 fit of 2^f on [-1/2, 1/2] (relative error
// under 3e-6, far below P's bf16 rounding); t is held above -126, where 2^t is zero to bf16's sum anyway
inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 q = _mm512_set1_ps(0.009560520f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.05591712f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.24024981f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.69312197f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.99999917f));
  return _mm512_scalef_ps(q, n);
}

// p[0, lim) = bf16(e^((s - max s) * scale)), p[lim, kend) = 0 -> the sum of the unrounded numerators
inline float softmax_row(const float* s, uint16_t* p, int64_t lim, int64_t kend, float scale) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m[4] = {ninf, ninf, ninf, ninf};
  int64_t k = 0;
  for (; k + 64 <= lim; k += 64)
    for (int u = 0; u < 4; ++u) m[u] = _mm512_max_ps(m[u], _mm512_loadu_ps(s + k + 16 * u));
  for (; k < lim; k += 16) {
    const __mmask16 t = lim - k >= 16 ? 0xffff : static_cast<__mmask16>((1u << (lim - k)) - 1);
    m[0] = _mm512_max_ps(m[0], _mm512_mask_loadu_ps(ninf, t, s + k));
  }
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  const float l2 = scale * 1.44269504088896341f;  // e^(x * scale) = 2^(x * scale * log2 e)
  const __m512 vs = _mm512_set1_ps(l2), vm = _mm512_set1_ps(mx * l2);
  __m512 sum = _mm512_setzero_ps();
  for (k = 0; k < kend; k += 16) {
    const __mmask16 t = k + 16 <= lim ? 0xffff : k < lim ? static_cast<__mmask16>((1u << (lim - k)) - 1) : 0;
    const __m512 e = _mm512_maskz_mov_ps(t, exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(t, s + k), vs, vm)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

// A tile of `rows` queries of one query head (q rows at stride q_stride), whose first query sees `first`
// keys and each next one one more; its output rows at stride out_stride; its scratch: s [16][ld] fp32,
// p [16][ld] bf16, qbuf [16][head_dim], o [16][head_dim] fp32, ld >= the keys it sees rounded up to KP.
struct QueryTile {
  uint16_t* out;
  const uint16_t* q;
  int64_t rows, first;
  float* s;
  uint16_t* p;
  uint16_t* qbuf;
  float* o;
};

// Two query tiles over the same packed keys (two query heads of a KV group, or two ranges of one head's
// queries; b.rows == 0: a alone), each key and value operand loaded once for both: four accumulator
// tiles (0-3: a's and b's, two columns each), the queries' operands in 4-5, the keys' or values' in 6-7.
void attend_tiles(const QueryTile& a, const QueryTile& b, int64_t out_stride, int64_t q_stride, const uint16_t* kt,
                  const uint16_t* vv, int64_t head_dim, float scale, int64_t ld) {
  const int64_t nd = head_dim / DT, nv = head_dim / VT;
  const bool two = b.rows > 0;
  // the last query of a tile sees first + rows - 1 keys
  int64_t kend = (a.first + a.rows - 1 + KP - 1) / KP * KP;
  if (two) kend = std::max(kend, (b.first + b.rows - 1 + KP - 1) / KP * KP);
  for (const QueryTile* t : {&a, &b}) {
    if (t == &b && !two) break;
    for (int64_t i = 0; i < QT; ++i) {
      if (i < t->rows) {
        std::memcpy(t->qbuf + i * head_dim, t->q + i * q_stride, head_dim * sizeof(uint16_t));
      } else {
        std::memset(t->qbuf + i * head_dim, 0, head_dim * sizeof(uint16_t));
      }
    }
  }
  // scores, 32 keys a step
  for (int64_t k0 = 0; k0 < kend; k0 += 2 * KT) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* kb = kt + (k0 / KT) * nd * TILE;
    for (int64_t c = 0; c < nd; ++c) {
      _tile_loadd(6, kb + c * TILE, 64);
      _tile_loadd(7, kb + (nd + c) * TILE, 64);
      _tile_loadd(4, a.qbuf + c * DT, head_dim * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, b.qbuf + c * DT, head_dim * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, a.s + k0, ld * 4);
    _tile_stored(1, a.s + k0 + KT, ld * 4);
    if (two) {
      _tile_stored(2, b.s + k0, ld * 4);
      _tile_stored(3, b.s + k0 + KT, ld * 4);
    }
  }
  // softmax of each row over the keys its query sees; P rounded to bf16, zero past them up to kend
  float inv[2][QT];
  for (int u = 0; u < (two ? 2 : 1); ++u) {
    const QueryTile& t = u ? b : a;
    for (int64_t i = 0; i < QT; ++i) {
      const int64_t lim = i < t.rows ? t.first + i : 0;
      const float sum = softmax_row(t.s + i * ld, t.p + i * ld, lim, kend, scale);
      inv[u][i] = lim ? 1.f / sum : 0.f;
    }
  }
  // P.V, two output tiles (32 dims) of each query tile a step
  for (int64_t c0 = 0; c0 < nv; c0 += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < kend; k0 += KP) {
      const uint16_t* vb = vv + (k0 / KP) * nv * TILE + c0 * TILE;
      _tile_loadd(6, vb, 64);
      _tile_loadd(7, vb + TILE, 64);
      _tile_loadd(4, a.p + k0, ld * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, b.p + k0, ld * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, a.o + c0 * VT, head_dim * 4);
    _tile_stored(1, a.o + (c0 + 1) * VT, head_dim * 4);
    if (two) {
      _tile_stored(2, b.o + c0 * VT, head_dim * 4);
      _tile_stored(3, b.o + (c0 + 1) * VT, head_dim * 4);
    }
  }
  for (int u = 0; u < (two ? 2 : 1); ++u) {
    const QueryTile& t = u ? b : a;
    for (int64_t i = 0; i < t.rows; ++i) {
      uint16_t* oi = t.out + i * out_stride;
      const float* src = t.o + i * head_dim;
      const float r = inv[u][i];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) oi[d] = BF16::narrow(src[d] * r);
    }
  }
}
#endif  // RAYLM_PREFILL_AMX

bool tiles_usable() {
#ifdef RAYLM_PREFILL_AMX
  return raylm::amx::permitted();
#else
  return false;
#endif
}

}  // namespace

// whether prefill_attention can run in this process: built with AMX-BF16 and granted the tiles
bool prefill_attention_available() { return tiles_usable(); }

// Chunk c's chunk_lens[c] queries, from token chunk_starts[c] of q [T, H, D], sit after chunk_cached[c]
// cached tokens of the sequence whose block table is block_tables[chunk_rows[c]]; query j sees keys
// 0 .. cached + j. Writes those tokens' rows of out [T, H * D]. bf16, head_dim a multiple of 32 up to 128.
void prefill_attention(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                       at::Tensor block_tables, at::Tensor chunk_rows, at::Tensor chunk_starts, at::Tensor chunk_lens,
                       at::Tensor chunk_cached, double scale) {
  TORCH_CHECK(tiles_usable(), "prefill_attention needs AMX-BF16 (built for it and granted by the kernel)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention takes bfloat16 q, caches and out");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the caches must be contiguous [N, block_size, KVH, D]");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 128, "prefill_attention takes head_dim 32, 64, 96 or 128, got ",
              head_dim);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == num_heads * head_dim &&
                  out.stride(1) == 1, "out must be [T, H * D] with unit stride along its rows");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  for (const auto* t : {&chunk_rows, &chunk_starts, &chunk_lens, &chunk_cached})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->numel() == chunk_rows.numel(),
                "chunk_rows / starts / lens / cached: one int32 each per chunk");
#ifdef RAYLM_PREFILL_AMX
  const int64_t chunks = chunk_rows.numel(), group = num_heads / num_kv_heads;
  const int32_t* rows = chunk_rows.data_ptr<int32_t>();
  const int32_t* starts = chunk_starts.data_ptr<int32_t>();
  const int32_t* lens = chunk_lens.data_ptr<int32_t>();
  const int32_t* cached = chunk_cached.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), row_stride = num_kv_heads * head_dim;
  int64_t most = 0;  // the longest context, rounded up to KP
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t ctx = static_cast<int64_t>(cached[c]) + lens[c];
    TORCH_CHECK(lens[c] > 0 && cached[c] >= 0 && starts[c] >= 0 && starts[c] + lens[c] <= q.size(0) &&
                    rows[c] >= 0 && rows[c] < block_tables.size(0) && (ctx + block_size - 1) / block_size <= max_blocks,
                "prefill_attention: chunk ", c, " lies outside q or its block table");
    most = std::max(most, (ctx + KP - 1) / KP * KP);
  }
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = static_cast<const uint16_t*>(key_cache.data_ptr());
  const auto* vp = static_cast<const uint16_t*>(value_cache.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t out_stride = out.stride(0);
  const float fscale = static_cast<float>(scale);
  // items: (KV head, chunk), head-major, so that two threads split the heads evenly for any chunk mix
  at::parallel_for(0, num_kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> kt(most * head_dim), vv(most * head_dim), p(2 * QT * most), qbuf(2 * QT * head_dim);
    std::vector<float> s(2 * QT * most), o(2 * QT * head_dim);
    raylm::amx::configure();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / chunks, c = item % chunks;
      const int64_t n = lens[c], pre = cached[c], ctx = pre + n;
      const int64_t kend = (ctx + KP - 1) / KP * KP;
      pack_context(kt.data(), vv.data(), kp, vp, tables + static_cast<int64_t>(rows[c]) * max_blocks, ctx, kend,
                   block_size, row_stride, h * head_dim, head_dim);
      // the group's query tiles, query range by query range, taken two at a time
      const int64_t tiles = (n + QT - 1) / QT * group;
      for (int64_t u = 0; u < tiles; u += 2) {
        QueryTile pair[2] = {};  // rows 0: no second tile (an odd count)
        for (int64_t v = 0; v < 2 && u + v < tiles; ++v) {
          const int64_t i0 = (u + v) / group * QT, qh = h * group + (u + v) % group, t = starts[c] + i0;
          pair[v] = {op + t * out_stride + qh * head_dim, qp + (t * num_heads + qh) * head_dim, std::min(QT, n - i0),
                     pre + i0 + 1, s.data() + v * QT * most, p.data() + v * QT * most, qbuf.data() + v * QT * head_dim,
                     o.data() + v * QT * head_dim};
        }
        attend_tiles(pair[0], pair[1], out_stride, num_heads * head_dim, kt.data(), vv.data(), head_dim, fscale,
                     most);
      }
    }
    _tile_release();
  });
#endif
}

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("prefill_attention_available() -> bool", &prefill_attention_available);
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor chunk_rows, Tensor chunk_starts, Tensor chunk_lens, Tensor chunk_cached, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
