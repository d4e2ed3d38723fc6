// AMX tile setup the kernels share (packed_bf16_linear.cpp's bf16 GEMM, int8_dot.h's int8 panels): the process's
// permission to use the tiles and the one configuration they all use, eight tiles of 16 rows x 64 bytes.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

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

}  // namespace raylm::amx
#endif
