"""EngineClient: the client side of an EngineActor, what `connect()` hands to LLMHandle.

EngineClient gives LLMHandle the same methods a local Engine has, so a connected handle
generates, streams, chats and reports stats like a launched one. Requests go in with the
actor's `submit` (bad input raises right there) and their deltas come back through
`follow`, a Ray streaming generator, read by a RemoteStream.
"""

from __future__ import annotations

import uuid

import ray
from ray.exceptions import RayTaskError

from cluster.config import EngineConfig
from cluster.engine_actor import NAMESPACE
from cluster.outputs import RequestOutput


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


class EngineClient:
    """A connected engine: every call is a Ray call to its EngineActor."""

    def __init__(self, actor, info: dict):
        self._actor = actor
        self.info = info
        self.config = EngineConfig(**info["config"])
        self.model_path = info["model_path"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self._tokenizer = None

    @classmethod
    def attach(cls, name: str, namespace: str = NAMESPACE) -> EngineClient:
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
