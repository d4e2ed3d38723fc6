"""What a step's trip to the worker costs: a Ray actor call against the step channel.

    .venv/bin/python benchmarks/bench_step_channel.py [--steps 300] [--work-ms 5] [--rounds 2]

An actor stands in for the worker: each "step" spins for --work-ms, then returns the first
200 bytes of a 4 KB plan. The driver keeps two steps in flight, as a replica does, and the
script prints per step: the wall time beyond the work, the driver's CPU, and the worker
process's CPU beyond the work (its Ray threads included). Rounds alternate the two ways.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ray  # noqa: E402

from workers.step_channel import StepClient, StepServer  # noqa: E402


@ray.remote
class Stand:
    def __init__(self, work_s: float) -> None:
        self.work_s = work_s
        self.server = None

    def execute(self, plan: bytes) -> bytes:
        t = time.perf_counter()
        while time.perf_counter() - t < self.work_s:
            pass
        return plan[:200]

    def serve(self) -> dict:
        self.server = StepServer(self.execute, "127.0.0.1")
        return self.server.describe()

    def cpu(self) -> float:
        return time.process_time()


def run(name: str, submit, get, stand, steps: int, work_s: float) -> None:
    for _ in range(10):
        get(submit())
    c0, w0, t0 = time.process_time(), ray.get(stand.cpu.remote()), time.perf_counter()
    inflight = [submit()]
    for i in range(steps):
        if i < steps - 1:
            inflight.append(submit())
        get(inflight.pop(0))
    t1, c1, w1 = time.perf_counter(), time.process_time(), ray.get(stand.cpu.remote())
    ms = 1e3 / steps
    print(f"{name:12s} wall beyond the work {(t1 - t0) * ms - work_s * 1e3:6.3f} ms/step   "
          f"driver CPU {(c1 - c0) * ms:6.3f} ms/step   worker CPU beyond the work "
          f"{(w1 - w0) * ms - work_s * 1e3:6.3f} ms/step", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--work-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, address="local")
    stand = Stand.remote(a.work_ms / 1e3)
    d = ray.get(stand.serve.remote())
    client = StepClient(d["host"], d["port"], d["token"])
    plan = b"x" * 4096
    ways = {
        "ray call": (lambda: stand.execute.remote(plan), ray.get),
        "step channel": (lambda: client.send(plan, 30), lambda _: client.recv(30)),
    }
    for r in range(a.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            run(name, *ways[name], stand, a.steps, a.work_ms / 1e3)


if __name__ == "__main__":
    main()
