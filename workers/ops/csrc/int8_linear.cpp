// W8A8's dense linear on AVX2 CPUs without VNNI: y [m, rows] (fp32) = (xq [m, K] @ w [rows, K]^T) * scale,
// int8 x int8 with exact int32 sums, from a weight packed once.
//
// oneDNN's AVX2 int8 kernels use VPMADDUBSW (unsigned x signed bytes, adjacent products summed into int16
// with saturation), which saturates for some operands and ran slower than fp32 on a Zen 3. Here each
// weight vector is widened to int16 in registers and VPMADDWD multiplies it by a token's column pair (the
// activations widened once per call), summing the two products into int32: exact for every int8 value,
// 16 multiply-adds an instruction (twice an fp32 FMA's). Measured on a Zen 3, it ran as fast as
// VPMADDUBSW with the activations' sign moved onto the weight (exact too, but not for a weight holding
// -128), since that needs a sign instruction on the same pipes per product.
//
// The weight is packed into panels of 8 rows, each row's column pairs side by side ([rows / 8][K / 2][8][2]
// bytes, rows padded with zeros): one 16-byte load, widened, is 8 rows x 2 columns, met by a broadcast
// of the token's 2 columns. The micro-kernel holds 2 panels x 4 tokens of int32 accumulators in
// registers over the whole of K. Panels are split among torch's threads; tokens go in blocks whose rows
// stay in L2 while a thread's panels stream past them.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "huge_pages.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PR = 8;                       // weight rows a panel holds
constexpr int64_t XBLOCK_BYTES = 256 * 1024;    // x a block of tokens may take
constexpr int MP = 2, MT = 4;                   // panels x tokens a micro-kernel call holds

#if defined(__AVX2__)
// out[t * ldo + p * 8 + j] = float(sum_k w[p * 8 + j][k] * x[t][k]) * scale[p * 8 + j] for P panels, T tokens
// (rows of int16), Kp pairs of columns; `valid` rows of the last panel stored
template <int P, int T>
inline void block(const int8_t* __restrict w, int64_t stride, int64_t Kp, const int16_t* const* x,
                  const float* scale, float* out, int64_t ldo, int64_t valid) {
  __m256i acc[P][T];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[p][t] = _mm256_setzero_si256();
  for (int64_t q = 0; q < Kp; ++q) {
    __m256i wv[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p)
      wv[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * stride + q * 16)));
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      int32_t two;
      std::memcpy(&two, x[t] + 2 * q, 4);
      const __m256i xb = _mm256_set1_epi32(two);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[p][t] = _mm256_add_epi32(acc[p][t], _mm256_madd_epi16(wv[p], xb));
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    const bool full = p + 1 < P || valid >= PR;
    alignas(32) float tmp[PR];
    const __m256 s = full ? _mm256_loadu_ps(scale + p * PR) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      float* o = out + t * ldo + p * PR;
      if (full) {
        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[p][t]), s));
      } else {
        _mm256_store_ps(tmp, _mm256_cvtepi32_ps(acc[p][t]));
        for (int64_t j = 0; j < valid; ++j) o[j] = tmp[j] * scale[p * PR + j];
      }
    }
  }
}

template <int P, int T = MT>
inline void tokens(int64_t n, const int8_t* w, int64_t stride, int64_t Kp, const int16_t* const* x,
                   const float* scale, float* out, int64_t ldo, int64_t valid) {
  if constexpr (T > 1) {
    if (n < T) return tokens<P, T - 1>(n, w, stride, Kp, x, scale, out, ldo, valid);
  }
  block<P, T>(w, stride, Kp, x, scale, out, ldo, valid);
}
#endif

// xq [m, K] int8 (K even; rows by stride), packed [panels, K / 2 * 16], scale [rows] -> y [m, rows] fp32
void int8_linear(at::Tensor y, at::Tensor xq, at::Tensor packed, at::Tensor scale) {
#if defined(__AVX2__)
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.stride(1) == 1, "xq must be int8 [m, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "the weight must be packed by int8_linear_pack");
  const int64_t m = xq.size(0), K = xq.size(1), rows = y.size(1), panels = packed.size(0);
  TORCH_CHECK(K % 2 == 0 && packed.size(1) == K / 2 * 16 && (rows + PR - 1) / PR == panels,
              "xq's columns and y's rows must match the packed weight");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == rows,
              "scale must be float32 [rows]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.size(0) == m && y.stride(1) == 1,
              "y must be float32 [m, rows], rows contiguous");
  if (m == 0 || rows == 0) return;
  // the activations widened to int16 once, so a broadcast of 4 bytes is a column pair of a token
  const std::unique_ptr<int16_t[]> xw(new int16_t[m * K]);  // every element written below: no zero fill
  std::vector<const int16_t*> xs(m);
  const int8_t* xp = xq.data_ptr<int8_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int8_t* src = xp + i * xq.stride(0);
      int16_t* dst = xw.get() + i * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = src[k];
      xs[i] = dst;
    }
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0), Kp = K / 2, stride = Kp * 16;
  const int64_t mc = std::max<int64_t>(MT, XBLOCK_BYTES / (2 * K) / MT * MT);
  const int64_t pairs = (panels + MP - 1) / MP;
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(8, pairs / at::get_num_threads()));
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += mc) {
      const int64_t i1 = std::min(m, i0 + mc);
      for (int64_t pp = begin; pp < end; ++pp) {
        const int64_t p = pp * MP, np = std::min<int64_t>(MP, panels - p), valid = rows - (p + np - 1) * PR;
        for (int64_t i = i0; i < i1; i += MT) {
          const int64_t n = std::min<int64_t>(MT, i1 - i);
          float* out = yp + i * ldy + p * PR;
          if (np == 2) tokens<2>(n, wp + p * stride, stride, Kp, xs.data() + i, sp + p * PR, out, ldy, valid);
          else tokens<1>(n, wp + p * stride, stride, Kp, xs.data() + i, sp + p * PR, out, ldy, valid);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "int8_linear needs AVX2, which this build has not");
#endif
}

// w int8 [rows, K] (K even) -> panels [ceil(rows / 8), K / 2 * 16]: row 8p + j's columns 2q, 2q + 1 at
// [p][q * 16 + j * 2 ...], rows past the end zero
at::Tensor int8_linear_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "int8_linear_pack takes an int8 [rows, K] weight");
  TORCH_CHECK(w.size(1) % 2 == 0, "int8_linear_pack takes an even K, got ", w.size(1));
  const int64_t rows = w.size(0), K = w.size(1), panels = (rows + PR - 1) / PR, Kp = K / 2;
  at::Tensor packed = at::empty({panels, Kp * 16}, w.options());
  raylm::advise_huge_pages(packed.data_ptr(), packed.nbytes());  // before the pages are first written
  packed.zero_();
  const at::Tensor wc = w.contiguous();
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* panel = dst + (r / PR) * Kp * 16 + (r % PR) * 2;
      for (int64_t k = 0; k < K; ++k) panel[(k / 2) * 16 + k % 2] = src[r * K + k];
    }
  });
  return packed;
}

bool int8_linear_available() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("int8_linear(Tensor(a!) y, Tensor xq, Tensor packed, Tensor scale) -> ()");
  m.def("int8_linear_pack(Tensor w) -> Tensor");
  m.def("int8_linear_available() -> bool", &int8_linear_available);
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_pack", &int8_linear_pack);
}
