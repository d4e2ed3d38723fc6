"""Does fusing the elementwise ops pay on this CPU? The reference table's eager RMSNorm (+ residual
add), RoPE and SwiGLU against the same functions through torch.compile (inductor, dynamic token
count), on Qwen3-0.6B's shapes, fp32, at decode and prefill token counts.

    PYTHONPATH=. python benchmarks/bench_elementwise.py [--threads 2] [--tokens 64,2048] [--reps 10]

Prints the one-time compile seconds (cold; a warm inductor cache makes the next start cheap),
then per op and token count the eager and compiled microseconds, taking turns. A script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers.ops.reference import ReferenceOps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="64,2048")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ref = ReferenceOps()
    hidden, heads, kv_heads, head_dim, inter = 1024, 16, 8, 128, 3072
    w = torch.rand(hidden) + 0.5
    wh = torch.rand(head_dim) + 0.5
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    ops = {
        "add_rms_norm": lambda x, r, *_: ref.add_rms_norm(x, r, w, 1e-6),
        "q/k rms_norm": lambda _x, _r, q, k, *_: (ref.rms_norm(q, wh, 1e-6), ref.rms_norm(k, wh, 1e-6)),
        "rope": lambda _x, _r, q, k, cos, sin, _g: ref.apply_rotary(q, k, cos, sin),
        "silu_and_mul": lambda *args: ref.silu_and_mul(args[-1]),
    }
    compiled = {}
    t0 = time.perf_counter()
    for name, fn in ops.items():
        compiled[name] = torch.compile(fn, dynamic=True)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    first = True
    for t in (int(x) for x in a.tokens.split(",")):
        x, r = torch.randn(t, hidden), torch.randn(t, hidden)
        q, k = torch.randn(t, heads, head_dim), torch.randn(t, kv_heads, head_dim)
        cos, sin = ref.rotary_cos_sin(torch.arange(t), inv_freq, torch.float32)
        g = torch.randn(t, 2 * inter)
        args = (x, r, q, k, cos, sin, g)
        with torch.inference_mode():
            if first:
                for name in ops:
                    compiled[name](*args)
                print(f"compile (cold cache, all ops): {time.perf_counter() - t0:.1f} s")
                first = False
            for name in ops:
                te, tc = [], []
                for _ in range(a.reps + 1):
                    for fn, times in ((ops[name], te), (compiled[name], tc)):
                        s = time.perf_counter()
                        fn(*args)
                        times.append(time.perf_counter() - s)
                e, c = statistics.median(te[1:]) * 1e6, statistics.median(tc[1:]) * 1e6
                print(f"{t:>5} tokens {name:>14}: eager {e:9.0f} us  compiled {c:9.0f} us  eager/compiled {e / c:5.2f}")


if __name__ == "__main__":
    main()
