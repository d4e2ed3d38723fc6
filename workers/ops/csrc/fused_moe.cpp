// Fused MoE experts for the CPU op table (Qwen3-MoE): after routing, every (token, expert) pair this
// rank holds runs gate/up, silu(gate) * up and down, and the pairs' weighted outputs are summed per
// token, in one call with no per-expert dispatch from Python.
//
// MoE decode on a CPU reads each hit expert's weights once and does little arithmetic per byte, so
// the weights are read where they lie, in their own dtype (fp32, bf16 or fp16), and widened to fp32
// in registers: bf16 experts cost half the bytes of fp32 ones and give fp32 math's result
// (bf16 -> fp32 is exact). Activations of any dtype are computed on in fp32 and the output rounded
// once, at the end.
//
// Pairs are grouped by expert with a counting sort (each expert's tokens in token order). Two
// parallel phases, their work handed out one item at a time to torch's threads:
// 1. gate/up: an item is (expert, tile of intermediate rows): the tile's gate and up rows against
//    the expert's tokens, then silu(gate) * up into the pairs' fp32 activations [pairs, I];
// 2. down: an item is a tile of hidden (output) columns, over every hit expert in ascending order,
//    accumulating weight * down(act) into the tokens' fp32 sums for those columns: the item owns
//    them, so no two threads write one output and each token's sum has one fixed order.
// The dot products are moe_gemv.h's register-blocked micro-kernel.
//
// `fused_moe_mm` is the same op with aten's GEMM per hit expert (oneDNN / MKL, AMX for bf16 where
// the CPU has it) in the activations' dtype, for batches large enough that GEMM kernels pay off.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <string>
#include <vector>

#include "int8_dot.h"
#include "moe_gemv.h"
#include "panel_gemm.h"
#include "vec_math.h"

namespace {

using raylm::moe::gemv_rows;
using raylm::moe::kIsa;
using raylm::moe::RB;

constexpr int64_t kTokenChunk = 64;  // tokens one pass over a weight tile serves (bounds the scratch)
constexpr int64_t kGateTile = 16;    // intermediate rows per gate/up item (x2: its gate and its up rows)

// fn(item) for item in [0, n), handed to torch's threads one at a time (items differ in cost)
template <typename F>
void for_each_item(int64_t n, F&& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

// The (token, expert) pairs this rank holds, grouped by expert, each expert's in token order.
struct Routing {
  std::vector<int64_t> offsets;  // [E + 1]: expert e's pairs are [offsets[e], offsets[e + 1])
  std::vector<int64_t> token;    // [pairs]
  std::vector<float> weight;     // [pairs]
  std::vector<int64_t> hit;      // the experts with pairs, ascending

  Routing(const at::Tensor& ids, const at::Tensor& weights, int64_t first_expert, int64_t num_local) {
    const at::Tensor id = ids.contiguous();
    const at::Tensor wt = weights.to(at::kFloat).contiguous();
    const int64_t* ip = id.data_ptr<int64_t>();
    const float* wp = wt.data_ptr<float>();
    const int64_t pairs = id.numel(), k = id.size(1);
    offsets.assign(num_local + 1, 0);
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t e = ip[i] - first_expert;
      if (e >= 0 && e < num_local) ++offsets[e + 1];
    }
    for (int64_t e = 0; e < num_local; ++e) {
      if (offsets[e + 1]) hit.push_back(e);
      offsets[e + 1] += offsets[e];
    }
    token.resize(offsets[num_local]);
    weight.resize(offsets[num_local]);
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t e = ip[i] - first_expert;
      if (e < 0 || e >= num_local) continue;
      token[cursor[e]] = i / k;
      weight[cursor[e]++] = wp[i];
    }
  }
  int64_t pairs() const { return offsets.back(); }
};

// sums[token(p)][c] += weight(p) * y[p - p0][c] for the m pairs from p0 and c < n (rows of ld floats)
inline void add_weighted(const Routing& rt, int64_t p0, int64_t m, const float* y, float* sums, int64_t ld, int64_t n) {
  for (int64_t q = 0; q < m; ++q) {
    float* sum = sums + rt.token[p0 + q] * ld;
    const float* yq = y + q * ld;
    const float wt = rt.weight[p0 + q];
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) sum[c] += wt * yq[c];
  }
}

void check_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                const at::Tensor& ids, const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "out must be contiguous, shaped and typed like x");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous(),
              "w13 [E, 2I, hidden] and w2 [E, hidden, I] must be contiguous");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "w13 and w2 must share a dtype");
  const int64_t inter = w2.size(2);
  TORCH_CHECK(w13.size(0) == w2.size(0) && w13.size(1) == 2 * inter && w13.size(2) == x.size(1) &&
                  w2.size(1) == x.size(1),
              "w13 must be [E, 2I, hidden] and w2 [E, hidden, I]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == x.size(0) &&
                  weights.sizes() == ids.sizes(),
              "topk_ids must be int64 [T, k] and topk_weights [T, k]");
}

