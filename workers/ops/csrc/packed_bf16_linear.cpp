// A bf16 linear over raylm's own packing of the weight: y [m, rows] = x [m, K] @ w [rows, K]^T, x and w
// bf16, fp32 sums rounded to bf16 once (as oneDNN's bf16 inner product rounds its output). Two engines
// compute it: AMX tiles (TDPBF16PS) where the CPU has AMX-BF16, else AVX512-BF16's vdpbf16ps (a CPU such as
// AMD's Zen 4 / Zen 5, whose bf16 GEMMs otherwise run on oneDNN's opaque copy of the weight).
//
// The weight is packed once (packed_bf16_pack) into the layout both read for their second operand:
// [blocks of 16 rows, K / 2 pairs, 16 rows x 2 values], so a 16-row x 32-column tile of w is 1 KiB in one
// piece (and one pair of K for 16 rows is one 512-bit vector for vdpbf16ps), and the blocks follow each
// other in memory as a thread streams them. Since the layout is raylm's own, rows can be read back from
// it (packed_bf16_rows): a tied embedding's lookups are served by the lm_head's packed copy, held once, where
// oneDNN's packed copy is opaque and the embedding had to be kept beside it.
//
// Work: threads take pairs of 16-row blocks of w; for each, every 32 rows of x (16 where one block is
// left) run the K loop (AMX: 2 x 2 accumulator tiles; vdpbf16ps: 8 rows x 2 blocks of 16 outputs in
// registers, each x pair broadcast), and the sums go through a small fp32 buffer to y, rounded, or
// (packed_bf16_linear_argmax) straight into each row's best: the [m, rows] logits are never written when only
// greedy ids leave the step. Bound by reading w at decode sizes, the weight pairs are prefetched one
// pair ahead (on AMX spread over all of a pair's row blocks: amx_tiles.h's tile_rows).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "huge_pages.h"
#include "vec_math.h"
#include "row_best.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RAYLM_PACKED_BF16 1
#include <immintrin.h>
#endif
#if defined(RAYLM_PACKED_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAYLM_AMX 1
#endif
#include "amx_tiles.h"

namespace {

using raylm::amx::XTiles;
constexpr int64_t TN = 16;  // rows of w a block takes (a tile's columns of output)
constexpr int64_t TK = 32;  // columns of x and w a tile takes (16 pairs)
#ifndef AMX_XBLOCK_BYTES_
#define AMX_XBLOCK_BYTES_ (512 * 1024)
#endif
constexpr int64_t XBLOCK_BYTES = AMX_XBLOCK_BYTES_;  // x a block of rows may take (a quarter of a 2 MiB L2)
constexpr int64_t TILED_X_RATIO = 256;  // weight bytes per byte of x for which x is copied into tiles (PaddedX)

#ifdef RAYLM_AMX

using raylm::amx::configure;
inline bool amx_permitted() { return raylm::amx::permitted(); }

#endif  // RAYLM_AMX

#ifdef RAYLM_PACKED_BF16

// Sums of R rows of x (from x0, row stride ldx elements) against the weight blocks b0 and b1 over `pairs`
// pairs of K, into out [R, 32] (fp32): each x pair broadcast to 16 lanes meets one pair of the block's 16
// rows in vdpbf16ps, 2R accumulators in registers. `pf` lines of the next pair are prefetched per pair
// of K (next: nullptr for none).
template <int R>
inline void dp_rows(const uint16_t* x0, int64_t ldx, const uint16_t* b0, const uint16_t* b1, int64_t pairs,
                    float* out, const char* next, int64_t next_bytes, int64_t pf) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    if (next)
      for (int64_t b = k * pf * 64; b < std::min(next_bytes, (k + 1) * pf * 64); b += 64)
        _mm_prefetch(next + b, _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + k * 2 * TN);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + k * 2 * TN);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x0 + r * ldx + 2 * k, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * 2 * TN, a0[r]);
    _mm512_storeu_ps(out + r * 2 * TN + TN, a1[r]);
  }
}

