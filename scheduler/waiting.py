"""WaitingQueue: requests not on the worker, first come first served; preempted ones go first."""

from __future__ import annotations

from collections import OrderedDict

from scheduler.request import Request


class WaitingQueue:
    """O(1) push (back or front), peek, and removal by id (abort, a late stop token).

    Also keeps the sum of its requests' outstanding tokens (prompt to compute plus tokens
    left to generate), so routing never scans the queue.
    """

    def __init__(self, max_total_tokens: int) -> None:
        self._max_total = max_total_tokens
        self._queue: OrderedDict[str, Request] = OrderedDict()
        self.outstanding_tokens = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self):
        return iter(self._queue.values())

    def push(self, req: Request, front: bool = False) -> None:
        self._queue[req.request_id] = req
        if front:
            self._queue.move_to_end(req.request_id, last=False)
        self.outstanding_tokens += req.num_outstanding_tokens(self._max_total)

    def peek(self) -> Request:
        return next(iter(self._queue.values()))

    def remove(self, req: Request) -> None:
        del self._queue[req.request_id]
        self.outstanding_tokens -= req.num_outstanding_tokens(self._max_total)

    def clear(self) -> None:
        self._queue.clear()
        self.outstanding_tokens = 0
