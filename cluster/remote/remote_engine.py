"""RemoteEngine: the client side of an EngineActor, what `connect()` hands to LLMHandle.

RemoteEngine gives LLMHandle the same methods a local Engine has, so a connected handle
generates, streams, chats and reports stats like a launched one. Requests and their
outputs travel over the frontend channel (cluster/remote/messages.py): each RemoteEngine is one
EngineConnection, whose submissions, aborts and deltas cross in batches, never one Ray call per
request or per token.
"""

from __future__ import annotations

import ray
from ray.exceptions import RayTaskError

from cluster.core.stream import RequestStream
from cluster.remote.client import ClientEngine
from cluster.remote.connection import EngineConnection
from cluster.remote.engine_actor import NAMESPACE
from cluster.remote.outbox import DEFAULT_LEASE_S


def _cause(e: RayTaskError) -> BaseException:
    """The exception raised inside the actor (ValueError, EngineOverloadedError, ...)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def _get(ref):
    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise _cause(e) from None


class RemoteEngine(ClientEngine):
    """A connected engine: requests over the frontend channel, the rest as Ray calls."""

    def __init__(self, actor, info: dict, lease_s: float = DEFAULT_LEASE_S):
        super().__init__(info)
        self._actor = actor
        self.connection = EngineConnection(actor, lease_s=lease_s)

    @classmethod
    def attach(cls, name: str, namespace: str = NAMESPACE, lease_s: float = DEFAULT_LEASE_S) -> RemoteEngine:
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ValueError(f"no raylm engine named {name!r} in namespace {namespace!r}; "
                             f"start one with `raylm serve --name {name}`") from None
        return cls(actor, _get(actor.info.remote()), lease_s)

    def add_request(self, prompt, params=None, request_id: str | None = None, loop=None,
                    sink: RequestStream | None = None, group: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> RequestStream:
        rid, wire = self.wire_request(prompt, request_id, prompt_token_ids)  # tokenized here, off the engine's loop
        return self.connection.submit(prompt, params, rid, loop, wire_prompt=wire, sink=sink, group=group)

    def apply_chat_template(self, messages, tools=None, template_kwargs=None) -> str:
        text = self.client_tokenizer.render(messages, tools, template_kwargs)
        if text is not None:
            return text
        return _get(self._actor.apply_chat_template.remote(messages, tools, template_kwargs))

    def abort(self, request_id: str) -> bool:
        return self.connection.abort(request_id)

    def stats(self) -> dict:
        return _get(self._actor.stats.remote())

    def health(self) -> dict:
        return _get(self._actor.health.remote())

    def worker_stats(self) -> list[dict]:
        return _get(self._actor.worker_stats.remote())

    def metrics_text(self) -> bytes:
        return _get(self._actor.metrics_text.remote())

    def shutdown(self) -> None:
        """Detach (aborting what this handle left running); the engine keeps serving
        others (stop it with `stop_engine`)."""
        self.connection.close()

    def stop_engine(self) -> None:
        self.connection.close()
        try:
            _get(self._actor.shutdown.remote())
        except ray.exceptions.RayActorError:
            pass  # exit_actor ends the call this way
