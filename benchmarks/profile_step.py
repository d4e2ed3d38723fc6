"""By-op profile of one model's decode steps through ModelRunner: a batch of decode rows over
prompts already in the paged cache, torch.profiler over a few steps, top ops by self CPU time.

    PYTHONPATH=. python benchmarks/profile_step.py [--layers 8] [--rows 64] [--prompt-len 150]
        [--steps 3] [--threads 2] [--ops cpu|reference] [--top 15]

Uses only ModelRunner and the StepPlan protocol, so the same script profiles an older tree
(without --ops) for a before/after. fp32 compute (bf16 random weights upcast, as on a CPU
without bf16 matmuls). A script, not a test.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", default=None)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    kw = {"ops": a.ops} if a.ops else {}
    bs = 16
    blocks_per = -(-(a.prompt_len + a.steps + 2) // bs)
    runner = ModelRunner(RunnerConfig(model=f"random:qwen3-0.6b?layers={a.layers}", dtype="float32",
                                      num_kv_blocks=a.rows * blocks_per + 8, max_num_seqs=a.rows,
                                      num_threads=a.threads, max_num_batched_tokens=a.rows * a.prompt_len, **kw))
    g = torch.Generator().manual_seed(0)
    new = [NewRequest(i, torch.randint(0, 150000, (a.prompt_len,), generator=g).tolist(), 0,
                      list(range(i * blocks_per, (i + 1) * blocks_per)), WorkerSampling()) for i in range(a.rows)]
    t = time.perf_counter()
    prefill = [ScheduledRow(i, a.prompt_len) for i in range(a.rows)]
    runner.execute(StepPlan(step_id=0, new_requests=new, rows=prefill))
    print(f"# {a.layers} layers, {a.rows} rows x {a.prompt_len} prompt, {a.threads} threads, "
          f"ops {runner.stats().get('ops', 'n/a')}; prefill {time.perf_counter() - t:.1f}s")
    rows = [ScheduledRow(i, 1, [], USE_RESIDENT) for i in range(a.rows)]
    runner.execute(StepPlan(step_id=1, rows=rows))  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for s in range(a.steps):
            runner.execute(StepPlan(step_id=2 + s, rows=rows))
        wall = (time.perf_counter() - t) / a.steps
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    print(f"decode step: {wall * 1e3:.0f} ms wall; summed op self time {total / 1e3 / a.steps:.0f} ms/step")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: a.top]:
        ms, share = e.self_cpu_time_total / 1e3 / a.steps, 100 * e.self_cpu_time_total / total
        print(f"  {e.key:<48} {ms:9.1f} ms/step {share:5.1f}%")


if __name__ == "__main__":
    main()
