"""Router: least outstanding tokens, the prefix holder unless it is a batch behind; no Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cluster.core.router import Router
from cluster.errors import EngineDeadError


@dataclass
class FakeReplica:
    index: int
    outstanding: int = 0
    cached: dict = field(default_factory=dict)  # tuple(prompt) -> tokens cached
    dead: bool = False

    def load(self) -> int:
        return self.outstanding

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        return self.cached.get(tuple(token_ids), 0)


PROMPT = [1, 2, 3, 4]


def router(prefix_caching: bool = True, batch: int = 100) -> Router:
    return Router(prefix_caching=prefix_caching, max_num_batched_tokens=batch)


def test_fewest_outstanding_tokens_wins_and_ties_go_to_the_lower_index():
    reps = [FakeReplica(0, 50), FakeReplica(1, 10), FakeReplica(2, 10)]
    assert router().pick(reps, PROMPT) is reps[1]
    reps[1].outstanding = 60
    assert router().pick(reps, PROMPT) is reps[2]


def test_dead_replicas_are_skipped_and_none_alive_raises():
    reps = [FakeReplica(0, 0, dead=True), FakeReplica(1, 500)]
    assert router().pick(reps, PROMPT) is reps[1]
    reps[1].dead = True
    with pytest.raises(EngineDeadError, match="no replica is serving"):
        router().pick(reps, PROMPT)


def test_the_prefix_holder_wins_within_a_batch_of_work_plus_what_it_saves():
    holder = FakeReplica(1, 0, {tuple(PROMPT): 32})
    idle = FakeReplica(0, 0)
    for behind, expected in [(0, holder), (100 + 32, holder), (100 + 33, idle)]:
        holder.outstanding = behind
        assert router(batch=100).pick([idle, holder], PROMPT) is expected, behind


def test_the_longest_cached_prefix_wins_then_the_least_loaded_holder():
    reps = [FakeReplica(0, 0), FakeReplica(1, 30, {tuple(PROMPT): 16}), FakeReplica(2, 20, {tuple(PROMPT): 32}),
            FakeReplica(3, 10, {tuple(PROMPT): 32})]
    assert router().pick(reps, PROMPT) is reps[3]


def test_without_prefix_caching_only_load_counts():
    reps = [FakeReplica(0, 5), FakeReplica(1, 6, {tuple(PROMPT): 64})]
    assert router(prefix_caching=False).pick(reps, PROMPT) is reps[0]
    assert router(prefix_caching=True).pick(reps, PROMPT) is reps[1]


def test_a_lone_replica_is_not_asked_for_its_load():
    class Lone(FakeReplica):
        def load(self) -> int:
            raise AssertionError("a lone replica's load was asked")

    lone = Lone(0)
    assert router().pick([lone], PROMPT) is lone
