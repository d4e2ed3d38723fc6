"""An engine as a named, detached Ray actor, and the client side that `connect()` uses.

EngineActor wraps an Engine inside an async actor (`raylm serve` starts one);
RemoteEngine gives LLMHandle the same methods a local Engine has, so a connected handle
generates, streams, chats and reports stats like a launched one. Requests and their
outputs travel over the frontend channel (cluster/channel.py): each RemoteEngine is one
Frontend, whose submissions, aborts and deltas cross in batches, never one Ray call per
request or per token.
"""

from __future__ import annotations

import asyncio
import uuid

import ray
from ray.exceptions import RayTaskError

from cluster.config import EngineConfig
from cluster.frontend import Frontend
from cluster.outbox import Outboxes

NAMESPACE = "raylm"


class EngineActor:
    def __init__(self, config: dict):
        from cluster.engine import Engine

        self.engine = Engine(EngineConfig(**config))
        self._outboxes = Outboxes(self.engine)
        self._ready = False

    async def start(self) -> dict:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.start)
        self._ready = True
        return self.info()

    def ready(self) -> bool:
        return self._ready

    def info(self) -> dict:
        e = self.engine
        return {"config": e.config.to_dict(), "model_path": e.model_path, "max_model_len": e.max_model_len,
                "vocab_size": e.vocab_size, "ready": self._ready}

    # ---- the frontend channel ----
    async def open_frontend(self, frontend_id: str, lease_s: float) -> None:
        self._outboxes.open(frontend_id, lease_s)

    async def push(self, frontend_id: str, ops: bytes) -> bytes:
        if not self._ready:
            raise RuntimeError("the engine is still loading")
        return self._outboxes.push(frontend_id, ops)

    async def pull(self, frontend_id: str, wait_s: float) -> bytes:
        return await self._outboxes.pull(frontend_id, wait_s)

    async def close_frontend(self, frontend_id: str) -> int:
        return self._outboxes.close(frontend_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def stats(self) -> dict:
        return {**self.engine.stats(), **self._outboxes.stats()}

    def health(self) -> dict:
        if not self._ready:
            return {"status": "unavailable", "reason": "the engine is still loading", "replicas": [],
                    "retry_after_s": 5}
        return self.engine.health()

    def metrics_text(self) -> bytes:
        return self.engine.metrics_text()

    def apply_chat_template(self, messages) -> str:
        return self.engine.apply_chat_template(messages)

    def shutdown(self) -> None:
        self.engine.shutdown()
        ray.actor.exit_actor()


RemoteEngineActor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=0)(EngineActor)


def _cause(e: RayTaskError) -> BaseException:
    """The exception raised inside the actor (ValueError, EngineOverloadedError, ...)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def _get(ref):
    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise _cause(e) from None


class RemoteEngine:
    def __init__(self, actor, info: dict, lease_s: float = 30.0):
        self._actor = actor
        self.info = info
        self.config = EngineConfig(**info["config"])
        self.model_path = info["model_path"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self._tokenizer = None
        self.frontend = Frontend(actor, lease_s=lease_s)

    @classmethod
    def attach(cls, name: str, namespace: str = NAMESPACE, lease_s: float = 30.0) -> "RemoteEngine":
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ValueError(f"no raylm engine named {name!r} in namespace {namespace!r}; "
                             f"start one with `raylm serve --name {name}`") from None
        return cls(actor, _get(actor.info.remote()), lease_s)

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded here from the engine's model path (that path must
        exist on this machine; generate/chat do not need it)."""
        if self._tokenizer is None:
            from workers.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def add_request(self, prompt, params=None, request_id: str | None = None, loop=None):
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        return self.frontend.submit(prompt, params, rid, loop)

    def apply_chat_template(self, messages) -> str:
        return _get(self._actor.apply_chat_template.remote(messages))

    def abort(self, request_id: str) -> bool:
        return self.frontend.abort(request_id)

    def stats(self) -> dict:
        return _get(self._actor.stats.remote())

    def metrics_text(self) -> bytes:
        return _get(self._actor.metrics_text.remote())

    def health(self) -> dict:
        return _get(self._actor.health.remote())

    def shutdown(self) -> None:
        """Detach (aborting what this handle left running); the engine keeps serving
        others (stop it with `stop_engine`)."""
        self.frontend.close()

    def stop_engine(self) -> None:
        self.frontend.close()
        try:
            _get(self._actor.shutdown.remote())
        except ray.exceptions.RayActorError:
            pass  # exit_actor ends the call this way


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
