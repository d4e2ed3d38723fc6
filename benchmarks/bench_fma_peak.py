"""This CPU's arithmetic peaks: what no GEMM (and no engine) can beat.

    python benchmarks/bench_fma_peak.py [--seconds 2] [--kinds fp32,bf16,int8]

Compiles a loop of independent vector multiply-adds with the system C++ compiler and runs it on
1..nproc threads, printing the rate for each kind this CPU has:
- fp32: FMAs, the widest vectors `-march=native` gives (AVX-512 where __AVX512F__, else AVX2);
  2 flops a lane;
- bf16: AVX512-BF16's vdpbf16ps (two bf16 products summed into each fp32 lane: 4 flops a lane),
  what a bf16 GEMM without AMX runs on;
- int8: AVX512-VNNI's vpdpbusd (four u8 x s8 products into each int32 lane: 8 ops a lane), what
  an int8 GEMM without AMX runs on.
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
         "int8": "int8 dot-product peak (vpdpbusd), Gop/s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="about how long each thread count runs")
    ap.add_argument("--kinds", default="fp32,bf16,int8", help="comma-separated: " + ", ".join(KINDS))
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
            print(f"# {KINDS[kind]}, {first[3]}-bit vectors, {os.cpu_count()} logical CPUs")
            for threads in range(1, (os.cpu_count() or 1) + 1):
                out = subprocess.run([exe, kind, str(threads), str(iters)], capture_output=True, text=True)
                _, gflops, seconds, _ = out.stdout.split()
                unit = "Gop/s" if kind == "int8" else "GF/s"
                print(f"{threads} thread(s): {float(gflops):7.1f} {unit}  ({float(seconds):.2f} s)")


if __name__ == "__main__":
    main()
