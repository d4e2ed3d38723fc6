"""An engine as a named, detached Ray actor, and the client side that `connect()` uses.

EngineActor wraps an Engine inside an async actor (`raylm serve` starts one);
RemoteEngine gives LLMHandle the same methods a local Engine has, so a connected handle
generates, streams, chats and reports stats like a launched one. Requests go in with
`submit` (bad input raises right there) and their deltas come back through `follow`, a
Ray streaming generator.
"""

from __future__ import annotations

import asyncio
import uuid

import ray
from ray.exceptions import RayTaskError

from cluster.config import EngineConfig
from cluster.outputs import RequestOutput

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

    def ready(self) -> bool:
        return self._ready

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


def _cause(e: RayTaskError) -> BaseException:
    """The exception raised inside the actor (ValueError, EngineOverloadedError, ...)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def _get(ref):
    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise _cause(e) from None


class RemoteStream:
    """A request's deltas from an EngineActor; iterate with `for` or `async for`."""

    def __init__(self, actor, request_id: str, prompt, params, submit_now: bool):
        self._actor = actor
        self.request_id = request_id
        self._args = (prompt, params, request_id)
        self._submitted = False
        self.output: RequestOutput | None = None
        if submit_now:
            _get(actor.submit.remote(*self._args))
            self._submitted = True

    def __iter__(self):
        if not self._submitted:
            _get(self._actor.submit.remote(*self._args))
            self._submitted = True
        for ref in self._actor.follow.remote(self.request_id):
            delta = _get(ref)
            if delta.finished:
                self.output = delta.output
            yield delta

    async def __aiter__(self):
        try:
            if not self._submitted:
                await self._actor.submit.remote(*self._args)
                self._submitted = True
            async for ref in self._actor.follow.remote(self.request_id):
                delta = await ref
                if delta.finished:
                    self.output = delta.output
                yield delta
        except RayTaskError as e:
            raise _cause(e) from None

    def result(self) -> RequestOutput:
        for _ in self:
            pass
        return self.output

    async def aresult(self) -> RequestOutput:
        async for _ in self:
            pass
        return self.output


class RemoteEngine:
    def __init__(self, actor, info: dict):
        self._actor = actor
        self.info = info
        self.config = EngineConfig(**info["config"])
        self.model_path = info["model_path"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self._tokenizer = None

    @classmethod
    def attach(cls, name: str, namespace: str = NAMESPACE) -> "RemoteEngine":
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ValueError(f"no raylm engine named {name!r} in namespace {namespace!r}; "
                             f"start one with `raylm serve --name {name}`") from None
        return cls(actor, _get(actor.info.remote()))

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded here from the engine's model path (that path must
        exist on this machine; generate/chat do not need it)."""
        if self._tokenizer is None:
            from workers.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def add_request(self, prompt, params=None, request_id: str | None = None, loop=None) -> RemoteStream:
        rid = request_id if request_id is not None else uuid.uuid4().hex
        return RemoteStream(self._actor, rid, prompt, params, submit_now=loop is None)

    def apply_chat_template(self, messages) -> str:
        return _get(self._actor.apply_chat_template.remote(messages))

    def abort(self, request_id: str) -> bool:
        return _get(self._actor.abort.remote(request_id))

    def stats(self) -> dict:
        return _get(self._actor.stats.remote())

    def worker_stats(self) -> list[dict]:
        return _get(self._actor.worker_stats.remote())

    def metrics_text(self) -> bytes:
        return _get(self._actor.metrics_text.remote())

    def shutdown(self) -> None:
        """Detach; the engine keeps serving others (stop it with `stop_engine`)."""

    def stop_engine(self) -> None:
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
