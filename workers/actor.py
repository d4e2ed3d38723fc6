"""WorkerActor: a thin Ray shell around ModelRunner. The only module in workers/ that
imports ray. Everything it receives and returns is msgpack bytes or plain dicts.

Replicas start the class `remote_worker()` returns: WorkerActor, or a subclass that the
RAYLM_WORKER_ACTOR environment variable names as "module:Class". Only tests set it (their
fault-injecting worker lives under tests/); production code has no fault hooks.

Under tensor parallelism a replica's ranks are actors like this one: the driver asks rank 0
for a rendezvous address, then starts every rank with its ParallelConfig; each step every
rank gets the same plan bytes and only rank 0 returns a result (the others return b"").

Steps arrive one of two ways (RunnerConfig.step_channel): as `execute` actor calls, or
over the worker's step channel (workers/step_channel.py), a TCP connection the replica
opens to the address `start` reports; there a thread of the actor runs `execute` per plan
frame, and the actor's own Ray methods (stats, shutdown) stay free."""

from __future__ import annotations

import functools
import gc
import importlib
import os
import socket
import threading
import time

import ray

from scheduler.protocol import StepPlan
from workers.device import set_cpu_threads, visible_devices_env
from workers.fake_runner import FakeRunner
from workers.parallel import SINGLE, ParallelConfig, TensorParallel, rendezvous_store
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig
from workers.sampling.grammar import xgrammar_installed
from workers.step_channel import StepServer


class WorkerActor:
    """Owns one device. The constructor is cheap; `start` loads the model."""

    def __init__(self) -> None:
        self.runner: ModelRunner | FakeRunner | None = None
        self.parallel: TensorParallel = SINGLE
        self.channel: StepServer | None = None
        self._store = None  # rank 0's rendezvous (TCPStore), from `rendezvous` on

    def rendezvous(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """(address, port) where this actor, as rank 0, hosts its group's rendezvous: listening
        from now on, until `start` joins the group over it."""
        address = ray.util.get_node_ip_address()
        self._store = rendezvous_store(address, world_size, timeout_s)
        return address, self._store.port

    def start(self, config: dict, parallel: dict | None = None) -> dict:
        cfg = RunnerConfig(**config)
        pc = ParallelConfig(**(parallel or {}))
        self.parallel = TensorParallel.join(pc, cfg.device, store=self._store if pc.rank == 0 else None)
        self.runner = _on_a_thread_of_its_own(functools.partial(self._load, cfg))
        self.runner.bind_thread()  # Ray's thread, where `execute` calls run: thread count and device
        env = visible_devices_env(cfg.device)
        info = {
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
            "pipeline_stage": self.parallel.pipeline.stage,
            "moe": self.runner.moe_report(),  # None for a dense model
            "weight_bytes": self.runner.stats()["weight_bytes"],
            "structured_output": xgrammar_installed(),
            "structured_output_ready": self.runner.grammars.cache is not None,  # prepared at start
            "cpu_threads": self.runner.cpu_thread_report(),  # chosen by measurement unless the user set them
        }
        if cfg.step_channel == "socket":
            self.channel = StepServer(self.execute, ray.util.get_node_ip_address(),
                                      on_thread_start=self.runner.bind_thread)
            info["step_channel"] = self.channel.describe()
        return info

    def _load(self, cfg: RunnerConfig) -> ModelRunner | FakeRunner:
        if cfg.fake_step_s is not None:
            return FakeRunner(cfg)
        if cfg.device == "cpu":
            set_cpu_threads(cfg.num_threads)
        runner = ModelRunner(cfg, parallel=self.parallel)
        runner.warmup()
        # the model, torch's and Ray's modules: held until the process ends, so moved out of the collector's
        # generations (gc.freeze, as vLLM's workers do after warm-up): the full collections the steps' own
        # objects trigger would walk them all
        gc.collect()
        gc.freeze()
        return runner

    @ray.method(enable_task_events=False)  # once per step: no task event to the GCS for each one
    def execute(self, plan_bytes: bytes) -> bytes:  # StepPlan bytes -> StepResult bytes
        result = self.runner.execute(StepPlan.from_bytes(plan_bytes))
        return result.to_bytes() if self.parallel.samples else b""  # only the sampling rank's result is pulled

    @ray.method(concurrency_group="grammar")
    def prefetch_grammar(self, spec, deadline: float | None = None) -> str | None:
        """Compile an arriving request's grammar before the driver schedules it: on threads of
        their own, beside the steps (the step channel's thread, or Ray calls to `execute`), so a
        slow compile holds only its own request. None once compiled, else why it cannot be.
        `deadline` (Unix time): the driver's; a compile that waited in the queue past it is skipped."""
        if self.runner is None:
            return "the worker is not started"
        if deadline is not None and time.time() > deadline:
            return "not compiled: its deadline passed while other grammars compiled"
        return self.runner.grammars.prefetch(spec)

    def stats(self) -> dict:
        return self.runner.stats() if self.runner is not None else {}

    def shutdown(self) -> None:
        if self.channel is not None:  # first: no step may run on a closed runner
            self.channel.close()
            self.channel = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self.parallel.close()
        ray.actor.exit_actor()


def _on_a_thread_of_its_own(fn):
    """fn() on a thread that ends when it returns, its result or exception passed on.

    Loading and warm-up compute with OpenMP, which keeps a team of threads per thread that ever
    ran a parallel region, for the life of that thread. Steps run on another thread (the step
    channel's, or Ray's for `execute`); a second team alive beside theirs puts more OpenMP
    threads in the process than it has cores, and libgomp then stops spinning between parallel
    regions: each of a step's hundreds of regions then wakes its threads from sleep
    (docs/benchmarks.md). The loading thread's team goes when the thread ends."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="raylm-load")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


WORKER_ACTOR_ENV = "RAYLM_WORKER_ACTOR"
GRAMMAR_THREADS = 2  # grammars compiled at once per worker: one slow compile does not hold the next


@functools.cache
def _as_remote(cls: type):
    # Restarts are the engine's job (it must rebuild scheduler state), so Ray's are off.
    return ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"grammar": GRAMMAR_THREADS})(cls)


def remote_worker():
    """The Ray actor class a replica starts: WorkerActor unless RAYLM_WORKER_ACTOR names a
    subclass ("module:Class"; importable by the driver and the workers)."""
    path = os.environ.get(WORKER_ACTOR_ENV)
    if not path:
        return _as_remote(WorkerActor)
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name, None) if name else None
    except ImportError as e:
        raise ValueError(f"{WORKER_ACTOR_ENV}={path!r}: cannot import {module!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, WorkerActor)):
        raise ValueError(f"{WORKER_ACTOR_ENV} must name a WorkerActor subclass as module:Class, got {path!r}")
    return _as_remote(cls)
