// Each row's argmax as a product's outputs come out, for the lm_head kernels that fold greedy sampling
// into the GEMM (narrow_linear.cpp, packed_bf16_linear.cpp): ties go to the lowest index and NaN above all, as
// torch.argmax. Threads keep a RowBest each over their chunk of columns; merge_bests joins them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace raylm {

struct RowBest {
  std::vector<float> value;
  std::vector<int64_t> index;  // -1: nothing seen yet

  explicit RowBest(int64_t m) : value(m, 0.f), index(m, -1) {}

  void offer(int64_t i, float v, int64_t j) {
    const float b = value[i];
    if (index[i] < 0 || v > b || (v != v && b == b)) {
      value[i] = v;
      index[i] = j;
    }
  }
};

// ids [m] = each row's argmax over the chunks (each keyed by its first column, in any order): joined in
// column order, so a later chunk wins only by a larger value
inline void merge_bests(std::vector<std::pair<int64_t, RowBest>>& parts, int64_t m, int64_t* ids) {
  std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  RowBest all(m);
  for (const auto& part : parts)
    for (int64_t i = 0; i < m; ++i)
      if (part.second.index[i] >= 0) all.offer(i, part.second.value[i], part.second.index[i]);
  for (int64_t i = 0; i < m; ++i) ids[i] = all.index[i];
}

}  // namespace raylm
