"""Outboxes: the engine actor's side of the frontend channel (see cluster/remote/messages.py).

Each connected frontend has one Outbox. It is the sink of every request that frontend
submitted: the engine puts the requests' deltas into it from its replica threads, and
the frontend's next `pull` takes all of them at once, as one msgpack message, however
many requests and tokens that is. A frontend that stops pulling for longer than its
lease (its process died, its network went away) is dropped and its requests aborted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import cluster.remote.messages as messages
from cluster.errors import RequestRefused
from cluster.outputs import StreamDelta

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
MAX_PULL_WAIT_S = 5.0


class Outbox:
    def __init__(self, connection_id: str, loop: asyncio.AbstractEventLoop, lease_s: float):
        self.connection_id = connection_id
        self.lease_s = lease_s
        self.requests: set[str] = set()  # submitted here and not finished
        self.last_seen = time.monotonic()
        self.pulling = 0
        self.closed = False
        self.batches = 0  # pulls answered with at least one delta
        self.deltas = 0
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[StreamDelta] = []
        self._ready = asyncio.Event()

    def put(self, delta: StreamDelta | RequestRefused) -> None:  # replica threads: the engine's request sink
        """A delta, or the error of a request refused after it was accepted."""
        with self._lock:
            if self.closed:
                return
            self._items.append(delta)
            first = len(self._items) == 1
            if isinstance(delta, RequestRefused) or delta.finished:
                self.requests.discard(delta.request_id)
        if first:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the actor's loop is gone: shutting down
                pass

    async def take(self, wait_s: float) -> bytes:
        """Every delta since the last take, waiting up to wait_s for the first."""
        self.pulling += 1
        self.last_seen = time.monotonic()
        try:
            if not self._items:
                try:
                    await asyncio.wait_for(self._ready.wait(), wait_s)
                except asyncio.TimeoutError:
                    pass
            with self._lock:
                items, self._items = self._items, []
                self._ready.clear()
        finally:
            self.pulling -= 1
            self.last_seen = time.monotonic()
        if items:
            self.batches += 1
            self.deltas += len(items)
        return messages.pack([messages.refusal(d.request_id, d) if isinstance(d, RequestRefused)
                             else messages.delta_entry(d) for d in items])

    def expired(self, now: float) -> bool:
        return not self.pulling and now - self.last_seen > self.lease_s

    def close(self) -> set[str]:
        """Stop taking deltas; returns the requests left unfinished."""
        with self._lock:
            self.closed = True
            self._items = []
            left, self.requests = self.requests, set()
        self._ready.set()
        return left


class Outboxes:
    """Every frontend's Outbox, keyed by frontend id, over one Engine."""

    def __init__(self, engine):
        self.engine = engine
        self._boxes: dict[str, Outbox] = {}
        self._reaper: asyncio.Task | None = None
        self.expired = 0  # frontends dropped for outliving their lease
        self._closed_batches = self._closed_deltas = 0

    def open(self, connection_id: str, lease_s: float = DEFAULT_LEASE_S) -> None:
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or lease_s <= 0:
            raise ValueError(f"lease_s must be a positive number, got {lease_s!r}")
        loop = asyncio.get_running_loop()
        if connection_id in self._boxes:
            raise ValueError(f"frontend {connection_id!r} is already connected")
        self._boxes[connection_id] = Outbox(connection_id, loop, float(lease_s))
        if self._reaper is None:
            self._reaper = loop.create_task(self._reap_forever())

    def _box(self, connection_id: str) -> Outbox:
        box = self._boxes.get(connection_id)
        if box is None:
            raise ValueError(f"frontend {connection_id!r} is not connected (its lease may have run out)")
        return box

    def push(self, connection_id: str, data: bytes) -> bytes:
        """Submissions and aborts, in order; returns the refused submissions."""
        box = self._box(connection_id)
        box.last_seen = time.monotonic()
        refused = []
        for op in messages.unpack(data):
            if op[0] == messages.ABORT:
                self.engine.abort(op[1])
                continue
            _, rid, prompt, params, group = op
            with box._lock:
                box.requests.add(rid)
            try:
                if group is not None and not isinstance(group, str):
                    raise ValueError(f"group must be a string or None, got {group!r}")
                self.engine.add_request(prompt, messages.params_from(params), rid, sink=box, group=group)
            except Exception as e:  # bad input, a full queue, no replica: the frontend raises it
                with box._lock:
                    box.requests.discard(rid)
                refused.append(messages.refusal(rid, e))
        return messages.pack(refused)

    async def pull(self, connection_id: str, wait_s: float) -> bytes:
        return await self._box(connection_id).take(min(max(float(wait_s), 0.0), MAX_PULL_WAIT_S))

    def close(self, connection_id: str) -> int:
        """Disconnect a frontend and abort what it left running; returns how many."""
        box = self._boxes.pop(connection_id, None)
        if box is None:
            return 0
        left = box.close()
        self._closed_batches += box.batches
        self._closed_deltas += box.deltas
        for rid in left:
            self.engine.abort(rid)
        return len(left)

    def stats(self) -> dict:
        boxes = list(self._boxes.values())
        batches = self._closed_batches + sum(b.batches for b in boxes)
        deltas = self._closed_deltas + sum(b.deltas for b in boxes)
        return {"frontends": len(boxes), "frontends_expired": self.expired, "frontend_batches": batches,
                "frontend_deltas": deltas, "deltas_per_frontend_batch": deltas / batches if batches else 0.0}

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min([1.0] + [b.lease_s / 4 for b in self._boxes.values()]))
            now = time.monotonic()
            for box in [b for b in self._boxes.values() if b.expired(now)]:
                n = self.close(box.connection_id)
                self.expired += 1
                log.warning("frontend %s stopped pulling for over %.0f s; aborted its %d request(s)",
                            box.connection_id, box.lease_s, n)
