"""RequestStream: hands one request's deltas from a replica thread to its consumer,
a blocking reader or an asyncio task, without polling."""

from __future__ import annotations

import asyncio
import queue

from cluster.outputs import RequestOutput, StreamDelta


class RequestStream:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._loop = loop
        self._sync: queue.SimpleQueue | None = None if loop else queue.SimpleQueue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop else None
        self.output: RequestOutput | None = None

    def put(self, delta: StreamDelta) -> None:  # any thread
        if delta.finished:
            self.output = delta.output
        if self._sync is not None:
            self._sync.put(delta)
        else:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, delta)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def __iter__(self):
        if self._sync is None:
            raise TypeError("this stream was opened for asyncio; use `async for`")
        while True:
            delta = self._sync.get()
            yield delta
            if delta.finished:
                return

    async def __aiter__(self):
        if self._async is None:
            raise TypeError("this stream was opened for blocking reads; use `for`")
        while True:
            delta = await self._async.get()
            yield delta
            if delta.finished:
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
