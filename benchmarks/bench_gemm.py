"""How fast torch's linear is here, per dtype: the kernel every contender's step rests on.

    PYTHONPATH=. python benchmarks/bench_gemm.py [--threads 2] [--rows 1,64,2048]
    PYTHONPATH=. python benchmarks/bench_gemm.py --packed [--dtype bfloat16]
    PYTHONPATH=. python benchmarks/bench_gemm.py --int8 [--dtype bfloat16]

For Qwen3-0.6B's MLP up-projection shape (in 1024, out 3072) and its lm_head (in 1024,
out 151936), times F.linear on bf16 weights and inputs, on fp32 ones, and on bf16 ones
upcast to fp32 for the call (weights converted on every call, result cast back to bf16:
the same products and fp32 accumulation as a bf16 GEMM, through the fp32 kernel). Prints
milliseconds and GFLOP/s. With --packed, the CPU op table's paths on one Qwen3-0.6B layer's
fused shapes and its lm_head, in fp32 or (--dtype bfloat16, where the CPU has AVX512-BF16 / AMX)
in bf16. With --int8, the CPU op table's W8A8 linear (activations quantized per token, the int8
GEMM it measured fastest, the scales applied) against its float linear on the same shapes, as a
worker runs them (freed memory kept in the heap). A script, not a test.
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
    ap.add_argument("--packed", action="store_true",
                    help="F.linear against MKL's (fp32 only) and oneDNN's packed weights (the CPU op table's "
                         "paths), taking turns per repetition, on the fused shapes of one Qwen3-0.6B layer; "
                         "best-of rates, and the best of all")
    ap.add_argument("--int8", action="store_true", help="the op table's W8A8 linear against its float one")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="with --packed / --int8")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.packed:
        return packed(a)
    if a.int8:
        return int8(a)
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


def packed(a) -> None:
    from workers.ops.cpu_features import cpu_class, has_mkl_packed_linear, has_onednn_packed_linear

    dtype = getattr(torch, a.dtype)
    mkl, dnn = has_mkl_packed_linear() and dtype == torch.float32, has_onednn_packed_linear()
    print(f"# {a.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}, cpu class {cpu_class()}, "
          f"mkl packed op: {mkl}, onednn packed op: {dnn}")
    print(f"{'shape':>22} {'F.linear GF/s':>14} {'mkl-packed GF/s':>16} {'onednn-packed GF/s':>19}")
    g = torch.Generator().manual_seed(0)
    best = (0.0, "")
    # qkv (fused), o, gate_up (fused), down, lm_head
    for out_features, in_features in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)):
        w = (torch.randn(out_features, in_features, generator=g) * 0.02).to(dtype)
        pw = torch.ops.mkl._mkl_reorder_linear_weight(w, 64) if mkl else None
        dw = torch.ops.mkldnn._reorder_linear_weight(w, 64) if dnn else None
        for m in (int(r) for r in a.rows.split(",")):
            if out_features > 100_000 and m > 64:
                continue
            x = torch.randn(m, in_features, generator=g).to(dtype)
            paths = {"aten": lambda x=x, w=w: F.linear(x, w)}
            if pw is not None:
                paths["mkl"] = lambda x=x, w=w, pw=pw: torch.ops.mkl._mkl_linear(x, pw, w, None, 64)
            if dw is not None:
                paths["onednn"] = lambda x=x, dw=dw: torch.ops.mkldnn._linear_pointwise(x, dw, None, "none", [], "")
            times = {name: [] for name in paths}
            for _ in range(a.reps + 1):  # taking turns, so load hits every path alike
                for name, fn in paths.items():
                    times[name].append(timed(fn, 1))
            flop = 2 * m * in_features * out_features
            rate = {name: flop / min(t[1:]) / 1e9 for name, t in times.items()}  # best of: the machine's rate
            shape = f"{m}x{in_features} @ {in_features}x{out_features}"
            for name, r in rate.items():
                best = max(best, (r, f"{name} {shape}"))
            print(f"{shape:>22} {rate['aten']:>14.1f} {rate.get('mkl', float('nan')):>16.1f} "
                  f"{rate.get('onednn', float('nan')):>19.1f}")
    print(f"best {a.dtype} rate: {best[0]:.1f} GF/s ({best[1]})")


def int8(a) -> None:
    from workers.device import keep_host_heap
    from workers.ops import get_op_table
    from workers.ops.cpu_features import cpu_class
    from workers.quant.weights import quantize_int8

    keep_host_heap()
    dtype = getattr(torch, a.dtype)
    ops = get_op_table("cpu", "cpu")
    print(f"# {a.dtype} activations, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu class {cpu_class()}")
    print(f"{'shape':>22} {'float ms':>9} {'w8a8 ms':>9} {'float GF/s':>11} {'w8a8 G MAC/s':>13} {'w8a8 path':>22}")
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        w = (torch.randn(out_features, in_features, generator=g) * 0.02).to(dtype)
        dense = ops.prepare_linear(w, None)
        quant = ops.prepare_quantized_linear(quantize_int8(w), None, dtype=dtype)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, in_features, generator=g).to(dtype)
            times = {"float": [], "w8a8": []}
            for _ in range(a.reps + 1):  # taking turns
                times["float"].append(timed(lambda x=x, h=dense: ops.linear(x, h), 1))
                times["w8a8"].append(timed(lambda x=x, h=quant: ops.linear(x, h), 1))
            tf, tq = min(times["float"][1:]), min(times["w8a8"][1:])
            macs = m * in_features * out_features
            shape = f"{m}x{in_features} @ {in_features}x{out_features}"
            print(f"{shape:>22} {tf * 1e3:>9.3f} {tq * 1e3:>9.3f} {2 * macs / tf / 1e9:>11.1f} "
                  f"{macs / tq / 1e9:>13.1f} {quant.path:>22}")


if __name__ == "__main__":
    main()
