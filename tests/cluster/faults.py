"""Fault injection for reliability tests: a worker actor that fails on request.

Tests select it through the `faulty_workers` fixture (tests/cluster/conftest.py), which
points RAYLM_WORKER_ACTOR at FaultyWorker; the engine then starts it for every worker,
replacements too. The production WorkerActor knows nothing of faults.
"""

from __future__ import annotations

import os
import threading
import time

import ray

from scheduler.request import SamplingParams
from workers.actor import WorkerActor

FAULT_KINDS = ("exit", "sleep", "raise")


class FaultyWorker(WorkerActor):
    def __init__(self) -> None:
        super().__init__()
        self._fault: dict | None = None
        self._steps = 0

    def execute(self, plan_bytes: bytes) -> bytes:
        self._steps += 1
        if self._fault is not None and self._steps >= self._fault["at_step"]:
            self._trigger_fault()
        return super().execute(plan_bytes)

    def arm_fault(self, kind: str, after_steps: int = 0, seconds: float = 0.0) -> None:
        """Make a later step fail: "exit" ends the process inside the step, "sleep" hangs it
        for `seconds`, "raise" raises from it. The fault fires once."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        self._fault = {"kind": kind, "at_step": self._steps + 1 + after_steps, "seconds": seconds}

    def _trigger_fault(self) -> None:
        fault, self._fault = self._fault, None
        if fault["kind"] == "exit":
            os._exit(1)
        if fault["kind"] == "sleep":
            time.sleep(fault["seconds"])
        else:
            raise RuntimeError("injected worker fault")


FAULTY_WORKER = f"{__name__}:{FaultyWorker.__name__}"  # the RAYLM_WORKER_ACTOR value that selects it


def arm_fault(llm, kind: str, after_steps: int = 0, seconds: float = 0.0, replica: int = 0) -> None:
    """Arm a fault in the worker of `llm`'s replica `replica` (engines started under `faulty_workers`)."""
    ray.get(llm.engine.replicas[replica].worker.arm_fault.remote(kind, after_steps=after_steps, seconds=seconds))


# the workload the fault tests run (tests/cluster/test_reliability.py, test_worker_faults.py)
PROMPTS = ["北京故宫是", "Hello there", "The quick brown fox jumps over the lazy dog", "Once upon a time",
           "def add(a, b):"]
N = 20


def generate_in_background(llm, prompts, params):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("outs", llm.generate(prompts, params)), daemon=True)
    t.start()
    return t, box


def wait_for_tokens(llm, n=1, timeout=60):
    deadline = time.monotonic() + timeout
    while llm.stats()["generated_tokens"] < n:
        assert time.monotonic() < deadline, "generation never started"
        time.sleep(0.01)


GREEDY = SamplingParams(max_tokens=N, temperature=0)
SEEDED = SamplingParams(max_tokens=N, temperature=1.0, top_k=50, seed=1234)


# ---- poison pills: workers that fail on one request's input, however often it comes back ----
POISON_TOKEN = 1999  # a prompt holding this id is the poison pill (the tiny model's vocab is 2,048)


class _PoisonWorker(WorkerActor):
    """Fails every step that admits a request whose tokens hold POISON_TOKEN, in each generation
    of worker: what a request the worker cannot survive does."""

    def execute(self, plan_bytes: bytes) -> bytes:
        from scheduler.protocol import StepPlan

        plan = StepPlan.from_bytes(plan_bytes)
        if any(POISON_TOKEN in n.token_ids for n in plan.new_requests):
            return self.poisoned(plan_bytes)
        return super().execute(plan_bytes)

    def poisoned(self, plan_bytes: bytes) -> bytes:
        raise NotImplementedError


class PoisonExitWorker(_PoisonWorker):
    def poisoned(self, plan_bytes: bytes) -> bytes:
        os._exit(1)


class PoisonGarbageWorker(_PoisonWorker):
    """Answers with bytes that are no StepResult: the driver's loop itself fails on them."""

    def poisoned(self, plan_bytes: bytes) -> bytes:
        return b"\xc1 not a step result"


POISON_EXIT_WORKER = f"{__name__}:{PoisonExitWorker.__name__}"
POISON_GARBAGE_WORKER = f"{__name__}:{PoisonGarbageWorker.__name__}"
