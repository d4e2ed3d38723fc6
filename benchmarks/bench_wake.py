"""What a wake-up costs this host: the CPU time of one fixed slice of Python work (dict and list
churn, about an engine step's at 64 rows) run back to back, and run after each sleep of a device
step's length, alternating.

    python benchmarks/bench_wake.py [--gap-ms 30] [--reps 200] [--rounds 2]

The engine's CPU per replica-step with 30 ms fake steps is about twice its CPU with steps that
come back at once, for the same work (`raylm bench --driver-capacity`); this prints how much of
that the host alone puts on any thread that resumes from a sleep (a core's clock and caches after
idling), with no raylm code involved. A script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time


def work() -> int:
    d = {}
    for i in range(3000):
        d[i] = [i, i * 2]
    return sum(v[1] for v in d.values())


def cpu_ms(gap_s: float, reps: int) -> float:
    cpu = []
    for _ in range(reps):
        if gap_s:
            time.sleep(gap_s)
        t = time.thread_time()
        work()
        cpu.append(time.thread_time() - t)
    return statistics.median(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gap-ms", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for r in range(a.rounds):
        hot, cold = cpu_ms(0.0, a.reps), cpu_ms(a.gap_ms / 1e3, a.reps)
        print(f"round {r + 1}: back to back {hot:.3f} ms CPU, after a {a.gap_ms:.0f} ms sleep {cold:.3f} ms: "
              f"x{cold / hot:.2f}")


if __name__ == "__main__":
    main()
