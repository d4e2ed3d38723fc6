// W8A8's dense linear on AMX-INT8 tiles, its epilogue fused: y [m, n] = (xq [m, K] @ w [n, K]^T) as exact
// int32 sums, then in fp32 sum * col_scale[j] * row_scale[i] + bias[j] (each factor where given, in that
// order: the order oneDNN's per-channel scale and scale_rows apply them on the unfused path), rounded once to
// y's dtype (fp32, bf16 or fp16).
//
// oneDNN's quantized inner product can apply only per-channel scales, so the unfused path writes an fp32
// [m, n] product and reads it back to apply the per-token ones: at a prefill chunk's 2,048 rows that
// intermediate is 4 bytes an output, more memory traffic than the int8 GEMM's own. Here each 32 x 32 block
// of sums leaves the tiles, is scaled and rounded while in L1, and is written once at the output's width.
//
// The weight is packed once (amx_int8_pack) into TDPBSSD's second-operand layout: [blocks of 16 rows,
// K / 4 quads, 16 rows x 4 values], so a 16-row x 64-column tile of w is 1 KiB in one piece. Work is
// packed_bf16_linear.cpp's: threads take pairs of 16-row weight blocks; for each, every 32 rows of x (held
// in L2 by blocks of rows) run the K loop on 2 x 2 accumulator tiles; the next pair is prefetched, spread
// over the row blocks.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "huge_pages.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define RAYLM_AMX_INT8_LINEAR 1
#include <immintrin.h>

#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t TN = 16;  // rows of w a block takes (a tile's columns of output)
constexpr int64_t TK = 64;  // columns of x and w a tile takes (16 quads)
constexpr int64_t XBLOCK_BYTES = 512 * 1024;  // x a block of rows may take (a quarter of a 2 MiB L2)

#ifdef RAYLM_AMX_INT8_LINEAR

enum class Out { F32, BF16, F16 };

// the first `cols` (up to 16) scaled sums of one row, into y
inline void finish16(const int32_t* s, const float* cs, float rs, const float* bias, int64_t cols, Out kind,
                     void* y) {
  const __mmask16 k = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(s)), _mm512_maskz_loadu_ps(k, cs));
  if (rs != 1.f) v = _mm512_mul_ps(v, _mm512_set1_ps(rs));
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias));
  switch (kind) {
    case Out::F32: _mm512_mask_storeu_ps(y, k, v); break;
    case Out::BF16: _mm256_mask_storeu_epi16(y, k, (__m256i)_mm512_cvtneps_pbh(v)); break;
    case Out::F16:
      _mm256_mask_storeu_epi16(y, k, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

#endif  // RAYLM_AMX_INT8_LINEAR

bool amx_int8_linear_available() {
#ifdef RAYLM_AMX_INT8_LINEAR
  return raylm::amx::permitted();
#else
  return false;
#endif
}

// w [n, K] int8 (K a multiple of 64) -> [blocks, K / 4, 64]: block b holds rows 16b..16b+15 (zeros past n;
// an even number of blocks), w[16b + j, 4q + r] at [b, q, 4j + r]
at::Tensor amx_int8_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "amx_int8_pack takes a 2-d int8 weight");
  const int64_t rows = w.size(0), K = w.size(1);
  TORCH_CHECK(K % TK == 0, "amx_int8_pack needs a width that is a multiple of ", TK, ", got ", K);
  const int64_t blocks = (rows + 2 * TN - 1) / (2 * TN) * 2, quads = K / 4;
  at::Tensor packed = at::empty({blocks, quads, 4 * TN}, w.options());
  raylm::advise_huge_pages(packed.data_ptr(), packed.nbytes());  // before the pages are first written
  const at::Tensor wc = w.contiguous();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(wc.data_ptr<int8_t>());  // a quad as one word
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int8_t>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t j = 0; j < TN; ++j) {
        const int64_t r = b * TN + j;
        uint32_t* d = dst + b * quads * TN + j;
        for (int64_t q = 0; q < quads; ++q) d[q * TN] = r < rows ? src[r * quads + q] : 0;
      }
  });
  return packed;
}

