"""The CPU sampler's random draw: raylm's kernel (`raylm::sample_rows`, inverse CDF, one exp per
token) against the exponential race in torch ops (uniform noise, two logs per token), through
the real Sampler, on the tiny model's vocab and Qwen3's, taking turns.

    PYTHONPATH=. python benchmarks/bench_sampler.py [--threads 1] [--rows 64] [--reps 20]

Prints milliseconds per call (the median), for temperature-only rows and for top-p rows
(whose nucleus search runs before the draw either way). A script, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from scheduler.protocol import WorkerSampling
from workers.sampling.sampler import SAMPLER_ENV, Sampler, SamplingBatch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    samplers = {}
    for draw in ("fused", "torch"):
        os.environ[SAMPLER_ENV] = draw
        samplers[draw] = Sampler(torch.device("cpu"), seed=0)
    if samplers["fused"].kernels is None:
        raise SystemExit("raylm's CPU kernels are not built here: nothing to compare")
    print(f"# {a.threads} thread(s), {a.rows} rows, {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'vocab':>7} {'params':>16} {'kernel ms':>10} {'torch ms':>9} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for vocab in (2048, 151936):
        logits = torch.randn(a.rows, vocab, generator=g) * 3
        for name, params in (("temperature 1", WorkerSampling(temperature=1.0)),
                             ("top_p 0.9", WorkerSampling(temperature=0.7, top_p=0.9))):
            batch = SamplingBatch.build([params] * a.rows, list(range(a.rows)), torch.device("cpu"))
            times = {k: [] for k in samplers}
            for _ in range(a.reps):
                for k, s in samplers.items():
                    t0 = time.perf_counter()
                    s(logits, batch)
                    times[k].append(time.perf_counter() - t0)
            f, t = (statistics.median(times[k][1:]) * 1e3 for k in ("fused", "torch"))
            print(f"{vocab:>7} {name:>16} {f:>10.2f} {t:>9.2f} {t / f:>5.1f}x", flush=True)


if __name__ == "__main__":
    main()
