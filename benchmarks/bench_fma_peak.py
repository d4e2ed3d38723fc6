"""This CPU's arithmetic peaks: what no GEMM (and no engine) can beat.

    python benchmarks/bench_fma_peak.py [--seconds 2] [--kinds fp32,bf16,int8,amx-bf16,amx-int8]

Compiles a loop of independent vector multiply-adds with the system C++ compiler and runs it on
1..nproc threads, printing the rate for each kind this CPU has:
- fp32: FMAs, the widest vectors `-march=native` gives (AVX-512 where __AVX512F__, else AVX2);
  2 flops a lane;
- bf16: AVX512-BF16's vdpbf16ps (two bf16 products summed into each fp32 lane: 4 flops a lane),
  what a bf16 GEMM without AMX runs on;
- int8: AVX512-VNNI's vpdpbusd (four u8 x s8 products into each int32 lane: 8 ops a lane), what
  an int8 GEMM without AMX runs on;
- amx-bf16, amx-int8: AMX's tile products (TDPBF16PS, TDPBSSD) on four accumulator tiles whose
  operands stay in tiles, what raylm's and oneDNN's bf16 / int8 GEMMs and the prefill attention run on
  where the CPU has AMX (a Xeon since Sapphire Rapids).
bench_gemm.py's best rate divided by the matching peak is how close the packed GEMMs already are
to the machine; docs/benchmarks.md uses these to bound what any engine can reach on a workload of
known linear work (profile_ops.py prints the TFLOP). A kind the CPU lacks is skipped with a line
saying so. A script, not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

SOURCE = r"""
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#ifdef __AVX512F__
constexpr int W = 64;
#else
constexpr int W = 32;
#endif
typedef float vec __attribute__((vector_size(W)));
constexpr int CHAINS = 12;  // independent accumulators: more than latency x pipes on any x86 core

// one pass of CHAINS independent multiply-adds; returns ops per pass per thread
static double fp32(long iters, float* sink) {
  vec a[CHAINS], b, c;
  for (int i = 0; i < W / 4; ++i) { b[i] = 0.999999f; c[i] = 1e-7f; }
  for (int k = 0; k < CHAINS; ++k) for (int i = 0; i < W / 4; ++i) a[k][i] = 1.0f + k * 1e-7f;
  for (long n = 0; n < iters; ++n) {
    _Pragma("GCC unroll 12") for (int k = 0; k < CHAINS; ++k) a[k] = a[k] * b + c;
  }
  for (int k = 0; k < CHAINS; ++k) *sink += a[k][0];
  return 2.0 * CHAINS * (W / 4);
}

#ifdef __AVX512BF16__
static double bf16(long iters, float* sink) {
  __m512 a[CHAINS];
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3380);
  for (int k = 0; k < CHAINS; ++k) a[k] = _mm512_set1_ps(1.0f + k);
  for (long n = 0; n < iters; ++n) {
    _Pragma("GCC unroll 12") for (int k = 0; k < CHAINS; ++k) a[k] = _mm512_dpbf16_ps(a[k], x, y);
  }
  for (int k = 0; k < CHAINS; ++k) *sink += _mm512_reduce_add_ps(a[k]);
  return 4.0 * CHAINS * 16;
}
#endif