// y [m, >= n] (fp32, bf16 or fp16; rows contiguous): its first n = y.size(1) columns as the header says
void amx_int8_linear(at::Tensor y, at::Tensor xq, at::Tensor packed, at::Tensor col_scale,
                     std::optional<at::Tensor> row_scale, std::optional<at::Tensor> bias) {
#ifdef RAYLM_AMX_INT8_LINEAR
  TORCH_CHECK(raylm::amx::permitted(), "this process may not use AMX tiles (arch_prctl refused)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 4 * TN && packed.size(0) % 2 == 0 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kChar,
              "the weight must be packed by amx_int8_pack");
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.stride(1) == 1,
              "xq must be a 2-d int8 tensor with contiguous rows");
  const int64_t m = xq.size(0), K = xq.size(1), n = y.size(1);
  TORCH_CHECK(packed.size(1) * 4 == K, "the weight must be packed for xq's width");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == m && n <= packed.size(0) * TN,
              "y must be [xq rows, at most the weight's rows] with contiguous rows");
  const Out kind = y.scalar_type() == at::kFloat ? Out::F32 : y.scalar_type() == at::kBFloat16 ? Out::BF16 : Out::F16;
  TORCH_CHECK(kind != Out::F16 || y.scalar_type() == at::kHalf, "y must be float32, bfloat16 or float16");
  auto check_vec = [](const at::Tensor& t, int64_t len, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.scalar_type() == at::kFloat && t.size(0) >= len, what,
                " must be a contiguous float32 vector of at least ", len);
  };
  check_vec(col_scale, n, "col_scale");
  if (row_scale) check_vec(*row_scale, m, "row_scale");
  if (bias) check_vec(*bias, n, "bias");
  if (m == 0 || n == 0) return;
  // x's rows padded with zeros to a multiple of 16 (a tile's rows)
  const int64_t mp = (m + 15) / 16 * 16;
  at::Tensor held;
  const int8_t* xp = xq.data_ptr<int8_t>();
  int64_t ldx = xq.stride(0);
  if (mp != m) {
    held = at::zeros({mp, K}, xq.options());
    held.narrow(0, 0, m).copy_(xq);
    xp = held.data_ptr<int8_t>();
    ldx = K;
  }
  const raylm::amx::XTiles x{reinterpret_cast<const char*>(xp), 16 * ldx, TK, ldx};
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* cs = col_scale.data_ptr<float>();
  const float* rs = row_scale ? row_scale->data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t ldy = y.stride(0) * y.element_size(), out_bytes = y.element_size();
  const int64_t block_bytes = K * TN, pair_bytes = 2 * block_bytes;
  const int64_t pairs = (n + 2 * TN - 1) / (2 * TN);
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, pairs / at::get_num_threads()));
  const int64_t mc = std::max<int64_t>(32, XBLOCK_BYTES / K / 32 * 32);  // rows of x a block takes
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    raylm::amx::configure();
    alignas(64) int32_t sums[32 * 2 * TN];
    for (int64_t m0 = 0; m0 < mp; m0 += mc) {
      const int64_t m1 = std::min(mp, m0 + mc), row_blocks = (m1 - m0 + 31) / 32;
      for (int64_t p = begin; p < end; ++p) {
        const int8_t* b0 = wp + p * pair_bytes;
        const char* next = p + 1 < end ? reinterpret_cast<const char*>(b0 + pair_bytes) : nullptr;
        const int64_t j0 = p * 2 * TN, cols = std::min<int64_t>(2 * TN, n - j0);
        for (int64_t i0 = m0; i0 < m1; i0 += 32) {
          const int mt = raylm::amx::tile_rows<raylm::amx::DpInt8>(x, i0, i0 + 32 <= m1, reinterpret_cast<const char*>(b0),
                                                                   block_bytes, K / TK, sums, next, pair_bytes,
                                                                   (i0 - m0) / 32, row_blocks);
          for (int64_t i = i0; i < std::min(m, i0 + 16 * mt); ++i) {
            const int32_t* s = sums + (i - i0) * 2 * TN;
            char* yrow = yp + i * ldy + j0 * out_bytes;
            const float r = rs ? rs[i] : 1.f;
            for (int64_t j = 0; j < cols; j += 16)
              finish16(s + j, cs + j0 + j, r, bp ? bp + j0 + j : nullptr, cols - j, kind, yrow + j * out_bytes);
          }
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "raylm's AMX-INT8 linear was not built for this CPU (no AMX-INT8)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("amx_int8_linear_available() -> bool", &amx_int8_linear_available);
  m.def("amx_int8_pack(Tensor w) -> Tensor");
  m.def("amx_int8_linear(Tensor(a!) y, Tensor xq, Tensor packed, Tensor col_scale, Tensor? row_scale=None, "
        "Tensor? bias=None) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("amx_int8_pack", &amx_int8_pack);
  m.impl("amx_int8_linear", &amx_int8_linear);
}
