// A linear whose weight is narrower than its activations: y [m, rows] = x [m, K] @ w [rows, K]^T with
// x in fp32 and w in bf16 / fp16 (or fp32), read at its own width and widened in registers. For the
// weights of a bf16 checkpoint computing in fp32 on a CPU: bf16 -> fp32 is exact, so the arithmetic
// is fp32's while a step reads half the bytes.
//
// The weight is packed once (narrow_pack) into panels, which panel_gemm.h's outer-product micro-kernel
// reads. Panels are split among torch's threads; tokens go in blocks whose rows of x stay in L2 while
// the thread's panels stream past them; small batches are one block, bound by reading the weight once.
//
// narrow_linear_argmax is the same product reduced to each row's argmax as it is computed (greedy
// sampling straight from the lm_head): each panel's outputs for a block of tokens go to a tile that
// stays in L1, so the [m, rows] logits are never written. narrow_rows reads rows of a packed weight
// back, widened: a tied embedding's lookups served by the lm_head's panels, so it is held once.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

#include "panel_gemm.h"
#include "row_best.h"

#ifndef XBLOCK_BYTES_
#define XBLOCK_BYTES_ (256 * 1024)
#endif

namespace {

using namespace raylm::panel;  // NOLINT: the micro-kernel's names

constexpr int64_t XBLOCK_BYTES = XBLOCK_BYTES_;  // x a block of tokens may take (half a small L2)

// How a product is split: x's rows by pointer, the tokens a block takes (its rows of x stay in L2
// while a thread's panels stream past them), and the panels a thread's chunk takes (up to 16, but
// every thread busy on a weight of few panels, a 128-row router).
struct Split {
  std::vector<const float*> xs;
  int64_t m, K, rows, panels, mc, grain;

  Split(const at::Tensor& x, int64_t rows_) : m(x.size(0)), K(x.size(1)), rows(rows_) {
    xs.resize(m);
    for (int64_t i = 0; i < m; ++i) xs[i] = x.data_ptr<float>() + i * x.stride(0);
    panels = (rows + NR - 1) / NR;
    mc = std::max<int64_t>(MR, XBLOCK_BYTES / (K * static_cast<int64_t>(sizeof(float))) / MR * MR);
    grain = std::max<int64_t>(1, std::min<int64_t>(16, panels / at::get_num_threads()));
  }
};

template <typename W>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& packed) {
  const Split s(x, y.size(1));
  const W* wp = packed.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  at::parallel_for(0, s.panels, s.grain, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < s.m; i0 += s.mc) {
      const int64_t i1 = std::min(s.m, i0 + s.mc);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n = std::min(NR, s.rows - p * NR);
        panel_gemm(wp + p * s.K * NR, s.K, n, s.xs.data() + i0, i1 - i0, yp + i0 * ldy + p * NR, ldy);
      }
    }
  });
}

using Best = raylm::RowBest;

// One panel's outputs for a block of tokens into a tile [m, NR]. Kept out of line: inlined into the
// argmax's loop, the micro-kernel's accumulators spilled (2.5x slower on an AVX2 Zen 3).
template <typename W>
__attribute__((noinline)) void panel_tile(const W* panel, int64_t K, int64_t n, const float* const* x, int64_t m,
                                          float* tile) {
  panel_gemm(panel, K, n, x, m, tile, NR);
}

template <typename W>
void run_argmax(at::Tensor& ids, const at::Tensor& x, const at::Tensor& packed, int64_t rows) {
  const Split s(x, rows);
  const W* wp = packed.data_ptr<W>();
  std::mutex mu;
  std::vector<std::pair<int64_t, Best>> parts;  // each chunk's rows' best, by the chunk's first panel
  at::parallel_for(0, s.panels, s.grain, [&](int64_t begin, int64_t end) {
    Best best(s.m);
    std::vector<float> tile(s.mc * NR);
    for (int64_t i0 = 0; i0 < s.m; i0 += s.mc) {
      const int64_t i1 = std::min(s.m, i0 + s.mc);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n = std::min(NR, s.rows - p * NR);
        panel_tile(wp + p * s.K * NR, s.K, n, s.xs.data() + i0, i1 - i0, tile.data());
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = 0; j < n; ++j) best.offer(i, tile[(i - i0) * NR + j], p * NR + j);
      }
    }
    const std::lock_guard<std::mutex> lock(mu);
    parts.emplace_back(begin, std::move(best));
  });
  raylm::merge_bests(parts, s.m, ids.data_ptr<int64_t>());
}

