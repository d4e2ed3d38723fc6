"""Where the time goes, op by op: torch.profiler over raylm's bare step loop (ModelRunner +
Scheduler, what each engine worker runs) and over HF's continuous batching, on the same
seeded random requests and the same weight tensors.

    PYTHONPATH=. python benchmarks/profile_ops.py [--layers 4] [--num-requests 16] [--top 12]
        [--systems bare,hf-cb] [--input-len 32:256] [--output-len 32:128] [--threads 2]

Prints, for each system, wall time and the top ops by self CPU time (share of the summed
self time of all ops), plus the share of matmuls (aten::mm/addmm/bmm/linear's kernels).
A script, not a test.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cluster.bench.command import parse_range
from cluster.bench.contenders import EngineSpec, run_bare
from cluster.bench.hf_runs import HF_RUNNERS, hf_model
from cluster.bench.workload import kv_blocks_for, make_workload
from workers.device import set_cpu_threads
from workers.loader import random_model

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn", "aten::_mkldnn")


def linear_flops(config, wl) -> float:
    """The workload's GEMM work: every prompt token and every fed-back output token through each
    layer's q/k/v, o, gate/up and down projections, one lm_head row per output token (no prefix
    hits: the prompts are random; no recompute: the pool holds the whole workload)."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_token = 2 * (h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h) * config.num_hidden_layers
    fed = wl.prompt_tokens + wl.output_tokens - wl.num_requests  # the last sampled token is never fed back
    return per_token * fed + 2 * h * config.vocab_size * wl.output_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-len", type=parse_range, default=(32, 256))
    ap.add_argument("--output-len", type=parse_range, default=(32, 128))
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default="bare,hf-cb")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    set_cpu_threads(a.threads)
    spec_str = f"random:qwen3-0.6b?layers={a.layers}&seed=0"
    model = random_model(spec_str, a.dtype)
    hf = hf_model(model)
    wl = make_workload(a.num_requests, a.input_len, a.output_len, model.config.vocab_size, seed=0)
    spec = EngineSpec(spec_str, a.dtype, 1, a.threads, True, a.batch_size, 16, kv_blocks_for(wl, 16), 2048, 0)
    print(f"# {spec_str}, {a.dtype}, {a.threads} threads, torch {torch.__version__}; {wl.num_requests} requests, "
          f"{wl.prompt_tokens} prompt + {wl.output_tokens} output tokens")
    for system in a.systems.split(","):
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if system == "bare":
                fig, _ = run_bare(model, spec, wl)
            else:
                fig, _ = HF_RUNNERS[system.removeprefix("hf-")](hf, wl, spec)
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        mm = sum(e.self_cpu_time_total for e in events if e.key.startswith(MATMULS))
        print(f"\n## {system}: {fig['elapsed_s']:.1f}s measured ({wall:.1f}s under the profiler), "
              f"{fig['output_tok_s']:.2f} output tok/s; matmuls {100 * mm / total:.1f}% of op self time")
        flops = linear_flops(model.config, wl)
        print(f"linear work {flops / 1e12:.2f} TFLOP in {mm / 1e6:.1f}s of matmul self time: "
              f"{flops / (mm / 1e6) / 1e9:.1f} GF/s (compare bench_gemm.py --packed's best fp32 rate)")
        print(f"{'op':<48} {'self %':>7} {'self s':>8} {'calls':>8}")
        for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:a.top]:
            print(f"{e.key[:48]:<48} {100 * e.self_cpu_time_total / total:>7.1f} "
                  f"{e.self_cpu_time_total / 1e6:>8.2f} {e.count:>8}")


if __name__ == "__main__":
    main()
