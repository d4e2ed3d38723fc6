"""ReplicaHealth: what state a replica is in, why, and when it may try again. No Ray.

States: "starting" (first worker coming up), "up" (serving), "restarting" (its worker
failed; a replacement is on its way and its requests wait to be recomputed), "down"
(it gave up: its requests failed, the router skips it until `retry_at`; then it starts
a worker again and is "up" once that worker answers) and "stopped" (shut down).
The replica's loop thread is the only writer; readers take a snapshot with `describe`.
"""

from __future__ import annotations

import time

from cluster.config import EngineConfig
from cluster.restart_budget import Decision, RestartBudget

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
