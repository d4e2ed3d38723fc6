// A linear whose weight is narrower than its activations: y [m, rows] = x [m, K] @ w [rows, K]^T with
// x in fp32 and w in bf16 / fp16 (or fp32), read at its own width and widened in registers. For the
// weights of a bf16 checkpoint computing in fp32 on a CPU: bf16 -> fp32 is exact, so the arithmetic
// is fp32's while a step reads half the bytes.
//
// The weight is packed once (narrow_pack) into panels, which panel_gemm.h's outer-product micro-kernel
// reads. Panels are split among torch's threads; tokens go in blocks whose rows of x stay in L2 while
// the thread's panels stream past them; small batches are one block, bound by reading the weight once.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "panel_gemm.h"

#ifndef XBLOCK_BYTES_
#define XBLOCK_BYTES_ (256 * 1024)
#endif

namespace {

using namespace raylm::panel;  // NOLINT: the micro-kernel's names

constexpr int64_t XBLOCK_BYTES = XBLOCK_BYTES_;  // x a block of tokens may take (half a small L2)

template <typename W>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& packed) {
  const int64_t m = x.size(0), K = x.size(1), rows = y.size(1);
  std::vector<const float*> xs(m);
  for (int64_t i = 0; i < m; ++i) xs[i] = x.data_ptr<float>() + i * x.stride(0);
  const W* wp = packed.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0), panels = (rows + NR - 1) / NR;
  // tokens a block takes: its rows of x stay in L2 while the thread's panels stream past them
  const int64_t mc = std::max<int64_t>(MR, XBLOCK_BYTES / (K * static_cast<int64_t>(sizeof(float))) / MR * MR);
  // chunks of up to 16 panels, but every thread busy on a weight of few panels (a 128-row router)
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(16, panels / at::get_num_threads()));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += mc) {
      const int64_t i1 = std::min(m, i0 + mc);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n = std::min(NR, rows - p * NR);
        panel_gemm(wp + p * K * NR, K, n, xs.data() + i0, i1 - i0, yp + i0 * ldy + p * NR, ldy);
      }
    }
  });
}

// w [rows, K] -> its panels [ceil(rows / NR), K, NR]
at::Tensor narrow_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "narrow_pack takes a 2-d weight");
  return pack_panels(w);
}

// y [m, rows] (fp32, row stride >= rows) = x [m, K] (fp32, contiguous rows) @ w[:rows]^T, w packed
void narrow_linear(at::Tensor y, at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && packed.dim() == 3, "narrow_linear takes 2-d x, y and a packed w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "x and y must be float32");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && packed.is_contiguous(),
              "x and y rows, and the packed w, must be contiguous");
  TORCH_CHECK(packed.size(2) == NR && packed.size(1) == x.size(1), "w must be packed by narrow_pack for x's width");
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) <= packed.size(0) * NR, "y must be [x rows, <= w rows]");
  if (x.size(0) == 0 || y.size(1) == 0) return;
  switch (packed.scalar_type()) {
    case at::kBFloat16: return run<c10::BFloat16>(y, x, packed);
    case at::kHalf: return run<c10::Half>(y, x, packed);
    case at::kFloat: return run<float>(y, x, packed);
    default: TORCH_CHECK(false, "w must be bfloat16, float16 or float32, got ", packed.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("narrow_linear(Tensor(a!) y, Tensor x, Tensor w) -> ()");
  m.def("narrow_pack(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("narrow_linear", &narrow_linear);
  m.impl("narrow_pack", &narrow_pack);
}
