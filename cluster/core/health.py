"""A replica's health: its state (ReplicaHealth) and when a failed worker may be restarted
(RestartBudget). Pure Python, no Ray.

States: "starting" (first worker coming up), "up" (serving), "restarting" (its worker
failed; a replacement is on its way and its requests wait to be recomputed), "down"
(it gave up: its requests failed, the router skips it until `retry_at`; then it starts
a worker again and is "up" once that worker answers) and "stopped" (shut down).
The replica's loop thread is the only writer; readers take a snapshot with `describe`.

The budget is a rate, not a lifetime count: at most `max_restarts` restarts within any
`window_s` seconds. Tries are spaced by a backoff that doubles with each failure in a
row (from `backoff_s`, at most `max_backoff_s`) and resets once a worker serves a step.
A replica that spent its budget gives up (its requests fail) and, `cooldown_s` later,
tries once more with a fresh budget; if that worker comes up, it serves again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from cluster.config import EngineConfig


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


ROUTABLE = ("starting", "up", "restarting")


class ReplicaHealth:
    def __init__(self, index: int, config: EngineConfig):
        self.index = index
        self.state = "starting"
        self.budget = RestartBudget(config.max_worker_restarts, config.restart_window_s, config.restart_backoff_s,
                                    config.max_restart_backoff_s, config.replica_cooldown_s)
        self.last_error: str | None = None
        self.last_error_time: float | None = None  # wall clock, for humans and Prometheus
        self.retry_at: float | None = None  # monotonic; while down
        self.rejoins = 0  # times it came back after giving up

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE

    def on_failure(self, error: BaseException) -> Decision:
        """A worker failed or failed to start: restart (after decision.delay_s) or give up."""
        self.last_error = f"{type(error).__name__}: {error}"[:500]
        self.last_error_time = time.time()
        now = time.monotonic()
        decision = self.budget.on_failure(now)
        if decision.give_up:
            self.state, self.retry_at = "down", now + decision.delay_s
        elif self.state != "down":
            self.state = "restarting"
        else:  # a retry after the cool-down failed: try again after the backoff, still down
            self.retry_at = now + decision.delay_s
        return decision

    def cooldown_left(self) -> float:
        return max(0.0, self.retry_at - time.monotonic()) if self.retry_at is not None else 0.0

    def on_cooldown_over(self) -> None:
        self.budget.on_cooldown_over()

    def on_up(self) -> None:
        if self.state == "down":
            self.rejoins += 1
        self.state, self.retry_at = "up", None

    def describe(self) -> dict:
        now = time.monotonic()
        return {
            "replica": self.index,
            "state": self.state,
            "restarts": self.budget.total_restarts,
            "restarts_in_window": self.budget.restarts_in_window(now),
            "give_ups": self.budget.give_ups,
            "rejoins": self.rejoins,
            "last_error": self.last_error,
            "last_error_time": self.last_error_time,
            "retry_in_s": self.cooldown_left() if self.state == "down" else None,
        }