// -- phase 1 and 2 of the register-blocked path, for one weight dtype ---------------------------------
template <typename W>
void moe_blocked(const Routing& rt, const float* xf, const W* w13, const W* w2, int64_t hidden, int64_t inter,
                 float* act, int64_t T, const std::function<void(int64_t, int64_t, const float*, int64_t)>& store) {
  const int64_t tiles = (inter + kGateTile - 1) / kGateTile;
  const int64_t hit = static_cast<int64_t>(rt.hit.size());
  // phase 1: act[p, i] = silu(gate_i . x_p) * (up_i . x_p), item = (hit expert, intermediate tile)
  for_each_item(hit * tiles, [&](int64_t item) {
    thread_local std::vector<float> scratch;
    thread_local std::vector<const float*> rows;
    scratch.resize(2 * kTokenChunk * kGateTile);
    rows.resize(kTokenChunk);
    float* g = scratch.data();
    float* u = g + kTokenChunk * kGateTile;
    const int64_t e = rt.hit[item / tiles], i0 = (item % tiles) * kGateTile;
    const int64_t ni = std::min(kGateTile, inter - i0);
    const W* gate = w13 + (e * 2 * inter + i0) * hidden;
    const W* up = gate + inter * hidden;
    for (int64_t p0 = rt.offsets[e]; p0 < rt.offsets[e + 1]; p0 += kTokenChunk) {
      const int64_t m = std::min(kTokenChunk, rt.offsets[e + 1] - p0);
      for (int64_t n = 0; n < m; ++n) rows[n] = xf + rt.token[p0 + n] * hidden;
      gemv_rows(gate, ni, hidden, rows.data(), m, g, kGateTile, up);
      gemv_rows(up, ni, hidden, rows.data(), m, u, kGateTile, static_cast<const W*>(nullptr));
      for (int64_t n = 0; n < m; ++n) {
        float* a = act + (p0 + n) * inter + i0;
        const float* gn = g + n * kGateTile;
        const float* un = u + n * kGateTile;
#pragma omp simd
        for (int64_t i = 0; i < ni; ++i) a[i] = gn[i] / (1.f + raylm::fast_exp(-gn[i])) * un[i];
      }
    }
  });
  // phase 2: item = a tile of output columns, owned: sum over hit experts of weight * (w2 rows . act)
  const int64_t threads = at::get_num_threads();
  int64_t cols = 64;
  while (cols > RB && hidden / cols < 4 * threads) cols /= 2;
  const int64_t col_tiles = (hidden + cols - 1) / cols;
  for_each_item(col_tiles, [&](int64_t item) {
    thread_local std::vector<float> sums, y;
    thread_local std::vector<const float*> rows;
    sums.assign(T * cols, 0.f);
    y.resize(kTokenChunk * cols);
    rows.resize(kTokenChunk);
    const int64_t h0 = item * cols, nh = std::min(cols, hidden - h0);
    for (size_t j = 0; j < rt.hit.size(); ++j) {
      const int64_t e = rt.hit[j];
      const W* down = w2 + (e * hidden + h0) * inter;
      const W* next = j + 1 < rt.hit.size() ? w2 + (rt.hit[j + 1] * hidden + h0) * inter : nullptr;
      for (int64_t p0 = rt.offsets[e]; p0 < rt.offsets[e + 1]; p0 += kTokenChunk) {
        const int64_t m = std::min(kTokenChunk, rt.offsets[e + 1] - p0);
        for (int64_t n = 0; n < m; ++n) rows[n] = act + (p0 + n) * inter;
        gemv_rows(down, nh, inter, rows.data(), m, y.data(), cols, p0 + m < rt.offsets[e + 1] ? down : next);
        add_weighted(rt, p0, m, y.data(), sums.data(), cols, nh);
      }
    }
    store(h0, nh, sums.data(), cols);
  });
}

// writes fp32 sums [T, n] (row stride ld) into columns [h0, h0 + n) of out
template <typename T>
void store_cols(T* out, int64_t tokens, int64_t hidden, int64_t h0, int64_t n, const float* sums, int64_t ld) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < n; ++h) out[t * hidden + h0 + h] = static_cast<T>(sums[t * ld + h]);
}

// writes fp32 sums [T, n] (row stride ld) into columns [h0, h0 + n) of out, rounded to out's dtype
using ColumnStore = std::function<void(int64_t, int64_t, const float*, int64_t)>;
ColumnStore column_store(at::Tensor& out) {
  const int64_t T = out.size(0), hidden = out.size(1);
  if (out.scalar_type() == at::kFloat)
    return [&out, T, hidden](int64_t h0, int64_t n, const float* s, int64_t ld) {
      store_cols(out.data_ptr<float>(), T, hidden, h0, n, s, ld);
    };
  if (out.scalar_type() == at::kBFloat16)
    return [&out, T, hidden](int64_t h0, int64_t n, const float* s, int64_t ld) {
      store_cols(out.data_ptr<c10::BFloat16>(), T, hidden, h0, n, s, ld);
    };
  return [&out, T, hidden](int64_t h0, int64_t n, const float* s, int64_t ld) {
    store_cols(out.data_ptr<c10::Half>(), T, hidden, h0, n, s, ld);
  };
}