// tile_pair's sums by vdpbf16ps, for the first `rows` rows of the row block only (the rest of out is left
// as it was: no one reads a padding row's sums)
inline void dp_pair(const uint16_t* x0, int64_t ldx, int64_t rows, const uint16_t* b0, const uint16_t* b1,
                    int64_t K, float* out, const char* next, int64_t next_bytes) {
  const int64_t pairs = K / 2, pf = (next_bytes / 64 + pairs - 1) / pairs;
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8, next = nullptr)  // the next pair is prefetched during the first rows only
    dp_rows<8>(x0 + r * ldx, ldx, b0, b1, pairs, out + r * 2 * TN, next, next_bytes, pf);
  for (; r + 4 <= rows; r += 4, next = nullptr)
    dp_rows<4>(x0 + r * ldx, ldx, b0, b1, pairs, out + r * 2 * TN, next, next_bytes, pf);
  for (; r < rows; ++r, next = nullptr)
    dp_rows<1>(x0 + r * ldx, ldx, b0, b1, pairs, out + r * 2 * TN, next, next_bytes, pf);
}

using Best = raylm::RowBest;

// 16 sums rounded to bf16 (nearest even, as torch's conversion), and widened back to fp32 exactly
inline __m256i round16(const float* s) { return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s)); }
inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// A row's 32 (cols of them valid) rounded sums offered to its best: one vector max unless one of them
// could win, a scalar pass where it can or any is NaN.
inline void offer_row(Best& best, int64_t i, const float* s, int64_t cols, int64_t j0) {
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 lo = widen16(round16(s)), hi = widen16(round16(s + 16));
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
  const bool nan = (_mm512_mask_cmp_ps_mask(m0, lo, lo, _CMP_UNORD_Q) | _mm512_mask_cmp_ps_mask(m1, hi, hi, _CMP_UNORD_Q)) != 0;
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, m0, lo), _mm512_mask_mov_ps(ninf, m1, hi)));
  if (!nan && best.index[i] >= 0 && !(top > best.value[i])) return;
  alignas(64) float v[32];
  _mm512_store_ps(v, lo);
  _mm512_store_ps(v + 16, hi);
  for (int64_t j = 0; j < cols; ++j) best.offer(i, v[j], j0 + j);
}

// x's rows padded with zeros to a multiple of 16 (the tiles' rows), or x itself where they are. For AMX
// with more than one row block and a weight that dwarfs x (the lm_head's, streamed from memory), x is
// instead copied into the tiles' own layout (each 16 x 32 tile one 1 KiB piece): a tile of x in place
// takes 16 rows 2 * K bytes apart, which at the usual widths (multiples of 1,024) fall into one or two of
// L1's 64 sets, the next row block's tile into the same ones. Against a layer's weight, warm in cache,
// the copy costs more than it saves.
struct PaddedX {
  at::Tensor held;
  const uint16_t* data = nullptr;  // x padded, rows ld apart (not formed where the tiles' copy serves)
  int64_t ld = 0, m, mp;
  XTiles tiles;

  PaddedX(const at::Tensor& x, bool amx, int64_t weight_bytes) : m(x.size(0)), mp((x.size(0) + 15) / 16 * 16) {
    const int64_t K = x.size(1), steps = K / TK;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const int64_t src_ld = x.stride(0), rows = m;
    if (amx && mp >= 32 && mp * K * 2 * TILED_X_RATIO <= weight_bytes) {
      held = at::empty({mp / 16, steps, 16, TK}, x.options());
      uint16_t* t = reinterpret_cast<uint16_t*>(held.data_ptr<at::BFloat16>());
      at::parallel_for(0, mp / 16, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          for (int64_t s = 0; s < steps; ++s)
            for (int64_t i = 0; i < 16; ++i) {
              uint16_t* d = t + ((r * steps + s) * 16 + i) * TK;
              if (r * 16 + i < rows)
                std::memcpy(d, src + (r * 16 + i) * src_ld + s * TK, TK * 2);
              else
                std::memset(d, 0, TK * 2);
            }
      });
      tiles = {reinterpret_cast<const char*>(t), steps * 16 * TK * 2, 16 * TK * 2, TK * 2};
      return;
    }
    if (mp == m) {
      data = src;
      ld = src_ld;
    } else {
      held = at::zeros({mp, K}, x.options());
      held.narrow(0, 0, m).copy_(x);
      data = reinterpret_cast<const uint16_t*>(held.data_ptr<at::BFloat16>());
      ld = K;
    }
    tiles = {reinterpret_cast<const char*>(data), 16 * ld * 2, TK * 2, ld * 2};
  }
};

