// Greedy's argmax over rows of logits in any float dtype, and random sampling's last pass for
// the CPU sampler (fp32).
//
// argmax_rows: per row, the first index of the largest of its first n values (the first NaN
// if the row has one), as torch.argmax; one vectorized pass for the max (and whether a NaN is
// there), one for its first index while the row is still in cache. bf16 / fp16 rows are
// widened as they are read: torch's argmax over a bf16 row is several times slower.
//
// sample_rows: one draw per row from
// softmax(scores[r]) by inverse CDF. Three passes over the row (max; exp and its sum; the
// running sum until it passes U * sum), against the exponential race's uniform noise and two
// logs per token in torch: the only transcendental per token is one vectorized exp.
//
// U comes from the row's 64-bit key (splitmix64, 53 bits, centred in its bin: U in (0, 1)):
// a seeded row's key is its (seed, position) mix, so its draw does not depend on its batch
// companions or row index; unseeded rows take keys drawn from the sampler's generator. A -inf
// score (filtered) has probability 0 and is never drawn.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <memory>

#include "vec_math.h"

namespace {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// the row's draw: softmax numerators into e, then the first id whose running sum passes u * sum
int64_t draw_row(const float* __restrict s, float* __restrict e, int32_t n, double u) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float m = neg_inf;
#pragma omp simd reduction(max : m)
  for (int32_t i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
  if (m == neg_inf) return 0;  // nothing allowed (cannot happen after the sampler's filters)
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int32_t i = 0; i < n; ++i) {
    const float v = s[i] == neg_inf ? 0.f : raylm::fast_exp(s[i] - m);
    e[i] = v;
    total += v;
  }
  const double target = u * static_cast<double>(total);
  double run = 0.0;
  int64_t last = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (e[i] > 0.f) {
      run += e[i];
      last = i;
      if (run > target) return i;
    }
  }
  return last;  // the sums' rounding left the target past the end: the last allowed id
}

template <typename E>
int64_t argmax_row(const typename E::T* __restrict s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = E::widen(s[i]);
    nan |= v != v;
    m = v > m ? v : m;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = E::widen(s[i]);
    if (nan ? v != v : v == m) return i;
  }
  return 0;  // every value -inf
}

template <typename E>
void argmax_all(const at::Tensor& scores, int64_t n, int64_t* out) {
  const auto* sp = static_cast<const typename E::T*>(scores.data_ptr());
  const int64_t rs = scores.stride(0);
  at::parallel_for(0, scores.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row<E>(sp + r * rs, n);
  });
}

at::Tensor argmax_rows(at::Tensor scores, int64_t n) {
  TORCH_CHECK(scores.dim() == 2 && scores.stride(1) == 1, "scores must be [R, V] with unit stride along V");
  TORCH_CHECK(n > 0 && n <= scores.size(1), "n must be in [1, V], got ", n);
  at::Tensor out = at::empty({scores.size(0)}, scores.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  switch (scores.scalar_type()) {
    case at::kFloat: argmax_all<raylm::F32>(scores, n, op); break;
    case at::kBFloat16: argmax_all<raylm::BF16>(scores, n, op); break;
    case at::kHalf: argmax_all<raylm::F16>(scores, n, op); break;
    default: TORCH_CHECK(false, "argmax_rows takes float32, bfloat16 or float16 scores, got ", scores.scalar_type());
  }
  return out;
}

at::Tensor sample_rows(at::Tensor scores, at::Tensor keys) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.dim() == 2 && scores.stride(1) == 1,
              "scores must be a float32 [R, V] with unit stride along V");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 && keys.is_contiguous() &&
                  keys.size(0) == scores.size(0),
              "keys must be a contiguous int64 [R]");
  const int64_t rows = scores.size(0), vocab = scores.size(1), rs = scores.stride(0);
  TORCH_CHECK(vocab > 0 && vocab <= std::numeric_limits<int32_t>::max(), "vocab must be in [1, 2^31)");
  at::Tensor out = at::empty({rows}, keys.options());
  const float* sp = scores.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> e(new float[vocab]);  // every slot is written before it is read: no zeroing
    for (int64_t r = begin; r < end; ++r) {
      const uint64_t bits = splitmix64(static_cast<uint64_t>(kp[r])) >> 11;  // 53 bits
      const double u = (static_cast<double>(bits) + 0.5) * (1.0 / 9007199254740992.0);
      op[r] = draw_row(sp + r * rs, e.get(), static_cast<int32_t>(vocab), u);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("sample_rows(Tensor scores, Tensor keys) -> Tensor");
  m.def("argmax_rows(Tensor scores, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("argmax_rows", &argmax_rows);
}