// the weights' dtype W; x is widened to fp32 once (a no-op for fp32)
template <typename W>
void run_blocked(const Routing& rt, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                 at::Tensor& out) {
  const int64_t T = x.size(0), hidden = x.size(1), inter = w2.size(2);
  const at::Tensor xs = x.to(at::kFloat).contiguous();
  at::Tensor act = at::empty({std::max<int64_t>(rt.pairs(), 1), inter}, xs.options());
  const auto store = column_store(out);
  moe_blocked(rt, xs.data_ptr<float>(), w13.data_ptr<W>(), w2.data_ptr<W>(), hidden, inter, act.data_ptr<float>(),
              T, store);
}

void fused_moe(at::Tensor out, at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_ids,
               at::Tensor topk_weights, int64_t first_expert) {
  check_args(out, x, w13, w2, topk_ids, topk_weights);
  const auto xt = x.scalar_type(), wt = w13.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", xt);
  const Routing rt(topk_ids, topk_weights, first_expert, w13.size(0));
  if (x.size(0) == 0) return;
  if (wt == at::kFloat) return run_blocked<float>(rt, x, w13, w2, out);
  if (wt == at::kHalf) return run_blocked<c10::Half>(rt, x, w13, w2, out);
  TORCH_CHECK(wt == at::kBFloat16, "expert weights must be float32, bfloat16 or float16, got ", wt);
  run_blocked<c10::BFloat16>(rt, x, w13, w2, out);
}

// The same op with aten's GEMM per hit expert, in x's dtype (HF's per-expert order of rounding):
// pairs gathered by expert, gate/up and down as two GEMMs per expert into slices of one buffer,
// silu * up over all pairs at once, the weighted rows added into their tokens. Weights narrower
// than x are widened one expert at a time, as the reference does.
void fused_moe_mm(at::Tensor out, at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_ids,
                  at::Tensor topk_weights, int64_t first_expert) {
  check_args(out, x, w13, w2, topk_ids, topk_weights);
  const Routing rt(topk_ids, topk_weights, first_expert, w13.size(0));
  out.zero_();
  const int64_t pairs = rt.pairs(), inter = w2.size(2);
  if (pairs == 0) return;
  const auto index = at::empty({pairs}, topk_ids.options());
  std::copy(rt.token.begin(), rt.token.end(), index.data_ptr<int64_t>());
  const at::Tensor xs = x.index_select(0, index);
  at::Tensor h = at::empty({pairs, 2 * inter}, x.options());
  at::Tensor y = at::empty({pairs, x.size(1)}, x.options());
  const bool widen = w13.scalar_type() != x.scalar_type();
  for (const int64_t e : rt.hit) {
    const int64_t p0 = rt.offsets[e], n = rt.offsets[e + 1] - p0;
    const at::Tensor w = widen ? w13[e].to(x.scalar_type()) : w13[e];
    at::Tensor rows = h.narrow(0, p0, n);
    at::mm_out(rows, xs.narrow(0, p0, n), w.t());
  }
  const at::Tensor a = at::silu(h.narrow(1, 0, inter)).mul_(h.narrow(1, inter, inter));
  for (const int64_t e : rt.hit) {
    const int64_t p0 = rt.offsets[e], n = rt.offsets[e + 1] - p0;
    const at::Tensor w = widen ? w2[e].to(x.scalar_type()) : w2[e];
    at::Tensor rows = y.narrow(0, p0, n);
    at::mm_out(rows, a.narrow(0, p0, n), w.t());
  }
  auto wt = at::empty({pairs, 1}, topk_weights.options().dtype(at::kFloat));
  std::copy(rt.weight.begin(), rt.weight.end(), wt.data_ptr<float>());
  out.index_add_(0, index, y.mul_(wt.to(x.scalar_type())));
}

// -- the packed-panel path: experts packed once (fused_moe_pack), panel_gemm.h's micro-kernel ------------
constexpr int64_t kPanelGroup = 4;                  // panels per work item (64 rows on AVX2)
constexpr int64_t kTokenBlockBytes = 256 * 1024;    // the rows of x a token block may take (stays in L2)

int64_t token_block(int64_t K) {
  using raylm::panel::MR;
  return std::max<int64_t>(MR, kTokenBlockBytes / (K * static_cast<int64_t>(sizeof(float))) / MR * MR);
}