// w [rows, K] -> its panels [ceil(rows / NR), K, NR]
at::Tensor narrow_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "narrow_pack takes a 2-d weight");
  return pack_panels(w);
}

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous(), "w must be packed by narrow_pack");
  const auto wt = packed.scalar_type();
  TORCH_CHECK(wt == at::kBFloat16 || wt == at::kHalf || wt == at::kFloat,
              "w must be bfloat16, float16 or float32, got ", wt);
}

void check_operands(const at::Tensor& x, const at::Tensor& packed) {
  check_packed(packed);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a 2-d float32 tensor with contiguous rows");
  TORCH_CHECK(packed.size(1) == x.size(1), "w must be packed for x's width");
}

// f<W>() for the packed weight's element type
template <typename F>
void dispatch_weight(const at::Tensor& packed, F&& f) {
  switch (packed.scalar_type()) {
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: return f(float{});
  }
}

// y [m, rows] (fp32, row stride >= rows) = x [m, K] (fp32, contiguous rows) @ w[:rows]^T, w packed
void narrow_linear(at::Tensor y, at::Tensor x, at::Tensor packed) {
  check_operands(x, packed);
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.stride(1) == 1, "y must be float32 with contiguous rows");
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) <= packed.size(0) * NR, "y must be [x rows, <= w rows]");
  if (x.size(0) == 0 || y.size(1) == 0) return;
  dispatch_weight(packed, [&](auto tag) { run<decltype(tag)>(y, x, packed); });
}

// argmax over j < rows of (x @ w^T)[i, j] for each row i of x (int64 [m]), w packed
at::Tensor narrow_linear_argmax(at::Tensor x, at::Tensor packed, int64_t rows) {
  check_operands(x, packed);
  TORCH_CHECK(rows > 0 && rows <= packed.size(0) * NR, "rows must be in [1, w rows], got ", rows);
  at::Tensor ids = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) > 0) dispatch_weight(packed, [&](auto tag) { run_argmax<decltype(tag)>(ids, x, packed, rows); });
  return ids;
}

// out [T, K] (fp32) = rows ids [T] of the packed w, widened (exact: an embedding lookup)
void narrow_rows(at::Tensor out, at::Tensor packed, at::Tensor ids) {
  check_packed(packed);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-d int64 tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == ids.size(0) &&
                  out.size(1) == packed.size(1),
              "out must be float32 [ids, w's width] with contiguous rows");
  const int64_t K = packed.size(1), rows = packed.size(0) * NR, T = ids.size(0), ldo = out.stride(0);
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "id ", ip[t], " is outside w's ", rows, " rows");
  float* op = out.data_ptr<float>();
  dispatch_weight(packed, [&](auto tag) {
    using W = decltype(tag);
    const W* wp = packed.data_ptr<W>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t j = ip[t] % NR;  // bf16 panels interleave their halves (pack_panels)
        const int64_t slot = std::is_same_v<W, c10::BFloat16> ? (j < VL ? 2 * j : 2 * (j - VL) + 1) : j;
        const W* src = wp + (ip[t] / NR) * K * NR + slot;
        float* o = op + t * ldo;
        for (int64_t k = 0; k < K; ++k) o[k] = static_cast<float>(src[k * NR]);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("narrow_linear(Tensor(a!) y, Tensor x, Tensor w) -> ()");
  m.def("narrow_pack(Tensor w) -> Tensor");
  m.def("narrow_linear_argmax(Tensor x, Tensor w, int rows) -> Tensor");
  m.def("narrow_rows(Tensor(a!) out, Tensor w, Tensor ids) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("narrow_linear", &narrow_linear);
  m.impl("narrow_pack", &narrow_pack);
  m.impl("narrow_linear_argmax", &narrow_linear_argmax);
  m.impl("narrow_rows", &narrow_rows);
}
