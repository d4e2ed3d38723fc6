"""RequestStream: hands one request's deltas from a producer thread to its consumer,
a blocking reader or an asyncio task, without polling.

A stream may also carry an error (a rejected submission, a lost engine): its reader
raises it. `deliver` hands many streams their deltas with one wake-up per event loop:
the engine hands over each step's deltas that way (an HTTP server's 64 streams cost its
loop one wake-up a step, not 64), and a frontend fans each batch from the channel out.

A request with n choices runs as n engine requests (one per choice) that all feed one
stream: it tags each delta with its choice's index, ends when every choice has ended, and
its `output` gathers the choices (RequestOutput.of_choices)."""

from __future__ import annotations

import asyncio
import queue
from collections import defaultdict, deque

from cluster.outputs import RequestOutput, StreamDelta


class RequestStream:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None,
                 choice_ids: list[str] | None = None):
        self.request_id = request_id
        self._loop = loop
        self._sync: queue.SimpleQueue | None = None if loop else queue.SimpleQueue()
        # asyncio readers: the loop's own deque and one waiter future (an asyncio.Queue's
        # put/get machinery cost more per token than the rest of the hand-over)
        self._async: deque | None = deque() if loop else None
        self._waiter: asyncio.Future | None = None
        # the engine request id of each choice, when there are several
        self.choice_ids = list(choice_ids) if choice_ids else [request_id]
        self._index = {rid: i for i, rid in enumerate(self.choice_ids)}
        self._choice_outputs: list[RequestOutput | None] = [None] * len(self.choice_ids)
        self._unread = len(self.choice_ids)  # choices whose last delta the consumer has not read
        self.output: RequestOutput | None = None
        self.closed = False  # finished or failed: nothing more will come

    def put(self, item: StreamDelta | BaseException) -> None:  # any thread
        self._mark(item)
        if self._sync is not None:
            self._sync.put(item)
        else:
            try:
                self._loop.call_soon_threadsafe(self._push, item)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def _push(self, item) -> None:  # on the consumer's loop
        self._async.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _next(self):  # on the consumer's loop
        while not self._async:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._read(self._async.popleft())

    def fail(self, error: BaseException) -> None:
        self.put(error)

    def _mark(self, item) -> None:  # the producer's side
        if isinstance(item, BaseException):
            self.closed = True
            return
        if len(self.choice_ids) == 1:
            if item.finished:
                self.output = item.output
                self.closed = True
            return
        i = item.index = self._index[item.request_id]
        if item.finished:
            self._choice_outputs[i] = item.output
            if all(o is not None for o in self._choice_outputs):
                self.output = RequestOutput.of_choices(self.request_id, self._choice_outputs)
                self.closed = True

    def unfinished_ids(self) -> list[str]:
        """The engine request ids of the choices that have not finished (to abort them)."""
        if self.output is not None:
            return []
        return [rid for rid, o in zip(self.choice_ids, self._choice_outputs) if o is None]

    @property
    def ended(self) -> bool:
        """The consumer has read every choice's last delta."""
        return self._unread == 0

    def _read(self, item):  # the consumer's side
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._unread -= 1
        return item

    def take_ready(self) -> list[StreamDelta]:
        """The deltas already queued, without waiting (on the consumer's side)."""
        out = []
        if self._async is not None:
            q = self._async
            while q and not self.ended:
                out.append(self._read(q.popleft()))
            return out
        q = self._sync
        while not self.ended and not q.empty():
            out.append(self._read(q.get_nowait()))
        return out

    def __iter__(self):
        if self._sync is None:
            raise TypeError("this stream was opened for asyncio; use `async for`")
        while not self.ended:
            yield self._read(self._sync.get())

    async def __aiter__(self):
        if self._async is None:
            raise TypeError("this stream was opened for blocking reads; use `for`")
        while not self.ended:
            yield await self._next()

    async def batches(self):
        """asyncio readers: every delta queued by the time the reader asks, as a list (a
        reader that fell behind catches up in one go); ends after the last one."""
        if self._async is None:
            raise TypeError("this stream was opened for blocking reads; use `for`")
        while not self.ended:
            yield [await self._next()] + self.take_ready()

    def result(self) -> RequestOutput:
        if self.output is not None:
            return self.output
        for _ in self:
            pass
        return self.output

    async def aresult(self) -> RequestOutput:
        if self.output is not None:
            return self.output
        async for _ in self:
            pass
        return self.output


def deliver(items: list[tuple]) -> None:
    """Put each (sink, item) in its sink: asyncio RequestStreams with one call into each
    event loop for the whole list, any other sink (a blocking reader's stream, an engine
    actor's Outbox) by its own `put` (any thread)."""
    by_loop: dict = defaultdict(list)
    for stream, item in items:
        if getattr(stream, "_async", None) is None:
            stream.put(item)
        else:
            stream._mark(item)
            by_loop[stream._loop].append((stream, item))
    here = asyncio._get_running_loop()  # a producer on the consumer's own loop hands over without a wake-up
    for loop, pairs in by_loop.items():
        if loop is here:
            _put_all(pairs)
            continue
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:  # that loop is closed: nobody is listening
            pass


def _put_all(pairs) -> None:
    for stream, item in pairs:
        stream._push(item)
