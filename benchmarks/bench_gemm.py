"""How fast torch's linear is here, per dtype: the kernel every contender's step rests on.

    PYTHONPATH=. python benchmarks/bench_gemm.py [--threads 2] [--rows 1,64,2048]

For Qwen3-0.6B's MLP up-projection shape (in 1024, out 3072) and its lm_head (in 1024,
out 151936), times F.linear on bf16 weights and inputs, on fp32 ones, and on bf16 ones
upcast to fp32 for the call (weights converted on every call, result cast back to bf16:
the same products and fp32 accumulation as a bf16 GEMM, through the fp32 kernel). Prints
milliseconds and GFLOP/s. A script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,64,2048")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"{'shape':>22} {'bf16 ms':>9} {'fp32 ms':>9} {'bf16->fp32 ms':>14} {'bf16 GF/s':>10} {'fp32 GF/s':>10} "
          f"{'upcast GF/s':>12}")
    g = torch.Generator().manual_seed(0)
    for out_features in (3072, 151936):
        w32 = torch.randn(out_features, 1024, generator=g) * 0.02
        w16 = w32.bfloat16()
        for m in (int(r) for r in a.rows.split(",")):
            if out_features > 100_000 and m > 64:
                continue  # the lm_head only sees sampling rows
            x32 = torch.randn(m, 1024, generator=g)
            x16 = x32.bfloat16()
            t16 = timed(lambda x=x16, w=w16: F.linear(x, w), a.reps)
            t32 = timed(lambda x=x32, w=w32: F.linear(x, w), a.reps)
            tup = timed(lambda x=x16, w=w16: F.linear(x.float(), w.float()).bfloat16(), a.reps)
            flop = 2 * m * 1024 * out_features
            print(f"{f'{m}x1024 @ 1024x{out_features}':>22} {t16 * 1e3:>9.1f} {t32 * 1e3:>9.1f} {tup * 1e3:>14.1f} "
                  f"{flop / t16 / 1e9:>10.1f} {flop / t32 / 1e9:>10.1f} {flop / tup / 1e9:>12.1f}")


if __name__ == "__main__":
    main()
