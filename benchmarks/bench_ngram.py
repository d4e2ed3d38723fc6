"""Prompt lookup's host cost per row per step (speculative decoding's method ngram), by context length.

    PYTHONPATH=. python benchmarks/bench_ngram.py [--lengths 1000,8000,32000] [--steps 200]

A slot's known tokens (random ids of Qwen3's vocab, the suffix repeated once earlier) grow by one
token a step, as while decoding; each step reads them as the runner does (SlotState.known_array)
and searches (workers/ngram.py, lookup 1..4, k = 4). Prints microseconds per step. A script, not a test.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from scheduler.protocol import WorkerSampling
from workers.ngram import propose_ngram
from workers.slot_table import SlotState


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1000,8000,32000")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for n in (int(x) for x in a.lengths.split(",")):
        tokens = rng.integers(0, 151936, size=n).tolist()
        tokens[-3:] = tokens[n // 2:n // 2 + 3]
        state = SlotState(tokens, n, [], WorkerSampling(), n)
        new = rng.integers(0, 151936, size=a.steps).tolist()
        t0 = time.perf_counter()
        for t in new:
            propose_ngram(state.known_array(), min_n=1, max_n=4, k=4)
            state.generated.append(t)
        print(f"context {n}: {(time.perf_counter() - t0) / a.steps * 1e6:.0f} us per row per step")


if __name__ == "__main__":
    main()