// y[n * ldy + j] (j < cols) = x_n . w[r0 + j] over the m rows x (by pointer), for the panels of rows
// [r0, r0 + cols) of one expert's packed weight [panels, K, NR] with `rows` rows in all
template <typename W>
void panels_gemm(const W* w, int64_t rows, int64_t K, int64_t r0, int64_t cols, const float* const* x, int64_t m,
                 float* y, int64_t ldy) {
  using raylm::panel::NR;
  const int64_t mc = token_block(K);
  for (int64_t i0 = 0; i0 < m; i0 += mc)
    for (int64_t r = r0; r < r0 + cols; r += NR)
      raylm::panel::panel_gemm(w + (r / NR) * K * NR, K, std::min(NR, rows - r), x + i0, std::min(mc, m - i0),
                               y + i0 * ldy + (r - r0), ldy);
}

template <typename W>
void moe_packed(const Routing& rt, const float* xf, const W* w13, const W* w2, int64_t hidden, int64_t inter,
                float* h, float* act, int64_t T,
                const std::function<void(int64_t, int64_t, const float*, int64_t)>& store) {
  using raylm::panel::NR;
  const int64_t group = kPanelGroup * NR;
  const int64_t p13 = (2 * inter + NR - 1) / NR, p2 = (hidden + NR - 1) / NR;
  const int64_t tiles = (2 * inter + group - 1) / group;
  // phase 1: h[p] = w13[e] . x_p for the expert's pairs, item = (hit expert, group of panels)
  for_each_item(static_cast<int64_t>(rt.hit.size()) * tiles, [&](int64_t item) {
    thread_local std::vector<const float*> rows;
    const int64_t e = rt.hit[item / tiles], r0 = (item % tiles) * group;
    const int64_t p0 = rt.offsets[e], m = rt.offsets[e + 1] - p0;
    rows.resize(m);
    for (int64_t n = 0; n < m; ++n) rows[n] = xf + rt.token[p0 + n] * hidden;
    panels_gemm(w13 + e * p13 * hidden * NR, 2 * inter, hidden, r0, std::min(group, 2 * inter - r0), rows.data(), m,
                h + p0 * 2 * inter + r0, 2 * inter);
  });
  // silu(gate) * up for every pair
  at::parallel_for(0, rt.pairs(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const float* g = h + q * 2 * inter;
      const float* u = g + inter;
      float* a = act + q * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.f + raylm::fast_exp(-g[i])) * u[i];
    }
  });
  // phase 2: item = a group of output columns, owned: over the hit experts in ascending order,
  // weight * (w2[e] . act_p) added into the pairs' tokens' sums for those columns
  const int64_t col_tiles = (hidden + group - 1) / group;
  for_each_item(col_tiles, [&](int64_t item) {
    thread_local std::vector<float> sums, y;
    thread_local std::vector<const float*> rows;
    const int64_t h0 = item * group, nh = std::min(group, hidden - h0);
    sums.assign(T * group, 0.f);
    for (const int64_t e : rt.hit) {
      const int64_t p0 = rt.offsets[e], m = rt.offsets[e + 1] - p0;
      rows.resize(m);
      y.resize(m * group);
      for (int64_t n = 0; n < m; ++n) rows[n] = act + (p0 + n) * inter;
      panels_gemm(w2 + e * p2 * inter * NR, hidden, inter, h0, nh, rows.data(), m, y.data(), group);
      add_weighted(rt, p0, m, y.data(), sums.data(), group, nh);
    }
    store(h0, nh, sums.data(), group);
  });
}

// out [T, hidden] = the experts' weighted sum, experts packed by fused_moe_pack: w13p [E, ceil(2I / NR),
// hidden, NR], w2p [E, ceil(hidden / NR), I, NR]
void fused_moe_packed(at::Tensor out, at::Tensor x, at::Tensor w13p, at::Tensor w2p, at::Tensor topk_ids,
                      at::Tensor topk_weights, int64_t first_expert, int64_t inter) {
  using raylm::panel::NR;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "out must be contiguous, shaped and typed like x");
  const int64_t hidden = x.size(1);
  TORCH_CHECK(w13p.dim() == 4 && w2p.dim() == 4 && w13p.is_contiguous() && w2p.is_contiguous() &&
                  w13p.size(0) == w2p.size(0) && w13p.size(1) == (2 * inter + NR - 1) / NR &&
                  w13p.size(2) == hidden && w13p.size(3) == NR && w2p.size(1) == (hidden + NR - 1) / NR &&
                  w2p.size(2) == inter && w2p.size(3) == NR && w13p.scalar_type() == w2p.scalar_type(),
              "w13p and w2p must be the experts packed by fused_moe_pack for this hidden and intermediate size");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "topk_ids must be int64 [T, k] and topk_weights [T, k]");
  const Routing rt(topk_ids, topk_weights, first_expert, w13p.size(0));
  const int64_t T = x.size(0);
  if (T == 0) return;
  const at::Tensor xs = x.to(at::kFloat).contiguous();
  at::Tensor h = at::empty({std::max<int64_t>(rt.pairs(), 1), 2 * inter}, xs.options());
  at::Tensor act = at::empty({std::max<int64_t>(rt.pairs(), 1), inter}, xs.options());
  const auto store = column_store(out);
  const float* xf = xs.data_ptr<float>();
  switch (w13p.scalar_type()) {
    case at::kBFloat16:
      return moe_packed(rt, xf, w13p.data_ptr<c10::BFloat16>(), w2p.data_ptr<c10::BFloat16>(), hidden, inter,
                        h.data_ptr<float>(), act.data_ptr<float>(), T, store);
    case at::kHalf:
      return moe_packed(rt, xf, w13p.data_ptr<c10::Half>(), w2p.data_ptr<c10::Half>(), hidden, inter,
                        h.data_ptr<float>(), act.data_ptr<float>(), T, store);
    case at::kFloat:
      return moe_packed(rt, xf, w13p.data_ptr<float>(), w2p.data_ptr<float>(), hidden, inter, h.data_ptr<float>(),
                        act.data_ptr<float>(), T, store);
    default: TORCH_CHECK(false, "expert weights must be float32, bfloat16 or float16, got ", w13p.scalar_type());
  }
}

