"""EngineActor: a LocalEngine inside a named, detached, async Ray actor (`raylm serve` starts one).

Its client is RemoteEngine (cluster/remote/remote_engine.py), which `connect()` and the HTTP
server of `raylm serve` use. Requests and outputs cross over the frontend channel
(cluster/remote/messages.py): `push` brings a frontend's submissions and aborts in batches, `pull`
hands it every delta of its requests since its last pull (cluster/remote/outbox.py).

`raylm serve` (by default) also runs its HTTP server in this process, on a thread of its
own, over a local handle to the engine (cluster/openai/http_server.py): HTTP traffic skips the
channel.

Every thread of this process shares one GIL: the replica loops, the event loop serving
the channel and, with it, the HTTP server's. A replica loop leaves the GIL in each Ray
call (submitting step N+2, waiting for step N) and takes it back when the call returns;
Python makes a thread that wants the GIL wait up to the switch interval (5 ms by default)
before it makes the holder let go, which is as long as a small model's decode step. So this
process switches every `gil_switch_interval_ms` (0.5 ms by default), and a step's submission
does not wait behind the HTTP thread (docs/benchmarks.md has the measurement).
"""

from __future__ import annotations

import asyncio
import sys

import ray

from cluster.config import DEFAULT_GIL_SWITCH_INTERVAL_MS, EngineConfig, check_gil_switch_interval_ms
from cluster.remote.engine_calls import EngineCalls
from cluster.remote.outbox import Outboxes

NAMESPACE = "raylm"


class EngineActor(EngineCalls):
    def __init__(self, config: dict, gil_switch_interval_ms: float | None = DEFAULT_GIL_SWITCH_INTERVAL_MS):
        from cluster.core.engine import LocalEngine

        if gil_switch_interval_ms is not None:  # None: Python's own (5 ms)
            sys.setswitchinterval(gil_switch_interval_ms / 1000)
        self.engine = LocalEngine(EngineConfig(**config))
        self._outboxes = Outboxes(self.engine)
        self._ready = False
        self._http = None  # HttpServer, when `raylm serve` runs its HTTP server here

    async def start_http(self, serving) -> None:
        """Listen for HTTP on this process, as `serving` (a ServingConfig) says; before start(), so
        the port is taken at once and /health says "loading" while the model loads."""
        from cluster.openai.http_server import HttpServer

        if self._http is not None:
            raise RuntimeError("this engine already serves HTTP")
        http = HttpServer(serving)
        await http.start()
        self._http = http

    async def start(self) -> dict:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.start)
        except Exception as e:
            if self._http is not None:
                self._http.failed(f"engine failed to start: {type(e).__name__}: {e}")
            raise
        self._ready = True
        if self._http is not None:
            from cluster.handle import LLMHandle

            self._http.serve(LLMHandle(self.engine))
        return self.info()

    def serves_http(self) -> bool:
        return self._http is not None and self._http.running

    def info(self) -> dict:
        return {**super().info(), "ready": self._ready, "gil_switch_interval_ms": sys.getswitchinterval() * 1000}

    # ---- the frontend channel ----
    async def open_connection(self, connection_id: str, lease_s: float) -> None:
        self._outboxes.open(connection_id, lease_s)

    # push / pull run per batch of a frontend's traffic (every few ms under load): no task event
    # to the GCS for each, as for the workers' per-step execute
    @ray.method(enable_task_events=False)
    async def push(self, connection_id: str, ops: bytes) -> bytes:
        if not self._ready:
            raise RuntimeError("the engine is still loading")
        return self._outboxes.push(connection_id, ops)

    @ray.method(enable_task_events=False)
    async def pull(self, connection_id: str, wait_s: float) -> bytes:
        return await self._outboxes.pull(connection_id, wait_s)

    async def close_connection(self, connection_id: str) -> int:
        return self._outboxes.close(connection_id)

    # the rest (EngineCalls) runs on the executor, so the event loop keeps serving every frontend's push and pull
    async def stats(self) -> dict:
        return {**await super().stats(), **self._outboxes.stats()}

    async def health(self) -> dict:
        if not self._ready:
            return {"status": "unavailable", "reason": "the engine is still loading", "replicas": [],
                    "retry_after_s": 5}
        return await super().health()

    async def shutdown(self) -> None:
        if self._http is not None:
            await self._http.stop()
        await self._off_loop(self.engine.shutdown)
        ray.actor.exit_actor()


RemoteEngineActor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=0)(EngineActor)


def launch_detached(config: EngineConfig, name: str, namespace: str = NAMESPACE, http=None,
                    gil_switch_interval_ms: float | None = DEFAULT_GIL_SWITCH_INTERVAL_MS):
    """Start a named, detached EngineActor; returns it and the ref of its start() (the
    model loaded). With `http` (a ServingConfig) the actor runs on this node and
    listens there before loading: an error taking the port is raised here."""
    check_gil_switch_interval_ms(gil_switch_interval_ms)
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise ValueError(f"an engine named {name!r} already runs in namespace {namespace!r}")
    options = {}
    if http is not None:  # its port is this host's
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                        soft=False)
    actor = RemoteEngineActor.options(name=name, namespace=namespace, lifetime="detached",
                                      **options).remote(config.to_dict(), gil_switch_interval_ms)
    if http is not None:
        try:
            ray.get(actor.start_http.remote(http))
        except BaseException as e:
            ray.kill(actor, no_restart=True)
            cause = getattr(e, "cause", None)
            raise cause if isinstance(cause, OSError) else e from None
    return actor, actor.start.remote()
