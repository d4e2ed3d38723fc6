"""EngineActor: an Engine inside a named, detached, async Ray actor (`raylm serve` starts one).

Its client is EngineClient (cluster/engine_client.py), which `connect()` and the HTTP
server of `raylm serve` use. Requests go in with `submit` (bad input raises right there)
and their deltas come back through `follow`, a Ray streaming generator.
"""

from __future__ import annotations

import asyncio

import ray

from cluster.config import EngineConfig

NAMESPACE = "raylm"


class EngineActor:
    def __init__(self, config: dict):
        from cluster.engine import Engine

        self.engine = Engine(EngineConfig(**config))
        self._streams: dict = {}
        self._ready = False

    async def start(self) -> dict:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.start)
        self._ready = True
        return self.info()

    def info(self) -> dict:
        e = self.engine
        return {"config": e.config.to_dict(), "model_path": e.model_path, "max_model_len": e.max_model_len,
                "vocab_size": e.vocab_size, "ready": self._ready}

    async def submit(self, prompt, params, request_id: str) -> str:
        if not self._ready:
            raise RuntimeError("the engine is still loading")
        self._streams[request_id] = self.engine.add_request(prompt, params, request_id, asyncio.get_running_loop())
        return request_id

    async def follow(self, request_id: str):
        stream = self._streams.get(request_id)
        if stream is None:
            raise ValueError(f"no request {request_id!r} to follow")
        try:
            async for delta in stream:
                yield delta
        finally:
            self._streams.pop(request_id, None)
            if stream.output is None:  # the follower went away: stop generating for nobody
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def worker_stats(self) -> list[dict]:
        return self.engine.worker_stats()

    def metrics_text(self) -> bytes:
        return self.engine.metrics_text()

    def apply_chat_template(self, messages) -> str:
        return self.engine.apply_chat_template(messages)

    def shutdown(self) -> None:
        self.engine.shutdown()
        ray.actor.exit_actor()


RemoteEngineActor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=0)(EngineActor)


def launch_detached(config: EngineConfig, name: str, namespace: str = NAMESPACE, timeout_s: float = 900.0):
    """Start a named, detached EngineActor and wait until its model is loaded."""
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise ValueError(f"an engine named {name!r} already runs in namespace {namespace!r}")
    actor = RemoteEngineActor.options(name=name, namespace=namespace, lifetime="detached").remote(config.to_dict())
    return actor, actor.start.remote()