// -- int8 experts (W8A8 with dynamic per-token activations), int8_dot.h's micro-kernel ----------------------
// The reference's arithmetic (workers/quant/weights.py reference_linear, one per product): each token's x
// quantized once (scale = max(max |x|, FLT_MIN) / 127, round half to even), exact int32 sums, (sums x the
// token's scale) x the channel's scale in double, rounded to x's dtype; silu(gate) and its product with up
// each rounded to x's dtype; that quantized per pair likewise before down; down's outputs rounded to x's
// dtype, times the routing weight, added into the token's fp32 sum (experts in ascending order).
// Phases as moe_blocked's: gate/up by (expert, row tile), the activations' quantization by pair, down by
// owned tiles of output columns.

// x [n] -> q [n] (int8 values, held as int8_dot.h's kernel reads them), returns the scale
inline float quantize_row(const float* x, int64_t n, raylm::int8::xq_t* q) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = std::max(amax, std::numeric_limits<float>::min()) / 127.f;
  #pragma omp simd
  for (int64_t i = 0; i < n; ++i) q[i] = raylm::int8::encode(raylm::round_to_int8(x[i] / s));
  return s;
}

// v rounded to x's dtype T (double -> float -> T, as torch's casts), read back as float
template <typename T>
inline float rnd(double v) {
  return static_cast<float>(static_cast<T>(static_cast<float>(v)));
}

// int8 experts as the checkpoint lays them out, [E, rows, K] (int8_dot.h's row-wise dot)
struct RowInt8 {
  const int8_t *w13, *w2;
  int64_t hidden, inter;

  int64_t x_stride() const { return hidden; }
  int64_t a_stride() const { return inter; }
  int64_t min_cols() const { return raylm::int8::RB; }
  void gate_up(int64_t e, int64_t i0, int64_t ni, const raylm::int8::xq_t* const* x, int64_t m, int32_t* g,
               int32_t* u, int64_t ld) const {
    const int8_t* gate = w13 + (e * 2 * inter + i0) * hidden;
    raylm::int8::gemv_rows(gate, ni, hidden, x, m, g, ld);
    raylm::int8::gemv_rows(gate + inter * hidden, ni, hidden, x, m, u, ld);
  }
  void down(int64_t e, int64_t h0, int64_t nh, const raylm::int8::xq_t* const* x, int64_t m, int32_t* y,
            int64_t ld) const {
    raylm::int8::gemv_rows(w2 + (e * hidden + h0) * inter, nh, inter, x, m, y, ld);
  }
};

#ifdef RAYLM_INT8_VNNI
// int8 experts packed by fused_moe_int8_pack: w13 [E, 2 (gate, up), Ip, Hp] and w2 [E, 1, Hp2, Ip2] in panels
// of 16 rows (int8_dot.h), rows and columns padded with zeros to 16 and 4, with each row's sum
struct PanelInt8 {
  const int8_t *w13, *w2;
  const int32_t *sum13, *sum2;
  int64_t Ip, Hp, Rd, Kd;  // gate/up: Ip rows of Hp columns; down: Rd rows of Kd columns

