// W8A8's dense linear on AVX2 CPUs without VNNI: y [m, rows] (fp32) = (xq [m, K] @ w [rows, K]^T) * scale,
// int8 x int8 with exact int32 sums, from a weight packed once.
//
// Without VNNI the fast int8 instruction is VPMADDUBSW: unsigned bytes times signed bytes, adjacent
// products summed into int16 with saturation. With the activation's magnitude as the unsigned operand and
// its sign moved onto the weight (VPSIGNB), each int16 sum is at most 2 x 128 x 127 = 32512 whenever the
// weight holds no -128, so nothing saturates: int8_linear_pack refuses a weight holding -128 (the caller
// then keeps another kernel). VPMADDWD against ones widens the pair sums into int32 sums of four
// products. That is 32 multiply-adds in four instructions, twice what fp32 FMAs give on the same core
// (and twice VPMADDWD over int16-widened operands, which costs the same instructions per product).
//
// The weight is packed into panels of 8 rows, each row's 4 consecutive columns side by side
// ([rows / 8][K / 4][8][4] bytes, rows and columns padded with zeros): one 32-byte load is 8 rows x 4
// columns, met by a broadcast of the token's 4 columns. The micro-kernel holds 2 panels x 4 tokens of
// int32 accumulators in registers over the whole of K. Panels are split among torch's threads; tokens go
// in blocks whose rows stay in L2 while a thread's panels stream past them.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PR = 8;                       // weight rows a panel holds
constexpr int64_t XBLOCK_BYTES = 256 * 1024;    // x a block of tokens may take
constexpr int MP = 2, MT = 4;                   // panels x tokens a micro-kernel call holds

bool has_kernel() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__)
// out[t * ldo + p * 8 + j] = float(sum_k w[p * 8 + j][k] * x[t][k]) * scale[p * 8 + j] for P panels, T tokens,
// Kq groups of 4 columns; `valid` rows of the last panel stored
template <int P, int T>
inline void block(const int8_t* __restrict w, int64_t stride, int64_t Kq, const int8_t* const* x,
                  const float* scale, float* out, int64_t ldo, int64_t valid) {
  __m256i acc[P][T];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[p][t] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t q = 0; q < Kq; ++q) {
    __m256i wv[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) wv[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * stride + q * 32));
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      int32_t four;
      std::memcpy(&four, x[t] + 4 * q, 4);
      const __m256i xs = _mm256_set1_epi32(four);
      const __m256i xa = _mm256_abs_epi8(xs);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256i pairs = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[p], xs));
        acc[p][t] = _mm256_add_epi32(acc[p][t], _mm256_madd_epi16(pairs, ones));
      }
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

template <int P>
inline void tokens(int64_t n, const int8_t* w, int64_t stride, int64_t Kq, const int8_t* const* x,
                   const float* scale, float* out, int64_t ldo, int64_t valid) {
  if (n >= 4) return block<P, 4>(w, stride, Kq, x, scale, out, ldo, valid);
  if (n == 3) return block<P, 3>(w, stride, Kq, x, scale, out, ldo, valid);
  if (n == 2) return block<P, 2>(w, stride, Kq, x, scale, out, ldo, valid);
  block<P, 1>(w, stride, Kq, x, scale, out, ldo, valid);
}
#endif

// xq [m, K] int8 (K % 4 == 0; rows by stride), packed [panels, Kq * 32], scale [rows] -> y [m, rows] fp32
void int8_linear(at::Tensor y, at::Tensor xq, at::Tensor packed, at::Tensor scale) {
#if defined(__AVX2__)
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.stride(1) == 1, "xq must be int8 [m, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "the weight must be packed by int8_linear_pack");
  const int64_t m = xq.size(0), K = xq.size(1), rows = y.size(1), panels = packed.size(0);
  TORCH_CHECK(K % 4 == 0 && packed.size(1) == K / 4 * 32 && (rows + PR - 1) / PR == panels,
              "xq's columns and y's rows must match the packed weight");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == rows,
              "scale must be float32 [rows]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.size(0) == m && y.stride(1) == 1,
              "y must be float32 [m, rows], rows contiguous");
  if (m == 0 || rows == 0) return;
  std::vector<const int8_t*> xs(m);
  for (int64_t i = 0; i < m; ++i) xs[i] = xq.data_ptr<int8_t>() + i * xq.stride(0);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0), Kq = K / 4, stride = Kq * 32;
  const int64_t mc = std::max<int64_t>(MT, XBLOCK_BYTES / K / MT * MT);
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
          if (np == 2) tokens<2>(n, wp + p * stride, stride, Kq, xs.data() + i, sp + p * PR, out, ldy, valid);
          else tokens<1>(n, wp + p * stride, stride, Kq, xs.data() + i, sp + p * PR, out, ldy, valid);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "int8_linear needs AVX2, which this build has not");
#endif
}

// w int8 [rows, K] (K % 4 == 0) without -128 -> panels [ceil(rows / 8), K / 4 * 32]: row 8p + j's columns
// 4q..4q+3 at [p][q * 32 + j * 4 ...], rows past the end zero
at::Tensor int8_linear_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "int8_linear_pack takes an int8 [rows, K] weight");
  TORCH_CHECK(!w.eq(-128).any().item<bool>(), "int8_linear_pack: the weight holds -128, whose products with the "
              "activations' magnitudes could saturate VPMADDUBSW's int16 sums");
  TORCH_CHECK(w.size(1) % 4 == 0, "int8_linear_pack takes K a multiple of 4, got ", w.size(1));
  const int64_t rows = w.size(0), K = w.size(1), panels = (rows + PR - 1) / PR, Kq = K / 4;
  at::Tensor packed = at::zeros({panels, Kq * 32}, w.options());
  const at::Tensor wc = w.contiguous();
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* panel = dst + (r / PR) * Kq * 32 + (r % PR) * 4;
      for (int64_t k = 0; k < K; ++k) panel[(k / 4) * 32 + k % 4] = src[r * K + k];
    }
  });
  return packed;
}

bool int8_linear_available() { return has_kernel(); }

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
