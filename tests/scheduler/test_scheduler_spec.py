"""Speculative decoding on the driver: lookahead rows, variable accepted runs, stops inside a run,
and the sequences equal to running without speculation (FakeRunner drafts right or wrong by rule)."""

import pytest

from scheduler.protocol import USE_RESIDENT, StepResult, pack_int32
from scheduler.request import FinishReason
from tests.factories import FakeRunner, assert_matches_reference, drive, make_requests, make_scheduler, reference

K = 3


def workload(**params):
    return make_requests(10, prompt_len=lambda i: 2 + 3 * i, max_tokens=20, prefix=[9, 8, 7, 6, 5], **params)


def every_third_wrong(position: int) -> bool:
    return position % 3 != 0


@pytest.mark.parametrize("cfg", [
    {}, {"num_blocks": 14, "block_size": 4, "max_num_seqs": 4}, {"max_num_batched_tokens": 7},
    {"num_blocks": 40, "block_size": 2, "enable_prefix_caching": False}, {"max_model_len": 40},
])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("draft_right", [every_third_wrong, lambda p: True, lambda p: False],
                         ids=["mixed", "all-right", "all-wrong"])
def test_speculating_gives_the_sequences_of_running_without_it(cfg, depth, draft_right):
    reqs = workload()
    sched = make_scheduler(**cfg, requests=reqs, num_lookahead_tokens=K)
    runner = FakeRunner.for_scheduler(sched, draft_right=draft_right)
    drive(sched, runner, depth=depth)
    assert_matches_reference(reqs, sched.config.max_total_tokens)  # what an unspeculative run gives
    stats = sched.stats()
    rows = [row for p in runner.plans for row in p.rows if row.token is not None]
    assert max(row.num_tokens for row in rows) == 1 + K
    assert stats["spec_draft_tokens"] > 0
    if draft_right(1) and draft_right(2) and draft_right(3):  # every draft right
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
    elif not draft_right(1):
        assert stats["spec_accepted_tokens"] == 0
    else:
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["spec_mean_accepted_length"] == 1 + stats["spec_accepted_tokens"] / stats["spec_verify_rows"]
    assert sum(r.num_draft_tokens for r in reqs) == stats["spec_draft_tokens"]
    assert stats["kv_blocks_used"] == 0


def test_every_kind_of_row_speculates_and_logprobs_arrive_per_token():
    greedy = workload()
    sampled = make_requests(3, prompt_len=4, max_tokens=10, id_prefix="t", temperature=0.7, seed=5)
    logprobs = make_requests(2, prompt_len=5, max_tokens=10, id_prefix="l", logprobs=2)
    penalised = make_requests(2, prompt_len=6, max_tokens=10, id_prefix="p", presence_penalty=0.5)
    reqs = greedy + sampled + logprobs + penalised
    sched = make_scheduler(requests=reqs, num_lookahead_tokens=K, max_num_seqs=16)
    runner = FakeRunner.for_scheduler(sched, draft_right=every_third_wrong)
    drive(sched, runner, depth=2)
    assert_matches_reference(reqs)
    assert all(r.num_draft_tokens > 0 for r in sampled + logprobs + penalised)  # each position is a row of its own
    for r in logprobs:  # a verified run's logprobs arrive one per token, in order
        assert [lp.token_id for lp in r.output_logprobs] == r.output_token_ids
        assert [lp.logprob for lp in r.output_logprobs] == pytest.approx([-t / 100 for t in r.output_token_ids])
    assert sum(r.num_draft_tokens > 0 for r in greedy) >= len(greedy) // 2


def test_a_stop_inside_an_accepted_run_ends_the_request_there():
    reqs = [r for r in make_requests(60, prompt_len=3, max_tokens=30)
            if reference(r.prompt_token_ids, r.params)[1] is FinishReason.STOP][:4]
    assert reqs, "the fake model should stop some prompts on EOS"
    sched = make_scheduler(requests=reqs, num_lookahead_tokens=6)
    drive(sched, FakeRunner.for_scheduler(sched, draft_right=lambda p: True))
    assert_matches_reference(reqs)  # nothing after the EOS, though the run went on past it
    assert all(r.finish_reason is FinishReason.STOP for r in reqs)


def test_lookahead_stops_at_max_tokens():
    reqs = make_requests(3, prompt_len=4, max_tokens=5)
    sched = make_scheduler(requests=reqs, num_lookahead_tokens=8)
    runner = FakeRunner.for_scheduler(sched, draft_right=lambda p: True)
    drive(sched, runner)
    assert_matches_reference(reqs)
    assert all(len(r.output_token_ids) == 5 for r in reqs)
    # after the prefill's token, one row verifies the other four: no position beyond max_tokens is computed
    assert max(row.num_tokens for p in runner.plans for row in p.rows if row.token is not None) == 4


def test_a_result_with_more_ids_than_its_row_could_verify_is_refused():
    reqs = make_requests(1, prompt_len=4, max_tokens=10)
    sched = make_scheduler(requests=reqs, num_lookahead_tokens=2)
    runner = FakeRunner.for_scheduler(sched, draft_right=lambda p: True)
    sched.update(runner.execute(sched.schedule()))  # the prefill
    plan = sched.schedule()
    assert plan.rows[0].num_tokens == 3
    bad = StepResult(plan.step_id, [plan.rows[0].slot], pack_int32([1, 2, 3, 4]), logits_shape=(1, 0),
                     num_ids=pack_int32([4]), num_drafted=pack_int32([2]))
    with pytest.raises(ValueError, match="returned 4 ids, expected 1 to 3"):
        sched.update(bad)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("arrival", range(4, 10))
def test_no_lookahead_while_the_batch_is_at_disable_by_batch_size(depth, arrival):
    long = make_requests(3, prompt_len=4, max_tokens=40, id_prefix="long", ignore_eos=True)
    late = make_requests(5, prompt_len=5, max_tokens=8, id_prefix="late", ignore_eos=True)
    sched = make_scheduler(requests=long, num_lookahead_tokens=K, lookahead_below=5)
    runner = FakeRunner.for_scheduler(sched, draft_right=every_third_wrong)
    seen = []  # (requests running when the step was planned, its plan)
    schedule = sched.schedule

    def watched():
        running = sched.num_running
        plan = schedule()
        if plan is not None:
            seen.append((running, plan))
        return plan

    def arrive_late(s, inflight):  # between steps, so the next one both verifies drafts and admits them
        if len(seen) >= arrival and late[0].arrival_seq < 0 and not any(r.num_inflight_samples for r in long):
            for r in late:
                s.add_request(r)

    sched.schedule = watched
    drive(sched, runner, depth=depth, on_step=arrive_late)
    assert_matches_reference(long + late)
    verifying = [running for running, plan in seen if any(r.token is not None and r.num_tokens > 1 for r in plan.rows)]
    assert verifying and max(verifying) < 5  # rows verify drafts only while fewer than 5 requests run
    assert any(running >= 5 for running, _ in seen)
    assert sum(r.num_draft_tokens for r in long) > 0
    if depth > 1:  # with drafting off, a row planned while its request's last is in flight pipelines
        assert any(running >= 5 and any(r.token == USE_RESIDENT for r in plan.rows) for running, plan in seen)