  int64_t x_stride() const { return Hp; }
  int64_t a_stride() const { return Kd; }
  int64_t min_cols() const { return raylm::int8::PR; }
  void gate_up(int64_t e, int64_t i0, int64_t ni, const raylm::int8::xq_t* const* x, int64_t m, int32_t* g,
               int32_t* u, int64_t ld) const {
    const int64_t r0[2] = {e * 2 * Ip + i0, (e * 2 + 1) * Ip + i0};  // gate's rows, up's
#ifdef RAYLM_INT8_AMX
    const int8_t* w[2] = {w13 + r0[0] * Hp, w13 + r0[1] * Hp};
    const int32_t* s[2] = {sum13 + r0[0], sum13 + r0[1]};
    int32_t* o[2] = {g, u};
    if (raylm::int8::panel_rows_amx(w, 2, ni, Hp / 4, x, m, s, o, ld)) return;
#endif
    for (int part = 0; part < 2; ++part)
      raylm::int8::panel_rows(w13 + r0[part] * Hp, ni, Hp / 4, x, m, sum13 + r0[part], part ? u : g, ld);
  }
  void down(int64_t e, int64_t h0, int64_t nh, const raylm::int8::xq_t* const* x, int64_t m, int32_t* y,
            int64_t ld) const {
    const int64_t r0 = e * Rd + h0;
#ifdef RAYLM_INT8_AMX
    const int8_t* w = w2 + r0 * Kd;
    const int32_t* s = sum2 + r0;
    if (raylm::int8::panel_rows_amx(&w, 1, nh, Kd / 4, x, m, &s, &y, ld)) return;
#endif
    raylm::int8::panel_rows(w2 + r0 * Kd, nh, Kd / 4, x, m, sum2 + r0, y, ld);
  }
};
#endif

template <typename T, typename Dots>
void moe_int8(const Routing& rt, const float* xf, const Dots& d, const float* s13, const float* s2, int64_t tokens,
              int64_t hidden, int64_t inter, const ColumnStore& store) {
  const int64_t pairs = rt.pairs(), hit = static_cast<int64_t>(rt.hit.size());
  const int64_t xs = d.x_stride(), as = d.a_stride();  // a token's row in xq / aq (padding: int8 zeros)
  std::vector<raylm::int8::xq_t> xq(tokens * xs, raylm::int8::encode(0)), aq(pairs * as, raylm::int8::encode(0));
  std::vector<float> sx(tokens), sa(pairs), act(pairs * inter);
  at::parallel_for(0, tokens, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sx[t] = quantize_row(xf + t * hidden, hidden, xq.data() + t * xs);
  });
  // phase 1: act[p, i] = silu(gate_i . x_p) * (up_i . x_p), item = (hit expert, intermediate tile)
  const int64_t tiles = (inter + kGateTile - 1) / kGateTile;
  for_each_item(hit * tiles, [&](int64_t item) {
    thread_local std::vector<int32_t> scratch;
    thread_local std::vector<const raylm::int8::xq_t*> rows;
    scratch.resize(2 * kTokenChunk * kGateTile);
    rows.resize(kTokenChunk);
    int32_t* g = scratch.data();
    int32_t* u = g + kTokenChunk * kGateTile;
    const int64_t e = rt.hit[item / tiles], i0 = (item % tiles) * kGateTile;
    const int64_t ni = std::min(kGateTile, inter - i0);
    const float* sg = s13 + e * 2 * inter + i0;
    const float* su = sg + inter;
    for (int64_t p0 = rt.offsets[e]; p0 < rt.offsets[e + 1]; p0 += kTokenChunk) {
      const int64_t m = std::min(kTokenChunk, rt.offsets[e + 1] - p0);
      for (int64_t n = 0; n < m; ++n) rows[n] = xq.data() + rt.token[p0 + n] * xs;
      d.gate_up(e, i0, ni, rows.data(), m, g, u, kGateTile);
      for (int64_t n = 0; n < m; ++n) {
        const double s = sx[rt.token[p0 + n]];
        float* a = act.data() + (p0 + n) * inter + i0;
        for (int64_t i = 0; i < ni; ++i) {
          const float gv = rnd<T>(g[n * kGateTile + i] * s * sg[i]), uv = rnd<T>(u[n * kGateTile + i] * s * su[i]);
          a[i] = rnd<T>(rnd<T>(gv / (1.f + raylm::fast_exp(-gv))) * uv);
        }
      }
    }
  });
  at::parallel_for(0, pairs, 16, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) sa[p] = quantize_row(act.data() + p * inter, inter, aq.data() + p * as);
  });
  // phase 2: item = a tile of output columns, owned: over the hit experts in ascending order
  const int64_t threads = at::get_num_threads();
  int64_t cols = 64;
  while (cols > d.min_cols() && hidden / cols < 4 * threads) cols /= 2;
  const int64_t col_tiles = (hidden + cols - 1) / cols;
  for_each_item(col_tiles, [&](int64_t item) {
    thread_local std::vector<float> sums;
    thread_local std::vector<int32_t> y;
    thread_local std::vector<const raylm::int8::xq_t*> rows;
    sums.assign(tokens * cols, 0.f);
    y.resize(kTokenChunk * cols);
    rows.resize(kTokenChunk);
    const int64_t h0 = item * cols, nh = std::min(cols, hidden - h0);
    for (const int64_t e : rt.hit) {
      const float* sd = s2 + e * hidden + h0;
      for (int64_t p0 = rt.offsets[e]; p0 < rt.offsets[e + 1]; p0 += kTokenChunk) {
        const int64_t m = std::min(kTokenChunk, rt.offsets[e + 1] - p0);
        for (int64_t n = 0; n < m; ++n) rows[n] = aq.data() + (p0 + n) * as;
        d.down(e, h0, nh, rows.data(), m, y.data(), cols);
        for (int64_t n = 0; n < m; ++n) {
          const int64_t p = p0 + n;
          const double s = sa[p];
          const float wt = rt.weight[p];
          float* sum = sums.data() + rt.token[p] * cols;
          for (int64_t c = 0; c < nh; ++c) sum[c] += rnd<T>(wt * rnd<T>(y[n * cols + c] * s * sd[c]));
        }
      }
    }
    store(h0, nh, sums.data(), cols);
  });
}

