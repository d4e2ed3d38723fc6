"""Scheduler cost per step: schedule() + update(), with the worker's time left out.

    PYTHONPATH=. python benchmarks/bench_scheduler.py [--steps 2000] [--seed 0]

(a) 256 running decode requests (one decode row each per step), pipeline depth 1 and 2;
(b) 1,000 requests waiting at once, run to completion (admission, chunked prefill, decode).
A stand-in worker answers each plan instantly; only the scheduler's calls are timed.
Also prints the msgpack codec's cost for the same steps (the engine pays it too).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque

from scheduler.protocol import StepPlan, StepResult, pack_int32
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig


class InstantWorker:
    """Tracks per-slot known/computed counts like a worker and samples a fixed token."""

    def __init__(self) -> None:
        self.slots: dict[int, list[int]] = {}  # slot -> [known tokens, computed tokens]

    def execute(self, plan: StepPlan) -> StepResult:
        for s in plan.finished + plan.preempted:
            del self.slots[s]
        for nr in plan.new_requests:
            self.slots[nr.slot] = [len(nr.token_ids), nr.num_computed]
        slots = []
        for row in plan.rows:
            st = self.slots[row.slot]
            st[1] += row.num_tokens
            if st[1] == st[0]:
                st[0] += 1
                slots.append(row.slot)
        return StepResult(plan.step_id, slots, pack_int32([1000 + s for s in slots]), logits_shape=(len(slots), 0))


def run(sched: Scheduler, depth: int, max_steps: int, skip: int = 0):
    """Drive sched; returns per-step seconds of schedule()+update() (steps after `skip`) and codec seconds."""
    worker, inflight = InstantWorker(), deque()
    per_step, codec = [], []
    sched_t = update_t = 0.0
    steps = 0
    while (sched.has_unfinished() or inflight) and steps < max_steps + skip:
        t0 = time.perf_counter()
        plan = sched.schedule() if len(inflight) < depth else None
        sched_t += time.perf_counter() - t0
        if plan is not None:
            c0 = time.perf_counter()
            plan_bytes = plan.to_bytes()
            c1 = time.perf_counter()
            result = worker.execute(StepPlan.from_bytes(plan_bytes))
            result_bytes = result.to_bytes()
            c2 = time.perf_counter()
            inflight.append(StepResult.from_bytes(result_bytes))
            codec.append((c1 - c0) + (time.perf_counter() - c2))
            if len(inflight) < depth:
                continue
        if inflight:
            t0 = time.perf_counter()
            sched.update(inflight.popleft())
            update_t += time.perf_counter() - t0
        steps += 1
        if steps > skip:
            per_step.append(sched_t + update_t)
        sched_t = update_t = 0.0
    return per_step, codec


def report(name: str, per_step: list[float], codec: list[float]) -> None:
    ms = sorted(x * 1e3 for x in per_step)
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    print(f"{name}: {len(ms)} steps, schedule+update per step: mean {statistics.fmean(ms):.3f} ms, "
          f"p50 {p(0.5):.3f} ms, p99 {p(0.99):.3f} ms, max {ms[-1]:.3f} ms; "
          f"codec (plan+result encode/decode) mean {statistics.fmean(codec) * 1e3:.3f} ms")


def bench_decode(steps: int, depth: int) -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=256 * 160, block_size=16, max_num_seqs=256,
                                      max_num_batched_tokens=8192, max_model_len=4096))
    for i in range(256):
        prompt = [(i * 7919 + j) % 150_000 for j in range(128)]
        sched.add_request(Request(f"d{i}", prompt, SamplingParams(max_tokens=3000, ignore_eos=True)))
    warmup = 8  # 256 x 128 prompt tokens at 8192 per step
    per_step, codec = run(sched, depth, steps, skip=warmup)
    assert sched.num_running == 256 and sched.stats()["num_preemptions"] == 0
    report(f"(a) 256 running decode requests, depth {depth}", per_step, codec[warmup:])


def bench_waiting(seed: int) -> None:
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(num_blocks=8192, block_size=16, max_num_seqs=256,
                                      max_num_batched_tokens=2048, max_model_len=4096))
    system = [rng.randrange(150_000) for _ in range(48)]  # a shared system prompt: 3 cacheable blocks
    for i in range(1000):
        prompt = system + [rng.randrange(150_000) for _ in range(rng.randint(16, 208))]
        sched.add_request(Request(f"w{i}", prompt, SamplingParams(max_tokens=rng.randint(32, 128), ignore_eos=True)))
    per_step, codec = run(sched, 1, 10**9)
    s = sched.stats()
    report("(b) 1,000 waiting requests, run to completion, depth 1", per_step, codec)
    first = per_step[:50]
    print(f"    first 50 steps (queue of ~1,000): mean {statistics.fmean(first) * 1e3:.3f} ms, "
          f"max {max(first) * 1e3:.3f} ms; prefix hit rate {s['prefix_hit_rate']:.3f}, "
          f"preemptions {s['num_preemptions']}, generated {s['generated_tokens']} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="measured decode steps in (a)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bench_decode(args.steps, depth=1)
    bench_decode(args.steps, depth=2)
    bench_waiting(args.seed)


if __name__ == "__main__":
    main()