// For each pair of weight blocks holding any of the first n rows and each row block of x:
// f(state, pair, i0, mt, sums [16 * mt, 32]), the pairs split among torch's threads, each chunk with a
// state of its own (init()), handed to done(first pair, state) at its end. tiles: AMX computes the sums
// (each chunk's tiles configured), else vdpbf16ps.
template <typename Init, typename F, typename Done>
void for_each_tile(const PaddedX& x, const at::Tensor& packed, int64_t n, bool tiles, Init&& init, F&& f,
                   Done&& done) {
  const int64_t K = packed.size(1) * 2, block_elems = K * TN, pair_bytes = 2 * block_elems * 2;
  const int64_t pairs = std::min<int64_t>(packed.size(0) / 2, (n + 2 * TN - 1) / (2 * TN));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, pairs / at::get_num_threads()));
  // rows of x a block takes: they stay in L2 while a thread's weight pairs stream past them
  const int64_t mc = std::max<int64_t>(32, XBLOCK_BYTES / (K * 2) / 32 * 32);
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    auto state = init();
#ifdef RAYLM_AMX
    if (tiles) configure();
#endif
    alignas(64) float sums[32 * 2 * TN];
    for (int64_t m0 = 0; m0 < x.mp; m0 += mc) {
      const int64_t m1 = std::min(x.mp, m0 + mc);
      for (int64_t p = begin; p < end; ++p) {
        const uint16_t* b0 = wp + 2 * p * block_elems;
        const char* next = p + 1 < end ? reinterpret_cast<const char*>(b0 + 2 * block_elems) : nullptr;
        const int64_t row_blocks = (m1 - m0 + 31) / 32;
        for (int64_t i0 = m0; i0 < m1; i0 += 32) {
          // vdpbf16ps: the next pair is prefetched while the first row block runs (later ones find it in
          // L2); AMX: spread over every row block (tile_rows)
          const char* pf = i0 == m0 ? next : nullptr;
          const bool two = i0 + 32 <= m1;
#ifdef RAYLM_AMX
          if (tiles) {
            const int mt = raylm::amx::tile_rows<raylm::amx::DpBF16>(
                x.tiles, i0, two, reinterpret_cast<const char*>(b0), block_elems * 2, K / TK, sums, next, pair_bytes,
                (i0 - m0) / 32, row_blocks);
            f(state, p, i0, mt, sums);
            continue;
          }
#endif
          const int64_t rows = std::min<int64_t>(x.m - i0, two ? 32 : 16);
          if (rows > 0) dp_pair(x.data + i0 * x.ld, x.ld, rows, b0, b0 + block_elems, K, sums, pf, pair_bytes);
          f(state, p, i0, two ? 2 : 1, sums);
        }
      }
    }
#ifdef RAYLM_AMX
    if (tiles) _tile_release();
#endif
    done(begin, state);
  });
}

// whether this process computes on AMX tiles: the engine both ops take unless told "dpbf16"
bool use_tiles(c10::string_view engine) {
  TORCH_CHECK(engine == "auto" || engine == "amx" || engine == "dpbf16",
              "engine must be 'auto', 'amx' or 'dpbf16', got '", std::string(engine), "'");
#ifdef RAYLM_AMX
  if (engine == "dpbf16") return false;
  TORCH_CHECK(amx_permitted() || engine == "auto", "this process may not use AMX tiles (arch_prctl refused)");
  return amx_permitted();
#else
  TORCH_CHECK(engine != "amx", "raylm's kernels were not built with AMX for this CPU");
  return false;
#endif
}

