// A linear whose weight is narrower than its activations: y [m, rows] = x [m, K] @ w [rows, K]^T with
// x in fp32 and w in bf16 / fp16 (or fp32), read at its own width and widened in registers (moe_gemv.h).
// For the big, decode-bound weights of a bf16 checkpoint computing in fp32 on a CPU (the lm_head:
// 151,936 rows): bf16 -> fp32 is exact, so the arithmetic is fp32's while a step reads half the bytes.
// Rows are split into tiles handed to torch's threads; each tile meets every token while it is in L1.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "moe_gemv.h"

namespace {

using raylm::moe::gemv_rows;

constexpr int64_t kRowTile = 64;

template <typename W>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& w) {
  const int64_t m = x.size(0), K = x.size(1), rows = y.size(1);
  std::vector<const float*> xs(m);
  for (int64_t i = 0; i < m; ++i) xs[i] = x.data_ptr<float>() + i * x.stride(0);
  const W* wp = w.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0), tiles = (rows + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kRowTile, n = std::min(kRowTile, rows - r0);
      const W* next = t + 1 < end ? wp + (r0 + kRowTile) * K : nullptr;
      gemv_rows(wp + r0 * K, n, K, xs.data(), m, yp + r0, ldy, next);
    }
  });
}

// y [m, rows] (fp32, row stride >= rows) = x [m, K] (fp32, contiguous rows) @ w[:rows]^T
void narrow_linear(at::Tensor y, at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2, "narrow_linear takes 2-d tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "x and y must be float32");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && w.is_contiguous(), "x and y rows, and w, must be contiguous");
  TORCH_CHECK(w.size(1) == x.size(1), "w has ", w.size(1), " columns, x ", x.size(1));
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) <= w.size(0), "y must be [x rows, <= w rows]");
  if (x.size(0) == 0 || y.size(1) == 0) return;
  switch (w.scalar_type()) {
    case at::kBFloat16: return run<c10::BFloat16>(y, x, w);
    case at::kHalf: return run<c10::Half>(y, x, w);
    case at::kFloat: return run<float>(y, x, w);
    default: TORCH_CHECK(false, "w must be bfloat16, float16 or float32, got ", w.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) { m.def("narrow_linear(Tensor(a!) y, Tensor x, Tensor w) -> ()"); }

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("narrow_linear", &narrow_linear); }
