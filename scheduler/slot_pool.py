"""SlotPool: the wire ids of requests on the worker, and the drops the next plan must carry."""

from __future__ import annotations

from heapq import heapify, heappop, heappush


class SlotPool:
    """Slots are ints in [0, max_num_seqs); the smallest free one is handed out first, so
    they stay one msgpack byte. A released slot is reported once, in the next plan's
    `finished` or `preempted` list, which the worker applies before that plan's new
    requests: a slot may be released and reused by the same plan."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        self._free = list(range(self.num_slots))
        heapify(self._free)
        self.finished: list[int] = []  # for the next plan's `finished`
        self.preempted: list[int] = []  # for the next plan's `preempted`

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return heappop(self._free)

    def release(self, slot: int, preempted: bool) -> None:
        (self.preempted if preempted else self.finished).append(slot)
        heappush(self._free, slot)

    @property
    def has_drops(self) -> bool:
        return bool(self.finished or self.preempted)

    def take_drops(self) -> tuple[list[int], list[int]]:
        drops = self.finished, self.preempted
        self.finished, self.preempted = [], []
        return drops
