"""WorkerActor: a thin Ray shell around ModelRunner. The only module in workers/ that
imports ray. Everything it receives and returns is msgpack bytes or plain dicts.

Under tensor parallelism a replica's ranks are actors like this one: the driver asks rank 0
for a rendezvous address, then starts every rank with its ParallelConfig; each step every
rank gets the same plan bytes and only rank 0 returns a result (the others return b"")."""

from __future__ import annotations

import os
import socket
import time

import ray

from scheduler.protocol import StepPlan
from workers.device import set_cpu_threads, visible_devices_env
from workers.parallel import SINGLE, ParallelConfig, TensorParallel, free_port
from workers.runner import ModelRunner, RunnerConfig


class WorkerActor:
    """Owns one device. The constructor is cheap; `start` loads the model."""

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None
        self.parallel: TensorParallel = SINGLE
        self._fault: dict | None = None
        self._steps = 0

    def rendezvous(self) -> tuple[str, int]:
        """(address, free port) where this actor, as rank 0, will host its group's rendezvous."""
        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def start(self, config: dict, parallel: dict | None = None) -> dict:
        cfg = RunnerConfig(**config)
        if cfg.device == "cpu":
            set_cpu_threads(cfg.num_threads)
        self.parallel = TensorParallel.join(ParallelConfig(**(parallel or {})), cfg.device)
        self.runner = ModelRunner(cfg, parallel=self.parallel)
        self.runner.warmup()
        env = visible_devices_env(cfg.device)
        return {
            "num_kv_blocks": self.runner.num_kv_blocks,
            "vocab_size": self.runner.vocab_size,
            "max_model_len": self.runner.max_model_len,
            "device": str(self.runner.device),
            "visible_devices": {
                k: os.environ.get(k) for k in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", env) if k
            },
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "tensor_parallel_rank": self.parallel.rank,
        }

    def execute(self, plan_bytes: bytes) -> bytes:  # StepPlan bytes -> StepResult bytes
        self._steps += 1
        if self._fault is not None and self._steps >= self._fault["at_step"]:
            self._trigger_fault()
        result = self.runner.execute(StepPlan.from_bytes(plan_bytes))
        return result.to_bytes() if self.parallel.is_first else b""  # only rank 0's result is pulled

    def check_health(self) -> bool:
        return self.runner is not None

    def stats(self) -> dict:
        return self.runner.stats() if self.runner is not None else {}

    def arm_fault(self, kind: str, after_steps: int = 0, seconds: float = 0.0) -> None:
        """Testing hook: make a later step fail. kind "exit" ends the process inside the
        step; "sleep" makes the step hang for `seconds`; "raise" raises from the step."""
        if kind not in ("exit", "sleep", "raise"):
            raise ValueError(f"fault kind must be 'exit', 'sleep' or 'raise', got {kind!r}")
        self._fault = {"kind": kind, "at_step": self._steps + 1 + after_steps, "seconds": seconds}

    def _trigger_fault(self) -> None:
        fault, self._fault = self._fault, None
        if fault["kind"] == "exit":
            os._exit(1)
        if fault["kind"] == "sleep":
            time.sleep(fault["seconds"])
        else:
            raise RuntimeError("injected worker fault")

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self.parallel.close()
        ray.actor.exit_actor()


# Restarts are the engine's job (it must rebuild scheduler state), so Ray's are off.
RemoteWorker = ray.remote(max_restarts=0, max_task_retries=0)(WorkerActor)