void check_int8_call(const at::Tensor& x, const at::Tensor& s13, const at::Tensor& s2, int64_t E, int64_t inter,
                     int64_t hidden) {
  TORCH_CHECK(s13.scalar_type() == at::kFloat && s13.is_contiguous() && s13.dim() == 2 && s13.size(0) == E &&
                  s13.size(1) == 2 * inter && s2.scalar_type() == at::kFloat && s2.is_contiguous() &&
                  s2.dim() == 2 && s2.size(0) == E && s2.size(1) == hidden,
              "scales must be contiguous float32 [E, 2I] (gate/up) and [E, hidden] (down)");
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", xt);
}

// moe_int8 over the weights `d` in x's dtype, into out
template <typename Dots>
void run_int8(at::Tensor& out, const at::Tensor& x, const Dots& d, const at::Tensor& s13, const at::Tensor& s2,
              const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t first_expert, int64_t E,
              int64_t inter) {
  const Routing rt(topk_ids, topk_weights, first_expert, E);
  const int64_t T = x.size(0), hidden = x.size(1);
  if (T == 0) return;
  const at::Tensor xs = x.to(at::kFloat).contiguous();
  const auto store = column_store(out);
  auto run = [&](auto tag) {
    moe_int8<decltype(tag)>(rt, xs.data_ptr<float>(), d, s13.data_ptr<float>(), s2.data_ptr<float>(), T, hidden,
                            inter, store);
  };
  const auto xt = x.scalar_type();
  if (xt == at::kFloat) return run(float{});
  if (xt == at::kBFloat16) return run(c10::BFloat16{});
  run(c10::Half{});
}

// out [T, hidden] = the int8 experts' weighted sum: w13 int8 [E, 2I, hidden] with s13 fp32 [E, 2I], w2 int8
// [E, hidden, I] with s2 fp32 [E, hidden] (one scale per output channel)
void fused_moe_int8(at::Tensor out, at::Tensor x, at::Tensor w13, at::Tensor s13, at::Tensor w2, at::Tensor s2,
                    at::Tensor topk_ids, at::Tensor topk_weights, int64_t first_expert) {
  check_args(out, x, w13, w2, topk_ids, topk_weights);
  TORCH_CHECK(w13.scalar_type() == at::kChar, "int8 experts must be int8, got ", w13.scalar_type());
  const int64_t E = w13.size(0), inter = w2.size(2), hidden = x.size(1);
  check_int8_call(x, s13, s2, E, inter, hidden);
  const RowInt8 d{w13.data_ptr<int8_t>(), w2.data_ptr<int8_t>(), hidden, inter};
  run_int8(out, x, d, s13, s2, topk_ids, topk_weights, first_expert, E, inter);
}

// w [E, rows, K] int8 (parts of rows / parts rows each: gate and up) -> (panels [E, parts, Rp, Kp] int8, row sums
// [E, parts, Rp] int32): each part's rows padded with zeros to Rp (a multiple of 16) and columns to Kp (of 4),
// laid out as int8_dot.h's panels ([Rp / 16][Kp / 4][16][4] per part)
std::tuple<at::Tensor, at::Tensor> fused_moe_int8_pack(at::Tensor w, int64_t parts) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kChar && parts >= 1 && w.size(1) % parts == 0,
              "fused_moe_int8_pack takes int8 [E, rows, K] experts whose rows split into `parts`");
  const int64_t E = w.size(0), R = w.size(1) / parts, K = w.size(2);
  const int64_t Rp = (R + 15) / 16 * 16, Kp = (K + 3) / 4 * 4;
  at::Tensor packed = at::zeros({E, parts, Rp, Kp}, w.options());
  at::Tensor sums = at::zeros({E, parts, Rp}, w.options().dtype(at::kInt));
  const at::Tensor wc = w.contiguous();
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sp = sums.data_ptr<int32_t>();
  at::parallel_for(0, E * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ep = begin; ep < end; ++ep)
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* row = src + (ep * R + r) * K;  // part p of expert e: rows e * parts * R + p * R ...
        int8_t* panel = dst + ep * Rp * Kp + (r / 16) * 16 * Kp + (r % 16) * 4;
        int32_t total = 0;
        for (int64_t k = 0; k < K; ++k) {
          panel[(k / 4) * 64 + k % 4] = row[k];
          total += row[k];
        }
        sp[ep * Rp + r] = total;
      }
  });
  return {packed, sums};
}

