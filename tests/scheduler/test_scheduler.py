"""Scheduler behaviour, step by step: order, budgets, chunking, prefix cache, preemption, ending requests."""

import gc
import weakref

import pytest

from scheduler.protocol import StepResult, pack_int32
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from tests.factories import (
    EOS,
    FakeRunner,
    assert_matches_reference,
    drive,
    make_requests,
    make_scheduler,
    reference,
)


def run(reqs, depth=1, **cfg):
    sched = make_scheduler(**cfg, requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    updates = drive(sched, runner, depth=depth)
    return sched, runner, updates


def request_of(plan_new_request, reqs):
    """Which request a NewRequest carries: prompts are distinct."""
    return next(r for r in reqs if plan_new_request.token_ids[:r.num_prompt_tokens] == r.prompt_token_ids)


@pytest.mark.parametrize("cfg", [
    {}, {"block_size": 1}, {"block_size": 16, "num_blocks": 32}, {"max_num_seqs": 1},
    {"max_num_batched_tokens": 5}, {"enable_prefix_caching": False}, {"num_blocks": 14, "max_num_seqs": 4},
])
def test_outputs_match_an_uninterrupted_run(cfg):
    reqs = make_requests(12, prompt_len=lambda i: 1 + 3 * i, max_tokens=10, prefix=[1, 2, 3, 4, 5, 6])
    sched, _, updates = run(reqs, **cfg)
    assert_matches_reference(reqs, sched.config.max_total_tokens)
    assert all(r.is_finished for r in reqs)
    assert sum(len(u.new_token_ids) for u in updates) == sum(len(r.output_token_ids) for r in reqs)
    assert sched.stats()["generated_tokens"] == sum(len(r.output_token_ids) for r in reqs)


def test_requests_are_admitted_in_arrival_order():
    reqs = make_requests(6, prompt_len=lambda i: 20 - 3 * i, max_tokens=3)
    sched, runner, _ = run(reqs, max_num_seqs=2, max_num_batched_tokens=12)
    admitted = [request_of(nr, reqs) for p in runner.plans for nr in p.new_requests]
    assert admitted == reqs
    assert [r.first_scheduled_time for r in reqs] == sorted(r.first_scheduled_time for r in reqs)


def test_budgets_hold_and_decode_rows_come_first():
    reqs = make_requests(10, prompt_len=lambda i: 5 + 7 * i, max_tokens=6)
    sched, runner, _ = run(reqs, max_num_seqs=3, max_num_batched_tokens=9)
    assert runner.plans
    for plan in runner.plans:
        assert plan.num_tokens <= 9 and len(plan.rows) <= 3
        kinds = [row.token is not None for row in plan.rows]  # True: a decode row
        assert kinds == sorted(kinds, reverse=True)


def test_long_prompt_is_prefilled_in_chunks_around_running_decodes():
    short, long = make_requests(2, prompt_len=lambda i: 3 if i == 0 else 50, max_tokens=20, ignore_eos=True)
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(short)
    runner = FakeRunner.for_scheduler(sched)
    sched.update(runner.execute(sched.schedule()))
    sched.add_request(long)
    chunks, rows = [], []
    while long.num_computed_tokens < long.num_prompt_tokens:
        plan = sched.schedule()
        result = runner.execute(plan)
        assert plan.rows[0].slot == short.slot and plan.rows[0].num_tokens == 1  # the decode goes first
        chunks += [r.num_tokens for r in plan.rows if r.slot == long.slot]
        rows.append((long.slot in result.slots, long.num_computed_tokens))
        sched.update(result)
    # the budget of 16 minus the decode row that goes first
    assert sum(chunks) == long.num_prompt_tokens and max(chunks) == 16 - 1
    assert [samples for samples, _ in rows] == [False] * (len(rows) - 1) + [True]  # only the last chunk samples
    assert sum(len(p.new_requests) for p in runner.plans) == 2  # the long prompt was sent once
    drive(sched, runner)
    assert_matches_reference([short, long])


def test_prefix_hits_are_counted_and_reuse_the_blocks():
    prefix = list(range(500, 513))  # 13 tokens: 3 full blocks of 4
    first, second = make_requests(2, prompt_len=5, max_tokens=4, prefix=prefix)
    sched = make_scheduler(block_size=4)
    sched.add_request(first)
    runner = FakeRunner.for_scheduler(sched)
    drive(sched, runner)
    first_table = runner.plans[0].new_requests[0].block_table
    assert sched.cached_prefix_tokens(second.prompt_token_ids) == len(prefix) // 4 * 4
    before = sched.stats()
    sched.add_request(second)
    plan = sched.schedule()
    [nr] = plan.new_requests
    assert nr.num_computed == len(prefix) // 4 * 4
    assert nr.block_table[:3] == first_table[:3]
    assert second.num_cached_tokens == nr.num_computed
    stats = sched.stats()
    assert stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == nr.num_computed
    assert stats["prefix_queried_tokens"] - before["prefix_queried_tokens"] == second.num_tokens
    assert stats["prefix_hit_rate"] == stats["prefix_hit_tokens"] / stats["prefix_queried_tokens"]
    runner.execute(plan)  # the runner checks the cached blocks hold the prompt's tokens
    assert_matches_reference([first])


def test_concurrent_requests_share_prefix_blocks_only_once_confirmed():
    prefix = list(range(600, 608))
    a, b, c = make_requests(3, prompt_len=3, max_tokens=5, prefix=prefix)
    sched = make_scheduler(block_size=4)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(a)
    result = runner.execute(sched.schedule())
    sched.add_request(b)
    plan = sched.schedule()  # a's prefill is still in flight: b waits for its blocks, uncomputed yet
    assert not plan.new_requests and b.status is RequestStatus.WAITING
    sched.update(result)
    sched.update(runner.execute(plan))
    sched.add_request(c)
    plan = sched.schedule()
    assert [nr.num_computed for nr in plan.new_requests] == [len(prefix), len(prefix)]
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared and c.block_ids[:2] == shared
    assert [sched.block_manager.ref_count(x) for x in shared] == [3, 3]  # a, b and c
    sched.update(runner.execute(plan))
    drive(sched, runner)
    assert_matches_reference([a, b, c])


def test_cached_prefix_lookup_touches_no_counters():
    sched, _, _ = run(make_requests(2, prompt_len=9, max_tokens=2))
    before = sched.stats()
    sched.cached_prefix_tokens(list(range(100)))
    assert sched.stats() == before


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_and_recompute_give_the_uninterrupted_sequences(depth):
    reqs = make_requests(8, prompt_len=lambda i: 4 + i, max_tokens=16, ignore_eos=True)
    sched, runner, _ = run(reqs, depth=depth, num_blocks=10, block_size=4, max_num_seqs=4)
    assert sched.stats()["num_preemptions"] > 0
    assert sum(r.num_preemptions for r in reqs) == sched.stats()["num_preemptions"]
    assert_matches_reference(reqs, sched.config.max_total_tokens)
    for nr in (nr for p in runner.plans for nr in p.new_requests):  # re-admissions resend prompt + outputs
        req = request_of(nr, reqs)
        assert nr.token_ids == req.all_token_ids[:len(nr.token_ids)]
        assert nr.num_computed % 4 == 0 and nr.num_computed < len(nr.token_ids)


def test_the_newest_running_request_is_preempted():
    reqs = make_requests(3, prompt_len=4, max_tokens=12, ignore_eos=True)
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    while not sched.stats()["num_preemptions"]:
        slot_of_newest = reqs[-1].slot
        plan = sched.schedule()
        sched.update(runner.execute(plan))
    assert plan.preempted == [slot_of_newest]
    assert reqs[-1].status is RequestStatus.WAITING and reqs[-1].num_preemptions == 1
    assert [r.num_preemptions for r in reqs[:2]] == [0, 0]
    drive(sched, runner)
    assert_matches_reference(reqs)


def test_prefills_that_together_overflow_the_pool_still_finish():
    reqs = make_requests(3, prompt_len=30, max_tokens=4, ignore_eos=True)
    sched, _, _ = run(reqs, num_blocks=9, block_size=4, max_num_batched_tokens=10, max_num_seqs=3)
    assert_matches_reference(reqs)


def test_abort_frees_blocks_and_the_slot():
    reqs = make_requests(3, prompt_len=9, max_tokens=20, ignore_eos=True)
    sched = make_scheduler(requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    sched.update(runner.execute(sched.schedule()))
    victim = reqs[1]
    held, slot = len(victim.block_ids), victim.slot
    used = sched.stats()["kv_blocks_used"]
    assert sched.abort(victim.request_id) is victim
    assert victim.finish_reason is FinishReason.ABORT and victim.finish_time is not None
    assert sched.stats()["kv_blocks_used"] == used - held
    assert sched.abort(victim.request_id) is None and sched.get_request(victim.request_id) is None
    plan = sched.schedule()
    assert slot in plan.finished and victim.slot is None
    sched.update(runner.execute(plan))
    drive(sched, runner)
    assert_matches_reference(reqs)


def test_abort_while_waiting_removes_from_the_queue():
    reqs = make_requests(3, prompt_len=5, max_tokens=3)
    sched = make_scheduler(max_num_seqs=1, requests=reqs)
    assert sched.abort(reqs[2].request_id) is reqs[2]
    assert sched.num_waiting == 2
    drive(sched, FakeRunner.for_scheduler(sched))
    assert reqs[2].output_token_ids == [] and reqs[2].finish_reason is FinishReason.ABORT
    assert_matches_reference(reqs[:2])


def test_finished_requests_free_their_blocks_and_slots_are_reused_in_one_plan():
    reqs = make_requests(2, prompt_len=6, max_tokens=2, ignore_eos=True)
    sched = make_scheduler(max_num_seqs=1, requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    while not reqs[0].is_finished:
        sched.update(runner.execute(sched.schedule()))
    assert sched.stats()["kv_blocks_used"] == 0
    plan = sched.schedule()
    assert plan.finished == [0] and [nr.slot for nr in plan.new_requests] == [0]
    sched.update(runner.execute(plan))
    drive(sched, runner)
    assert_matches_reference(reqs)


def test_driver_side_finish_for_stop_strings():
    [req] = make_requests(1, prompt_len=4, max_tokens=30, ignore_eos=True, stop=["x"])
    sched = make_scheduler()
    sched.add_request(req)
    runner = FakeRunner.for_scheduler(sched)
    for _ in range(4):
        sched.update(runner.execute(sched.schedule()))
    assert sched.finish(req.request_id, FinishReason.STOP) is req
    assert req.finish_reason is FinishReason.STOP and sched.stats()["kv_blocks_used"] == 0
    assert sched.finish(req.request_id, FinishReason.STOP) is None
    with pytest.raises(ValueError, match="reason"):
        sched.finish("other", "stop")
    assert_matches_reference([req], cut_short={req.request_id})


def test_eos_stop_ids_and_max_model_len_end_requests():
    base = make_requests(1, prompt_len=6, max_tokens=12, eos=frozenset())[0]
    free_run, _ = reference(base.prompt_token_ids, base.params, eos=frozenset())
    eos_pair = frozenset({free_run[3], free_run[5]})  # a tokenizer may have several EOS ids
    a = Request("eos", base.prompt_token_ids, base.params, eos_token_ids=eos_pair)
    b = Request("stop-id", base.prompt_token_ids, SamplingParams(temperature=0, max_tokens=12,
                                                                  stop_token_ids=[free_run[4]]))
    c = Request("min", base.prompt_token_ids, SamplingParams(temperature=0, max_tokens=12, min_tokens=5),
                eos_token_ids=eos_pair)
    d = Request("ign", base.prompt_token_ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                eos_token_ids=eos_pair)
    e = Request("len", base.prompt_token_ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    sched, _, _ = run([a, b, c, d, e], max_model_len=len(base.prompt_token_ids) + 7)
    assert_matches_reference([a, b, c, d, e], max_total=len(base.prompt_token_ids) + 7)
    assert (a.finish_reason, b.finish_reason, d.finish_reason, e.finish_reason) == (
        FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH, FinishReason.LENGTH)
    assert len(a.output_token_ids) <= 4 and a.output_token_ids[-1] in eos_pair
    assert e.num_tokens == sched.config.max_model_len


def test_add_request_refuses_what_can_never_run():
    num_blocks, bs, max_len = 4, 4, 32
    sched = make_scheduler(num_blocks=num_blocks, block_size=bs, max_model_len=max_len)
    with pytest.raises(ValueError, match=rf"'long'.*{max_len} tokens.*max_model_len {max_len}"):
        sched.add_request(Request("long", list(range(max_len))))
    too_big = num_blocks * bs  # one more token (the first output) needs one more block than the pool
    with pytest.raises(ValueError, match=rf"'big'.*{too_big} tokens.*{num_blocks + 1} blocks.*pool has {num_blocks}"):
        sched.add_request(Request("big", list(range(too_big))))
    sched.add_request(Request("ok", list(range(too_big - 1))))
    with pytest.raises(ValueError, match="'ok'"):
        sched.add_request(Request("ok", [1]))
    assert sched.num_waiting == 1


def test_finished_requests_are_not_kept():
    sched = make_scheduler()
    reqs = make_requests(3, prompt_len=5, max_tokens=3)
    for r in reqs:
        sched.add_request(r)
    drive(sched, FakeRunner.for_scheduler(sched))
    assert all(sched.get_request(r.request_id) is None for r in reqs)
    refs = [weakref.ref(r) for r in reqs]
    del reqs, r
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]


def test_timings_are_ordered():
    reqs = make_requests(3, prompt_len=5, max_tokens=4, ignore_eos=True)
    run(reqs)
    for r in reqs:
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.last_token_time <= r.finish_time
        assert r.ttft >= 0 and r.tpot >= 0


def test_outstanding_tokens_shrink_to_zero():
    sched = make_scheduler()
    assert sched.outstanding_tokens() == 0
    reqs = make_requests(3, prompt_len=5, max_tokens=4, ignore_eos=True)
    for r in reqs:
        before = sched.outstanding_tokens()
        sched.add_request(r)
        assert sched.outstanding_tokens() == before + r.num_prompt_tokens + r.params.max_tokens
    seen = []
    drive(sched, FakeRunner.for_scheduler(sched), on_step=lambda s, _: seen.append(s.outstanding_tokens()))
    assert seen == sorted(seen, reverse=True) and seen[-1] == 0


def test_a_preempted_request_returns_to_the_front_of_the_queue():
    a, b, c = make_requests(3, prompt_len=4, max_tokens=12, ignore_eos=True)
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2)
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner.for_scheduler(sched)
    while not b.num_preemptions:
        plan = sched.schedule()
        sched.update(runner.execute(plan))
    assert plan.new_requests == []  # no admissions in a step that had to preempt
    assert c.first_scheduled_time is None and sched.num_waiting == 2
    admitted = []
    while not admitted:
        plan = sched.schedule()
        admitted = [request_of(nr, [a, b, c]) for nr in plan.new_requests]
        sched.update(runner.execute(plan))
    assert admitted[0] is b  # ahead of c, which arrived later and waited longer
    drive(sched, runner)
    assert_matches_reference([a, b, c])


def test_eos_inside_min_tokens_does_not_stop():
    [req] = make_requests(1, prompt_len=3, max_tokens=10, min_tokens=2)
    sched = make_scheduler()
    sched.add_request(req)
    for n in range(1, 4):
        plan = sched.schedule()
        sched.update(StepResult(plan.step_id, [req.slot], pack_int32([EOS])))
        assert req.is_finished == (n > req.params.min_tokens)
    assert req.output_token_ids == [EOS] * 3 and req.finish_reason is FinishReason.STOP


def test_a_readmitted_request_says_which_of_its_tokens_are_the_prompt():
    """Penalties count outputs: a request recomputed after preemption arrives with prompt +
    outputs and num_prompt; host-logits mode gets each penalized row's history."""
    a, b = make_requests(2, prompt_len=4, max_tokens=12, ignore_eos=True, frequency_penalty=1.0)
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2)
    for r in (a, b):
        sched.add_request(r)
    runner = FakeRunner.for_scheduler(sched)
    arrivals = []
    while sched.has_unfinished():
        plan = sched.schedule()
        reqs = {id(nr): request_of(nr, [a, b]) for nr in plan.new_requests}
        arrivals += [(nr, list(reqs[id(nr)].output_token_ids)) for nr in plan.new_requests]
        histories = sched.sampling_histories(plan.step_id)
        for (ws, position), hist in zip(sched.sampling_rows(plan.step_id), histories):
            req = a if ws is a.worker_sampling else b
            assert hist == (req.prompt_token_ids, req.output_token_ids[:position - req.num_prompt_tokens])
        sched.update(runner.execute(plan))
    again = [(nr, outs) for nr, outs in arrivals if outs]
    assert again, "nothing was preempted"
    for nr, outs in arrivals:
        assert nr.num_prompt == 4 and nr.token_ids[4:] == outs
    assert_matches_reference([a, b])
