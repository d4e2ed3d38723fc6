"""Requests that arrive together with the same prompt (the n choices of one request) compute
its full blocks once: the first computes them, the others wait for them to be confirmed and
hit the prefix cache; unrelated requests pass the waiting ones."""

import pytest

from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from tests.factories import FakeRunner, assert_matches_reference, drive, make_requests, make_scheduler


def _siblings(n, prompt, max_tokens=6):
    return [Request(f"c{i}", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
            for i in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("budget", [64, 8])
def test_siblings_compute_the_prompts_full_blocks_once(depth, budget):
    prompt = list(range(300, 322))  # 22 tokens: 5 full blocks of 4 and 2 more
    reqs = _siblings(3, prompt)
    sched = make_scheduler(block_size=4, max_num_batched_tokens=budget)
    for r in reqs:
        sched.add_request(r)
    drive(sched, FakeRunner.for_scheduler(sched), depth=depth)
    full = (len(prompt) - 1) // 4 * 4  # what a cache hit may cover: never the last prompt token
    stats = sched.stats()
    assert stats["prompt_tokens"] == len(prompt) + 2 * (len(prompt) - full)
    assert stats["prefix_hit_tokens"] == 2 * full
    assert [r.num_cached_tokens for r in reqs] == [0, full, full]
    assert stats["kv_blocks_used"] == 0
    assert_matches_reference(reqs)


def test_unrelated_requests_pass_a_waiting_sibling():
    prompt = list(range(300, 317))
    a, b = _siblings(2, prompt)
    [other] = make_requests(1, prompt_len=6)
    sched = make_scheduler(block_size=4)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(a)
    first = sched.schedule()
    sched.add_request(b)
    sched.add_request(other)
    plan = sched.schedule()  # a's prefill is in flight: b waits, other does not
    assert [nr.token_ids for nr in plan.new_requests] == [other.prompt_token_ids]
    sched.update(runner.execute(first))
    sched.update(runner.execute(plan))
    plan = sched.schedule()
    assert [nr.token_ids for nr in plan.new_requests] == [b.prompt_token_ids]
    assert plan.new_requests[0].num_computed == 16
    sched.update(runner.execute(plan))
    drive(sched, runner)
    assert_matches_reference([a, b, other])
    assert sched.stats()["prefix_waits"] >= 1


@pytest.mark.parametrize("end", ["abort", "preempt"])
def test_a_sibling_ending_mid_prefill_hands_the_rest_on(end):
    """Aborted, its claims go and the waiting sibling computes the rest; preempted, it goes
    first again (hitting its own published blocks) and the sibling waits for it once more."""
    prompt = list(range(300, 333))  # 33 tokens, prefilled 8 a step
    a, b = _siblings(2, prompt)
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(a)
    sched.add_request(b)
    sched.update(runner.execute(sched.schedule()))  # a's first 8 tokens: 2 blocks published
    if end == "abort":
        sched.abort(a.request_id)
    else:
        sched._preempt(a)  # what running out of blocks does to the newest request
    plan = sched.schedule()
    assert [nr.num_computed for nr in plan.new_requests] == [8]
    computing = b if end == "abort" else a
    assert computing.status is RequestStatus.RUNNING and computing.num_cached_tokens == 8
    sched.update(runner.execute(plan))
    drive(sched, runner)
    assert b.finish_reason is FinishReason.LENGTH
    assert_matches_reference([b] if end == "abort" else [a, b])
    assert sched.stats()["kv_blocks_used"] == 0
