// AMX tile setup the kernels share (packed_bf16_linear.cpp's bf16 GEMM, int8_dot.h's int8 panels): the process's
// permission to use the tiles and the one configuration they all use, eight tiles of 16 rows x 64 bytes.
#pragma once

#include <cstdint>

namespace raylm::amx {

// Where tile_pair finds x's tiles: the tile of row block r (16 rows) and step s starts at
// data + r * block + s * step (bytes), its 16 rows ld bytes apart.
struct XTiles {
  const char* data;
  int64_t block, step, ld;
};

}  // namespace raylm::amx

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace raylm::amx {

// Linux hands AMX's tile data state to a process only when asked (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); oneDNN asks too, so this is a no-op once it has.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// this thread's tiles 0-7 as 16 rows x 64 bytes each
inline void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// The product instructions tile_pair takes, one per sum tile (sum i of x tile 4 + i / 2 and w tile 6 + i % 2;
// the intrinsics take the tiles' numbers as literals)
#if defined(__AMX_BF16__)
struct DpBF16 {  // bf16 pairs, fp32 sums
  static void p0() { _tile_dpbf16ps(0, 4, 6); }
  static void p1() { _tile_dpbf16ps(1, 4, 7); }
  static void p2() { _tile_dpbf16ps(2, 5, 6); }
  static void p3() { _tile_dpbf16ps(3, 5, 7); }
};
#endif
#if defined(__AMX_INT8__)
struct DpInt8 {  // signed int8 quads, exact int32 sums
  static void p0() { _tile_dpbssd(0, 4, 6); }
  static void p1() { _tile_dpbssd(1, 4, 7); }
  static void p2() { _tile_dpbssd(2, 5, 6); }
  static void p3() { _tile_dpbssd(3, 5, 7); }
};
#endif

// The GEMMs' micro-kernel (packed_bf16_linear.cpp, amx_int8_linear.cpp): the sums of MT row blocks of x
// (from row block r0) against the weight blocks b0 and b1, each step's tile of a block 1 KiB in one piece,
// over `steps` steps, into out [16 * MT, 32] (4-byte sums; tiles 0-3 the sums, 4-5 x, 6-7 w). next_bytes
// of `next` (the following weights, or nullptr) are prefetched into L2, spread over the steps.
template <int MT, typename Dp>
inline void tile_pair(const XTiles& x, int64_t r0, const char* b0, const char* b1, int64_t steps, void* out,
                      const char* next, int64_t next_bytes) {
  _tile_zero(0);
  _tile_zero(1);
  if (MT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t ahead = next ? (next_bytes + steps - 1) / steps : 0;  // bytes of next per step
  const char* x0 = x.data + r0 * x.block;
  for (int64_t s = 0; s < steps; ++s) {
    if (next)
      for (int64_t b = s * ahead; b < std::min(next_bytes, (s + 1) * ahead); b += 64)
        _mm_prefetch(next + b, _MM_HINT_T1);
    _tile_loadd(4, x0 + s * x.step, x.ld);
    _tile_loadd(6, b0 + s * 1024, 64);
    _tile_loadd(7, b1 + s * 1024, 64);
    Dp::p0();
    Dp::p1();
    if (MT == 2) {
      _tile_loadd(5, x0 + x.block + s * x.step, x.ld);
      Dp::p2();
      Dp::p3();
    }
  }
  char* o = static_cast<char*>(out);
  _tile_stored(0, o, 128);
  _tile_stored(1, o + 64, 128);
  if (MT == 2) {
    _tile_stored(2, o + 16 * 128, 128);
    _tile_stored(3, o + 16 * 128 + 64, 128);
  }
}

// tile_pair over the 32 rows of x from row r0 (16 where `two` is false), with share `part` of `parts` of
// the next pair's `pair_bytes` prefetched: a pair's row blocks split its successor's reads between them,
// so the reads go on while the last block computes (when the first issued them all, at 64 rows the
// second block's products hid none of them).
template <typename Dp>
inline int tile_rows(const XTiles& x, int64_t r0, bool two, const char* b0, int64_t block_bytes, int64_t steps,
                     void* out, const char* next, int64_t pair_bytes, int64_t part, int64_t parts) {
  const int64_t from = part * pair_bytes / parts / 64 * 64, to = (part + 1) * pair_bytes / parts / 64 * 64;
  const char* slice = next ? next + from : nullptr;
  if (two)
    tile_pair<2, Dp>(x, r0 / 16, b0, b0 + block_bytes, steps, out, slice, to - from);
  else
    tile_pair<1, Dp>(x, r0 / 16, b0, b0 + block_bytes, steps, out, slice, to - from);
  return two ? 2 : 1;
}

}  // namespace raylm::amx
#endif
