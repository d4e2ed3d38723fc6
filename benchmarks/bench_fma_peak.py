"""This CPU's fp32 FMA peak: what no GEMM (and no engine) can beat.

    python benchmarks/bench_fma_peak.py [--seconds 2]

Compiles a loop of independent vector FMAs (the widest the CPU has: AVX-512 where
`-march=native` defines __AVX512F__, else AVX2) with the system C++ compiler, runs it on
1..nproc threads and prints GF/s. bench_gemm.py's best rate divided by this is how close the
packed GEMMs already are to the machine; docs/benchmarks.md uses it to bound what any fp32
engine can reach on a workload of known linear work (profile_ops.py prints the TFLOP).
A script, not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

SOURCE = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#ifdef __AVX512F__
constexpr int W = 64;
#else
constexpr int W = 32;
#endif
typedef float vec __attribute__((vector_size(W)));
constexpr int CHAINS = 12;  // independent accumulators: more than FMA latency x pipes on any x86 core

static float chain(long iters) {
  vec a[CHAINS], b, c;
  for (int i = 0; i < W / 4; ++i) { b[i] = 0.999999f; c[i] = 1e-7f; }
  for (int k = 0; k < CHAINS; ++k) for (int i = 0; i < W / 4; ++i) a[k][i] = 1.0f + k * 1e-7f;
  for (long n = 0; n < iters; ++n) {
    _Pragma("GCC unroll 12") for (int k = 0; k < CHAINS; ++k) a[k] = a[k] * b + c;
  }
  float s = 0;
  for (int k = 0; k < CHAINS; ++k) s += a[k][0];
  return s;
}

int main(int argc, char** argv) {
  int threads = atoi(argv[1]);
  long iters = atol(argv[2]);
  std::vector<std::thread> ts;
  std::vector<float> sink(threads);
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { sink[t] = chain(iters); });
  for (auto& t : ts) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double flops = 2.0 * threads * iters * CHAINS * (W / 4);
  printf("%d %.3f %.6f %d\n", threads, flops / s / 1e9, s, W * 8);
  return sink[0] == 12345.0f;  // keeps the loop alive
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="about how long each thread count runs")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "fma.cpp"), os.path.join(d, "fma")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([a.cxx, "-O3", "-march=native", "-ffp-contract=fast", "-pthread", src, "-o", exe], check=True)
        probe = subprocess.run([exe, "1", "10000000"], capture_output=True, text=True, check=True).stdout.split()
        iters = max(1, int(10_000_000 * a.seconds / max(float(probe[2]), 1e-6)))
        print(f"# fp32 FMA peak, {probe[3]}-bit vectors, {os.cpu_count()} logical CPUs")
        for threads in range(1, (os.cpu_count() or 1) + 1):
            out = subprocess.run([exe, str(threads), str(iters)], capture_output=True, text=True, check=True)
            _, gflops, seconds, _ = out.stdout.split()
            print(f"{threads} thread(s): {float(gflops):7.1f} GF/s  ({float(seconds):.2f} s)")


if __name__ == "__main__":
    main()
