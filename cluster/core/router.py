"""Router: which replica a new request goes to.

The replica with the fewest outstanding tokens (prompt left to compute plus tokens left to
generate), unless another holds more of the prompt's prefix in its cache and is at most
a batch of work (plus the cached tokens it saves) behind. Ties go to the lower index.
Pure logic over what each replica answers; no Ray, no locks of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from cluster.errors import EngineDeadError


class Routable(Protocol):
    index: int
    dead: bool

    def load(self) -> int: ...

    def cached_prefix_tokens(self, token_ids: list[int]) -> int: ...


R = TypeVar("R", bound=Routable)


class Router:
    def __init__(self, *, prefix_caching: bool, max_num_batched_tokens: int) -> None:
        self.prefix_caching = prefix_caching
        self.max_num_batched_tokens = max_num_batched_tokens

    def pick(self, replicas: Sequence[R], token_ids: list[int]) -> R:
        alive = [r for r in replicas if not r.dead]
        if not alive:
            raise EngineDeadError("no replica is serving: every worker failed beyond its restart budget")
        if len(alive) == 1:
            return alive[0]
        load = {r.index: r.load() for r in alive}
        least = min(alive, key=lambda r: (load[r.index], r.index))
        if self.prefix_caching:
            cached = {r.index: r.cached_prefix_tokens(token_ids) for r in alive}
            best = max(cached.values())
            if best > 0:
                holder = min((r for r in alive if cached[r.index] == best), key=lambda r: (load[r.index], r.index))
                # Take the prefix unless that replica is a whole batch of work behind.
                if load[holder.index] - load[least.index] <= self.max_num_batched_tokens + best:
                    return holder
        return least
