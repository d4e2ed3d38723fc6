"""WaitingQueue: first come first served, preempted requests in front, removal by id, and a
running sum of outstanding tokens that always equals the sum over its requests."""

from __future__ import annotations

import random

import pytest

from scheduler.waiting import WaitingQueue
from tests.factories import make_requests

MAX_TOTAL = 64


def total(queue: WaitingQueue) -> int:
    return sum(r.num_outstanding_tokens(MAX_TOTAL) for r in queue)


def test_fifo_with_preempted_requests_pushed_to_the_front():
    q = WaitingQueue(MAX_TOTAL)
    a, b, c, d = make_requests(4)
    for r in (a, b, c):
        q.push(r)
    q.push(d, front=True)
    assert [r.request_id for r in q] == ["r3", "r0", "r1", "r2"]
    assert q.peek() is d and len(q) == 4 and q


def test_remove_by_id_keeps_order_and_the_token_sum():
    q = WaitingQueue(MAX_TOTAL)
    reqs = make_requests(5, prompt_len=lambda i: 3 + 4 * i, max_tokens=10)
    for r in reqs:
        q.push(r)
    assert q.outstanding_tokens == total(q) == sum(r.num_outstanding_tokens(MAX_TOTAL) for r in reqs)
    q.remove(reqs[2])
    assert [r.request_id for r in q] == ["r0", "r1", "r3", "r4"]
    assert q.outstanding_tokens == total(q)
    with pytest.raises(KeyError):
        q.remove(reqs[2])


def test_generation_is_capped_by_the_model_length():
    q = WaitingQueue(max_total_tokens=12)
    (r,) = make_requests(1, prompt_len=10, max_tokens=50)
    q.push(r)
    assert q.outstanding_tokens == 12  # ten prompt tokens plus the two that still fit


def test_clear_empties_and_zeroes():
    q = WaitingQueue(MAX_TOTAL)
    for r in make_requests(3):
        q.push(r)
    q.clear()
    assert len(q) == 0 and not q and q.outstanding_tokens == 0 and list(q) == []


def test_random_pushes_and_removals_match_a_list_model():
    rng = random.Random(0)
    q, model = WaitingQueue(MAX_TOTAL), []
    pool = make_requests(40, prompt_len=lambda i: 1 + i % 17, max_tokens=9)
    for r in pool:
        if model and rng.random() < 0.3:
            victim = rng.choice(model)
            model.remove(victim)
            q.remove(victim)
        front = rng.random() < 0.25
        if front:
            model.insert(0, r)
        else:
            model.append(r)
        q.push(r, front=front)
        assert list(q) == model
        assert q.outstanding_tokens == sum(x.num_outstanding_tokens(MAX_TOTAL) for x in model)
        assert q.peek() is model[0]