#ifdef __AVX512VNNI__
static double int8(long iters, float* sink) {
  __m512i a[CHAINS];
  const __m512i x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(-1);
  for (int k = 0; k < CHAINS; ++k) a[k] = _mm512_set1_epi32(k);
  for (long n = 0; n < iters; ++n) {
    _Pragma("GCC unroll 12") for (int k = 0; k < CHAINS; ++k) a[k] = _mm512_dpbusd_epi32(a[k], x, y);
  }
  for (int k = 0; k < CHAINS; ++k) *sink += (float)_mm512_reduce_add_epi32(a[k]);
  return 8.0 * CHAINS * 16;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
// four independent 16 x 16 accumulator tiles against two A and two B tiles (a GEMM's 2 x 2 block, its
// operands never reloaded): what the tile unit itself does
struct alignas(64) TileConfig {
  unsigned char palette = 1, start_row = 0, reserved[14] = {};
  unsigned short colsb[16] = {};
  unsigned char rows[16] = {};
};
static void tiles_on() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
  _tile_loadconfig(&c);
  alignas(64) static thread_local unsigned char zero[1024] = {};
  _tile_loadd(4, zero, 64); _tile_loadd(5, zero, 64); _tile_loadd(6, zero, 64); _tile_loadd(7, zero, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
}
// INT8: TDPBSSD (64 int8 products per output), else TDPBF16PS (32 bf16 products)
template <bool INT8>
static double amx(long iters, float* sink) {
  tiles_on();
  for (long n = 0; n < iters; ++n) {
    if constexpr (INT8) {
      _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float out[256];
  _tile_stored(0, out, 64);
  _tile_release();
  *sink += out[0];
  return 4.0 * 16 * 16 * (INT8 ? 64 : 32) * 2;  // four tile products of 16 x 16 outputs
}
#endif

int main(int argc, char** argv) {
  const char* kind = argv[1];
  int threads = atoi(argv[2]);
  long iters = atol(argv[3]);
  double (*fn)(long, float*) = nullptr;
  int bits = W * 8;
  if (!strcmp(kind, "fp32")) fn = fp32;
#ifdef __AVX512BF16__
  if (!strcmp(kind, "bf16")) { fn = bf16; bits = 512; }
#endif
#ifdef __AVX512VNNI__
  if (!strcmp(kind, "int8")) { fn = int8; bits = 512; }
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  if (!strcmp(kind, "amx-bf16") || !strcmp(kind, "amx-int8")) {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;  // Linux grants the tiles when asked
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 2;
    fn = kind[4] == 'b' ? amx<false> : amx<true>;
    bits = 0;  // tiles, not vectors
  }
#endif
  if (!fn) return 2;  // this build (this CPU) has no such instruction
  std::vector<std::thread> ts;
  std::vector<float> sink(threads);
  std::vector<double> per(threads);
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { per[t] = fn(iters, &sink[t]); });
  for (auto& t : ts) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double ops = per[0] * threads * iters;
  printf("%d %.3f %.6f %d\n", threads, ops / s / 1e9, s, bits);
  return sink[0] == 12345.0f;  // keeps the loops alive
}
"""


KINDS = {"fp32": "fp32 FMA peak", "bf16": "bf16 dot-product peak (vdpbf16ps)",
         "int8": "int8 dot-product peak (vpdpbusd), Gop/s", "amx-bf16": "bf16 tile peak (AMX TDPBF16PS)",
         "amx-int8": "int8 tile peak (AMX TDPBSSD), Gop/s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="about how long each thread count runs")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    for k in kinds:
        if k not in KINDS:
            ap.error(f"--kinds: unknown kind {k!r} (one of {', '.join(KINDS)})")
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "fma.cpp"), os.path.join(d, "fma")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([a.cxx, "-O3", "-march=native", "-ffp-contract=fast", "-pthread", src, "-o", exe], check=True)
        for kind in kinds:
            probe = subprocess.run([exe, kind, "1", "10000000"], capture_output=True, text=True)
            if probe.returncode == 2:
                print(f"# {KINDS[kind]}: this CPU (its -march=native) has no such instruction")
                continue
            if probe.returncode not in (0, 1):  # 1 is the sink's value, not a failure
                raise RuntimeError(f"{kind}: the probe failed: {probe.stderr}")
            first = probe.stdout.split()
            iters = max(1, int(10_000_000 * a.seconds / max(float(first[2]), 1e-6)))
            width = "16 x 64-byte tiles" if first[3] == "0" else f"{first[3]}-bit vectors"
            print(f"# {KINDS[kind]}, {width}, {os.cpu_count()} logical CPUs")
            for threads in range(1, (os.cpu_count() or 1) + 1):
                out = subprocess.run([exe, kind, str(threads), str(iters)], capture_output=True, text=True)
                if out.returncode not in (0, 1):
                    raise RuntimeError(f"{kind} on {threads} thread(s) failed: {out.stderr}")
                _, gflops, seconds, _ = out.stdout.split()
                unit = "Gop/s" if kind.endswith("int8") else "GF/s"
                print(f"{threads} thread(s): {float(gflops):7.1f} {unit}  ({float(seconds):.2f} s)")


if __name__ == "__main__":
    main()