void check_operands(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * TN && packed.size(0) % 2 == 0 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "w must be packed by packed_bf16_pack");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be a 2-d bfloat16 tensor with contiguous rows");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), "w must be packed for x's width");
}

#endif  // RAYLM_PACKED_BF16

// the engine raylm's packed bf16 linear computes on in this process: "amx", "dpbf16" (AVX512-BF16 without
// AMX, or AMX refused), or "" where it was not built (no AVX512-BF16)
std::string packed_bf16_engine() {
#ifdef RAYLM_AMX
  if (amx_permitted()) return "amx";
#endif
#ifdef RAYLM_PACKED_BF16
  return "dpbf16";
#else
  return "";
#endif
}

bool packed_bf16_available() { return !packed_bf16_engine().empty(); }

// w [rows, K] (bf16, K a multiple of 32) -> [blocks, K / 2, 32]: block b holds rows 16b..16b+15 (zeros past
// rows; an even number of blocks), pair k of row 16b + j at [b, k, 2j : 2j + 2]
at::Tensor packed_bf16_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "packed_bf16_pack takes a 2-d bfloat16 weight");
  const int64_t rows = w.size(0), K = w.size(1);
  TORCH_CHECK(K % TK == 0, "packed_bf16_pack needs a width that is a multiple of ", TK, ", got ", K);
  const int64_t blocks = (rows + 2 * TN - 1) / (2 * TN) * 2;
  at::Tensor packed = at::empty({blocks, K / 2, 2 * TN}, w.options());
  raylm::advise_huge_pages(packed.data_ptr(), packed.nbytes());  // before the pages are first written
  const at::Tensor wc = w.contiguous();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(wc.data_ptr<at::BFloat16>());  // a pair as one word
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t pairs = K / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t j = 0; j < TN; ++j) {
        const int64_t r = b * TN + j;
        uint32_t* d = dst + b * pairs * TN + j;
        if (r >= rows) {
          for (int64_t k = 0; k < pairs; ++k) d[k * TN] = 0;
          continue;
        }
        const uint32_t* s = src + r * pairs;
        for (int64_t k = 0; k < pairs; ++k) d[k * TN] = s[k];
      }
  });
  return packed;
}

// y [m, >= n] (bf16 or fp32, contiguous rows): its first n columns = (x @ w^T)[:, :n], rounded to bf16
void packed_bf16_linear(at::Tensor y, at::Tensor x, at::Tensor packed, c10::string_view engine) {
#ifdef RAYLM_PACKED_BF16
  const bool tiles = use_tiles(engine);
  check_operands(x, packed);
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) &&
                  (y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kFloat),
              "y must be a bfloat16 or float32 [x rows, n] tensor with contiguous rows");
  const int64_t n = std::min<int64_t>(y.size(1), packed.size(0) * TN);
  if (x.size(0) == 0 || n == 0) return;
  const PaddedX px(x, tiles, packed.nbytes());
  const int64_t ldy = y.stride(0), m = x.size(0);
  const bool wide = y.scalar_type() == at::kFloat;
  char* yp = static_cast<char*>(y.data_ptr());
  for_each_tile(
      px, packed, n, tiles, [] { return 0; },
      [&](int, int64_t p, int64_t i0, int mt, const float* sums) {
        const int64_t j0 = p * 2 * TN, cols = std::min<int64_t>(2 * TN, n - j0);
        for (int64_t i = i0; i < std::min(m, i0 + 16 * mt); ++i) {
          const float* s = sums + (i - i0) * 2 * TN;
          for (int64_t j = 0; j < cols; j += 16) {
            const __mmask16 k = cols - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (cols - j)) - 1);
            const __m256i h = round16(s + j);
            if (wide)
              _mm512_mask_storeu_ps(reinterpret_cast<float*>(yp) + i * ldy + j0 + j, k, widen16(h));
            else
              _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(yp) + i * ldy + j0 + j, k, h);
          }
        }
      },
      [](int64_t, int) {});
