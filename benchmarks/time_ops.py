"""raylm's bare step loop with its linear and attention calls timed by the wall clock: where a step's
time goes without the profiler (torch.profiler with record_shapes inflated a 2,048-row GEMM's self
time several-fold on a 2-core Xeon, for raylm and vLLM alike, so its by-op tables mislead there).

    PYTHONPATH=. python benchmarks/time_ops.py --checkpoint DIR [the kernels workload's options]

One untimed round (kernel choices, caches, the heap), then a timed one: seconds per op table linear
by (rows, output features), the lm_head's fused argmax, attention by the step's kind (decode rows
only / with prefill chunks / prefill only), the K/V writes and the fused norms, RoPE and SwiGLU,
the costliest first, and what is left of the step loop. The CPU op table's default attention (the
paged backend) is the one timed. A script, not a test.
"""

from __future__ import annotations

import argparse
import collections
import time

from cluster.bench.command import add_kernels_workload_args
from cluster.bench.contenders import EngineSpec, run_bare
from cluster.bench.vllm_peer import peer_dtype, save_checkpoint
from cluster.bench.workload import kv_blocks_for, make_workload
from workers.loader import load_config, load_model
from workers.ops import cpu as cpu_ops
from workers.ops import cpu_attention


class StepClock:
    """The step loop's wall time (run_bare enters it around the steps alone)."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_kernels_workload_args(ap)
    ap.add_argument("--top", type=int, default=16)
    a = ap.parse_args()
    save_checkpoint(a.model, a.checkpoint)
    wl = make_workload(a.num_requests, a.input_len, a.output_len, load_config(a.checkpoint).vocab_size, a.seed)
    dtype = peer_dtype()
    spec = EngineSpec(a.checkpoint, dtype, 1, a.threads, True, a.batch_size, 16, kv_blocks_for(wl, 16),
                      a.max_num_batched_tokens, a.seed)
    model = load_model(a.checkpoint, dtype)
    print(f"# {a.checkpoint}: {wl.describe()}; computes {dtype}", flush=True)
    fig, _ = run_bare(model, spec, wl)
    print(f"untimed round: {fig['output_tok_s']:.2f} output tok/s", flush=True)

    spent = collections.defaultdict(lambda: [0, 0.0])  # what -> [calls, seconds]

    depth = [0]  # an op called inside a timed one (the lm_head's linear) counts as part of it

    def timer(cls, name, label):
        original = getattr(cls, name)

        def timed(self, *args, **kwargs):
            depth[0] += 1
            t = time.perf_counter()
            try:
                out = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                entry = spent[label(args, out)]
                entry[0] += 1
                entry[1] += time.perf_counter() - t
            return out

        return cls, name, original, timed

    def rows(x):
        return x.reshape(-1, x.shape[-1]).shape[0]

    def phase(x):  # x's first dimension is the step's tokens
        return "decode" if x.shape[0] <= a.batch_size else "prefill"

    def step_kind(meta, q):
        return ("decode rows only" if meta.num_decode == q.shape[0] else
                "prefill chunks only" if meta.num_decode == 0 else "decode rows + prefill chunks")

    timers = [
        timer(cpu_ops.CPUOps, "linear", lambda a, y: f"linear {rows(a[0])} rows -> {y.shape[-1]}"),
        timer(cpu_ops.CPUOps, "linear_argmax", lambda a, y: f"lm_head + argmax ({phase(a[0])})"),
        timer(cpu_attention.PagedAttention, "forward", lambda a, y: f"attention, {step_kind(a[5], a[0])}"),
        timer(cpu_attention.PagedAttention, "write_kv", lambda a, y: "K/V written to the pool"),
    ] + [timer(cpu_ops.CPUOps, name, lambda a, y, name=name: f"{name} ({phase(a[0])})")
         for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "silu_and_mul")]
    steps = StepClock()
    for cls, name, _, timed in timers:
        setattr(cls, name, timed)
    try:
        fig, _ = run_bare(model, spec, wl, around_steps=steps)
    finally:
        for cls, name, original, _ in timers:
            setattr(cls, name, original)
    wall = steps.seconds
    print(f"timed round: {fig['output_tok_s']:.2f} output tok/s, its step loop {wall:.2f} s\n")
    print(f"{'op':<48} {'calls':>6} {'s':>7} {'ms/call':>8} {'%':>5}")
    for what, (calls, secs) in sorted(spent.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"{what:<48} {calls:>6} {secs:>7.3f} {secs / calls * 1e3:>8.3f} {100 * secs / wall:>5.1f}")
    linear_s = sum(s for w, (_, s) in spent.items() if w.startswith("linear"))
    attention_s = sum(s for w, (_, s) in spent.items() if w.startswith("attention"))
    timed_s = sum(s for _, s in spent.values())
    print(f"\nlinear {linear_s:.2f} s, attention {attention_s:.2f} s, all timed ops {timed_s:.2f} s, "
          f"the rest (sampling, embedding, copies, the scheduler, Python) {wall - timed_s:.2f} s")


if __name__ == "__main__":
    main()
