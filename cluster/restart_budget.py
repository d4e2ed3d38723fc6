"""RestartBudget: when a replica whose worker failed may try again. Pure Python, no Ray.

The budget is a rate, not a lifetime count: at most `max_restarts` restarts within any
`window_s` seconds. Tries are spaced by a backoff that doubles with each failure in a
row (from `backoff_s`, at most `max_backoff_s`) and resets once a worker serves a step.
A replica that spent its budget gives up (its requests fail) and, `cooldown_s` later,
tries once more with a fresh budget; if that worker comes up, it serves again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    give_up: bool
    delay_s: float  # restart: wait this long before starting a worker; give up: the cool-down


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, backoff_s: float, max_backoff_s: float,
                 cooldown_s: float):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max(max_backoff_s, backoff_s)
        self.cooldown_s = cooldown_s
        self._restarts: deque[float] = deque()  # when each restart in the window began
        self._in_a_row = 0  # failures since a worker last served a step
        self.total_restarts = 0
        self.give_ups = 0

    def restarts_in_window(self, now: float) -> int:
        while self._restarts and now - self._restarts[0] >= self.window_s:
            self._restarts.popleft()
        return len(self._restarts)

    def on_failure(self, now: float) -> Decision:
        """A worker failed (or failed to start): restart after a delay, or give up."""
        self._in_a_row += 1
        if self.restarts_in_window(now) >= self.max_restarts:
            self.give_ups += 1
            self._in_a_row = 0
            return Decision(True, self.cooldown_s)
        delay = 0.0 if self._in_a_row == 1 else min(self.backoff_s * 2 ** (self._in_a_row - 2), self.max_backoff_s)
        self._restarts.append(now + delay)
        self.total_restarts += 1
        return Decision(False, delay)

    def on_step_served(self) -> None:
        """A worker returned a step: the next failure starts the backoff afresh."""
        self._in_a_row = 0

    def on_cooldown_over(self) -> None:
        """The cool-down after a give-up has passed: the next tries get a fresh budget."""
        self._restarts.clear()
        self._in_a_row = 0