#else
  TORCH_CHECK(false, "raylm's packed bf16 linear was not built for this CPU (no AVX512-BF16)");
#endif
}

// argmax over j < n of the bf16-rounded (x @ w^T)[i, j] for each row i of x (int64 [m])
at::Tensor packed_bf16_linear_argmax(at::Tensor x, at::Tensor packed, int64_t n, c10::string_view engine) {
#ifdef RAYLM_PACKED_BF16
  const bool tiles = use_tiles(engine);
  check_operands(x, packed);
  TORCH_CHECK(n > 0 && n <= packed.size(0) * TN, "n must be in [1, w rows], got ", n);
  const int64_t m = x.size(0);
  at::Tensor ids = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return ids;
  const PaddedX px(x, tiles, packed.nbytes());
  std::mutex mu;
  std::vector<std::pair<int64_t, Best>> parts;  // each chunk's rows' best, by its first pair
  for_each_tile(
      px, packed, n, tiles, [m] { return Best(m); },
      [&](Best& best, int64_t p, int64_t i0, int mt, const float* sums) {
        const int64_t j0 = p * 2 * TN, cols = std::min<int64_t>(2 * TN, n - j0);
        for (int64_t i = i0; i < std::min(m, i0 + 16 * mt); ++i) {
          offer_row(best, i, sums + (i - i0) * 2 * TN, cols, j0);
        }
      },
      [&](int64_t begin, Best& best) {
        const std::lock_guard<std::mutex> lock(mu);
        parts.emplace_back(begin, std::move(best));
      });
  raylm::merge_bests(parts, m, ids.data_ptr<int64_t>());
  return ids;
#else
  TORCH_CHECK(false, "raylm's packed bf16 linear was not built for this CPU (no AVX512-BF16)");
#endif
}

// out [T, K] (bf16 or fp32) = rows ids [T] of the packed w (exact: an embedding lookup)
void packed_bf16_rows(at::Tensor out, at::Tensor packed, at::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * TN && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "w must be packed by packed_bf16_pack");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-d int64 tensor");
  const int64_t pairs = packed.size(1), K = pairs * 2, rows = packed.size(0) * TN, T = ids.size(0);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == T && out.size(1) == K &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "out must be bfloat16 or float32 [ids, w's width] with contiguous rows");
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "id ", ip[t], " is outside w's ", rows, " rows");
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  const bool wide = out.scalar_type() == at::kFloat;
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint32_t* src = wp + (ip[t] / TN) * pairs * TN + ip[t] % TN;
      if (wide) {
        float* o = out.data_ptr<float>() + t * ldo;
        for (int64_t k = 0; k < pairs; ++k) {
          const uint32_t v = src[k * TN];
          o[2 * k] = raylm::BF16::widen(static_cast<uint16_t>(v & 0xffff));
          o[2 * k + 1] = raylm::BF16::widen(static_cast<uint16_t>(v >> 16));
        }
      } else {
        uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>() + t * ldo);
        for (int64_t k = 0; k < pairs; ++k) o[k] = src[k * TN];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("packed_bf16_available() -> bool", &packed_bf16_available);
  m.def("packed_bf16_engine() -> str", &packed_bf16_engine);
  m.def("packed_bf16_pack(Tensor w) -> Tensor");
  m.def("packed_bf16_linear(Tensor(a!) y, Tensor x, Tensor w, str engine='auto') -> ()");
  m.def("packed_bf16_linear_argmax(Tensor x, Tensor w, int n, str engine='auto') -> Tensor");
  m.def("packed_bf16_rows(Tensor(a!) out, Tensor w, Tensor ids) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("packed_bf16_pack", &packed_bf16_pack);
  m.impl("packed_bf16_linear", &packed_bf16_linear);
  m.impl("packed_bf16_linear_argmax", &packed_bf16_linear_argmax);
  m.impl("packed_bf16_rows", &packed_bf16_rows);
}
