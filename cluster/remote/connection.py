"""EngineConnection: one process's connection to an EngineActor (see cluster/remote/messages.py).

The HTTP server and every `cluster.connect()` handle hold one. Two threads carry all
traffic, whatever the number of requests:

- the pusher sends every submission and abort queued since its last call in one `push`
  (one call in flight at a time, so a burst of requests becomes a few calls), and
  hands refusals (bad input, a full queue, no replica) to the refused requests' streams;
- the puller long-polls `pull`, which answers with every delta of this frontend's
  requests since the last pull, and fans them out to the requests' streams, one
  wake-up per event loop per batch.

The puller is also the frontend's heartbeat: an engine that hears nothing for the
lease drops the frontend and aborts its requests. An engine that goes away fails every
open stream with EngineDeadError.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass

import ray

import cluster.remote.messages as messages
from cluster.core.stream import RequestStream, deliver
from cluster.errors import EngineDeadError
from cluster.outputs import TokenLogprob
from cluster.remote.outbox import DEFAULT_LEASE_S

log = logging.getLogger(__name__)

PULL_WAIT_S = 1.0


@dataclass
class _Open:
    stream: RequestStream
    prompt: object
    logprobs: list[TokenLogprob] | None


class EngineConnection:
    def __init__(self, actor, *, lease_s: float = DEFAULT_LEASE_S, pull_wait_s: float = PULL_WAIT_S):
        self.connection_id = uuid.uuid4().hex
        self._actor = actor
        self._wait_s = min(pull_wait_s, lease_s / 4)
        self._lock = threading.Condition()
        self._open: dict[str, _Open] = {}
        self._ops: list = []
        self._closed = False
        self.error: BaseException | None = None
        self.pushes = self.pulls = 0
        ray.get(actor.open_connection.remote(self.connection_id, lease_s))
        self._threads = [threading.Thread(target=f, name=f"raylm-frontend-{n}", daemon=True)
                         for n, f in (("push", self._push_loop), ("pull", self._pull_loop))]
        for t in self._threads:
            t.start()

    # ---- requests (any thread) ----
    def submit(self, prompt, params, request_id: str, loop=None, wire_prompt=None,
               sink: RequestStream | None = None, group: str | None = None) -> RequestStream:
        """Send `wire_prompt` (default: `prompt`; token ids when tokenized here); the final
        output names `prompt`. Deltas go to `sink` when given (a stream that several requests
        feed: the choices of one, which name one `group`), else to a new RequestStream."""
        stream = sink if sink is not None else RequestStream(request_id, loop)
        with self._lock:
            if self._closed:
                raise self.error or EngineDeadError("this connection to the engine is closed")
            if request_id in self._open:
                raise ValueError(f"request_id {request_id!r} is already in use")
            want_lps = params is not None and params.logprobs is not None
            self._open[request_id] = _Open(stream, prompt, [] if want_lps else None)
            wire = prompt if wire_prompt is None else wire_prompt
            self._ops.append(messages.submit_op(request_id, wire, params, group))
            self._lock.notify()
        return stream

    def abort(self, request_id: str) -> bool:
        """Ask the engine to stop a request; True if it was still open here."""
        with self._lock:
            if request_id not in self._open or self._closed:
                return False
            self._ops.append(messages.abort_op(request_id))
            self._lock.notify()
        return True

    def close(self) -> None:
        """Disconnect: the engine aborts what this frontend left running."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        try:
            ray.get(self._actor.close_connection.remote(self.connection_id), timeout=30)
        except Exception as e:  # the engine is gone already
            log.debug("closing frontend: %s", e)
        self._fail_all(EngineDeadError("this connection to the engine was closed"))

    # ---- the two threads ----
    def _push_loop(self) -> None:
        while True:
            with self._lock:
                while not self._ops and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                ops, self._ops = self._ops, []
            try:
                refused = messages.unpack(ray.get(self._actor.push.remote(self.connection_id, messages.pack(ops))))
                self.pushes += 1
            except Exception as e:
                self._lost(e)
                return
            items = []
            with self._lock:
                for rid, kind, message, retry_after_s in refused:
                    entry = self._open.pop(rid, None)
                    if entry is not None:
                        items.append((entry.stream, messages.refusal_error(kind, message, retry_after_s)))
            deliver(items)

    def _pull_loop(self) -> None:
        while not self._closed:
            try:
                entries = messages.unpack(ray.get(self._actor.pull.remote(self.connection_id, self._wait_s)))
                self.pulls += 1
            except Exception as e:
                self._lost(e)
                return
            if entries:
                deliver(self._demux(entries))

    def _demux(self, entries: list) -> list:
        items = []
        with self._lock:
            for e in entries:
                if len(e) == 4:  # refused after it was accepted (messages.refusal)
                    entry = self._open.pop(e[0], None)
                    if entry is not None:
                        items.append((entry.stream, messages.refusal_error(*e[1:])))
                    continue
                entry = self._open.get(e[0])
                if entry is None:
                    continue
                delta = messages.entry_delta(e, entry.prompt, entry.logprobs)
                if delta.finished:
                    del self._open[e[0]]
                items.append((entry.stream, delta))
        return items

    def _lost(self, error: BaseException) -> None:
        if self._closed:
            return
        cause = getattr(error, "cause", None) or error
        log.error("lost the engine: %s: %s", type(cause).__name__, cause)
        with self._lock:
            self._closed = True
            self.error = EngineDeadError(f"lost the engine: {type(cause).__name__}: {cause}")
            self._lock.notify_all()
        self._fail_all(self.error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = [e.stream for e in self._open.values()]
            self._open.clear()
        deliver([(s, error) for s in streams])
