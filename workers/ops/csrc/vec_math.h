// Small float math the kernels share, written as plain loops the compiler vectorizes
// (-O3 -march=native: one AVX2 / AVX-512 lane per element), and how each float dtype a kernel
// reads is stored.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace raylm {

// An element type as stored: T its storage, widen() to fp32, narrow() back (round to nearest
// even, as torch's conversions).
struct F32 {
  using T = float;
  static float widen(float x) { return x; }
  static float narrow(float x) { return x; }
};
struct BF16 {  // bf16 is fp32's top half
  using T = uint16_t;
  static float widen(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  static uint16_t narrow(float x) { return c10::BFloat16(x).x; }
};
struct F16 {
  using T = uint16_t;
  static float widen(uint16_t x) { return c10::detail::fp16_ieee_to_fp32_value(x); }
  static uint16_t narrow(float x) { return c10::detail::fp16_ieee_from_fp32_value(x); }
};

// exp(x) in float32 within ~2 ulp over the range that does not overflow: x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 split in two for an exact product), a degree-6 polynomial for e^r, 2^n
// put into the exponent bits. Branch-free, so a loop of it vectorizes (std::exp does not).
inline float fast_exp(float x) {
  // 2^n stays a normal float. min / max, not a ternary: GCC split the ternary's constant arms into
  // separate lanes' results computed for every lane, and a caller's g / (1 + e^88.3) then made
  // denormals in each vector (microcode assists on Intel: silu * up ran 10x slower)
  x = std::max(-87.33f, std::min(x, 88.3f));
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// round half to even, then to int8's range, in a form that vectorizes (libm's nearbyint is a call
// per element): v limited to [-256, 256] (beyond, the result clamps the same), then 1.5 * 2^23 added
// and taken away, which rounds to an integer in the current (nearest-even) mode
inline int8_t round_to_int8(float v) {
  constexpr float kMagic = 12582912.f;
  v = std::min(256.f, std::max(-256.f, v));
  const float r = (v + kMagic) - kMagic;
  return static_cast<int8_t>(static_cast<int>(std::min(127.f, std::max(-128.f, r))));
}

}  // namespace raylm