// fused_moe_int8 over experts packed by fused_moe_int8_pack (w13 with parts=2, w2 with parts=1); inter: I
void fused_moe_int8_packed(at::Tensor out, at::Tensor x, at::Tensor w13, at::Tensor sum13, at::Tensor s13,
                           at::Tensor w2, at::Tensor sum2, at::Tensor s2, at::Tensor topk_ids, at::Tensor topk_weights,
                           int64_t first_expert, int64_t inter) {
#ifdef RAYLM_INT8_VNNI
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "out must be contiguous, shaped and typed like x");
  const int64_t E = w13.size(0), hidden = x.size(1);
  TORCH_CHECK(w13.dim() == 4 && w13.size(1) == 2 && w13.size(2) % 16 == 0 && w13.size(2) >= inter &&
                  w13.size(3) % 4 == 0 && w13.size(3) >= hidden && w13.scalar_type() == at::kChar &&
                  w13.is_contiguous() && w2.dim() == 4 && w2.size(0) == E && w2.size(1) == 1 &&
                  w2.size(2) % 16 == 0 && w2.size(2) >= hidden && w2.size(3) % 4 == 0 && w2.size(3) >= inter &&
                  w2.scalar_type() == at::kChar && w2.is_contiguous(),
              "w13 and w2 must be packed by fused_moe_int8_pack for this x and intermediate size");
  TORCH_CHECK(sum13.scalar_type() == at::kInt && sum13.is_contiguous() && sum13.numel() == E * 2 * w13.size(2) &&
                  sum2.scalar_type() == at::kInt && sum2.is_contiguous() && sum2.numel() == E * w2.size(2),
              "row sums must be fused_moe_int8_pack's");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "topk_ids must be int64 [T, k] and topk_weights [T, k]");
  check_int8_call(x, s13, s2, E, inter, hidden);
  const PanelInt8 d{w13.data_ptr<int8_t>(), w2.data_ptr<int8_t>(), sum13.data_ptr<int32_t>(), sum2.data_ptr<int32_t>(),
                    w13.size(2), w13.size(3), w2.size(2), w2.size(3)};
  run_int8(out, x, d, s13, s2, topk_ids, topk_weights, first_expert, E, inter);
#else
  TORCH_CHECK(false, "packed int8 experts need AVX512-VNNI, which this build has not");
#endif
}

bool fused_moe_int8_panels() {
#ifdef RAYLM_INT8_VNNI
  return true;
#else
  return false;
#endif
}

std::string fused_moe_int8_isa() { return raylm::int8::kIsa; }

// a layer's experts [E, rows, K] -> their panels [E, ceil(rows / NR), K, NR]
at::Tensor fused_moe_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 3, "fused_moe_pack takes [E, rows, K] experts");
  return raylm::panel::pack_panels(w);
}

std::string fused_moe_isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("fused_moe(Tensor(a!) out, Tensor x, Tensor w13, Tensor w2, Tensor topk_ids, Tensor topk_weights, "
        "int first_expert) -> ()");
  m.def("fused_moe_mm(Tensor(a!) out, Tensor x, Tensor w13, Tensor w2, Tensor topk_ids, Tensor topk_weights, "
        "int first_expert) -> ()");
  m.def("fused_moe_packed(Tensor(a!) out, Tensor x, Tensor w13p, Tensor w2p, Tensor topk_ids, Tensor topk_weights, "
        "int first_expert, int inter) -> ()");
  m.def("fused_moe_pack(Tensor w) -> Tensor");
  m.def("fused_moe_isa() -> str", &fused_moe_isa);
  m.def("fused_moe_int8(Tensor(a!) out, Tensor x, Tensor w13, Tensor s13, Tensor w2, Tensor s2, Tensor topk_ids, "
        "Tensor topk_weights, int first_expert) -> ()");
  m.def("fused_moe_int8_isa() -> str", &fused_moe_int8_isa);
  m.def("fused_moe_int8_panels() -> bool", &fused_moe_int8_panels);
  m.def("fused_moe_int8_pack(Tensor w, int parts) -> (Tensor, Tensor)");
  m.def("fused_moe_int8_packed(Tensor(a!) out, Tensor x, Tensor w13, Tensor sum13, Tensor s13, Tensor w2, "
        "Tensor sum2, Tensor s2, Tensor topk_ids, Tensor topk_weights, int first_expert, int inter) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("fused_moe_mm", &fused_moe_mm);
  m.impl("fused_moe_packed", &fused_moe_packed);
  m.impl("fused_moe_pack", &fused_moe_pack);
  m.impl("fused_moe_int8", &fused_moe_int8);
  m.impl("fused_moe_int8_pack", &fused_moe_int8_pack);
  m.impl("fused_moe_int8_packed", &fused_moe_int8_packed);
}
