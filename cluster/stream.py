"""RequestStream: hands one request's deltas from a producer thread to its consumer,
a blocking reader or an asyncio task, without polling.

A stream may also carry an error (a rejected submission, a lost engine): its reader
raises it. `deliver` hands many streams their deltas with one wake-up per event loop,
which is how a frontend fans one batch from the engine out to its requests."""

from __future__ import annotations

import asyncio
import queue
from collections import defaultdict

from cluster.outputs import RequestOutput, StreamDelta


class RequestStream:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._loop = loop
        self._sync: queue.SimpleQueue | None = None if loop else queue.SimpleQueue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop else None
        self.output: RequestOutput | None = None
        self.closed = False  # finished or failed: nothing more will come

    def put(self, item: StreamDelta | BaseException) -> None:  # any thread
        self._mark(item)
        if self._sync is not None:
            self._sync.put(item)
        else:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def fail(self, error: BaseException) -> None:
        self.put(error)

    def _mark(self, item) -> None:
        if isinstance(item, BaseException):
            self.closed = True
        elif item.finished:
            self.output = item.output
            self.closed = True

    def pending(self) -> int:
        """Deltas put but not yet read (asyncio streams; what a consumer may take at once)."""
        q = self._async if self._async is not None else self._sync
        return q.qsize()

    def take_ready(self) -> list[StreamDelta]:
        """The deltas already queued, without waiting (on the consumer's side)."""
        out = []
        q = self._async if self._async is not None else self._sync
        while not q.empty():
            item = q.get_nowait()
            if isinstance(item, BaseException):
                raise item
            out.append(item)
            if item.finished:
                break
        return out

    def __iter__(self):
        if self._sync is None:
            raise TypeError("this stream was opened for asyncio; use `async for`")
        while True:
            item = self._sync.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def __aiter__(self):
        if self._async is None:
            raise TypeError("this stream was opened for blocking reads; use `for`")
        while True:
            item = await self._async.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

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


def deliver(items: list[tuple[RequestStream, StreamDelta | BaseException]]) -> None:
    """Put each item in its stream: blocking readers at once, asyncio readers with one
    call into each event loop for the whole list (any thread)."""
    by_loop: dict = defaultdict(list)
    for stream, item in items:
        if stream._sync is not None:
            stream.put(item)
        else:
            stream._mark(item)
            by_loop[stream._loop].append((stream._async, item))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:  # that loop is closed: nobody is listening
            pass


def _put_all(pairs) -> None:
    for q, item in pairs:
        q.put_nowait(item)
