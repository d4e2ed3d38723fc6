"""Pipelined steps, results (host-logits mode, logprobs, bad results), recovery and failure."""

import pytest

from scheduler.protocol import USE_RESIDENT, StepResult, WorkerSampling
from scheduler.request import FinishReason, RequestStatus
from tests.factories import FakeRunner, assert_matches_reference, drive, make_requests, make_scheduler, reference


def workload():
    return make_requests(10, prompt_len=lambda i: 2 + 3 * i, max_tokens=14, prefix=[9, 8, 7, 6, 5])


@pytest.mark.parametrize("cfg", [
    {}, {"num_blocks": 12, "block_size": 4, "max_num_seqs": 4}, {"max_num_batched_tokens": 7},
    {"num_blocks": 40, "block_size": 2, "enable_prefix_caching": False},
])
def test_pipelined_runs_give_the_step_by_step_sequences(cfg):
    outputs, preemptions = {}, {}
    for depth in (1, 2, 3):
        reqs = workload()
        sched = make_scheduler(**cfg, requests=reqs)
        runner = FakeRunner.for_scheduler(sched)
        drive(sched, runner, depth=depth)
        assert_matches_reference(reqs, sched.config.max_total_tokens)
        outputs[depth] = [(r.output_token_ids, r.finish_reason) for r in reqs]
        preemptions[depth] = sched.stats()["num_preemptions"]
        resident = [row for p in runner.plans for row in p.rows if row.token == USE_RESIDENT]
        assert bool(resident) == (depth > 1)
    assert outputs[1] == outputs[2] == outputs[3]
    if "num_blocks" in cfg and cfg["num_blocks"] == 12:
        assert preemptions[2] > 0  # the pipelined run did preempt and resume


def test_a_token_after_the_stopping_one_is_discarded():
    reqs = [r for r in make_requests(40, prompt_len=3, max_tokens=30)
            if reference(r.prompt_token_ids, r.params)[1] is FinishReason.STOP][:3]
    assert reqs, "the fake model should stop some prompts on EOS"
    sched = make_scheduler(requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    updates = drive(sched, runner, depth=2)
    assert_matches_reference(reqs)
    assert runner.num_sampled > len(updates) == sum(len(r.output_token_ids) for r in reqs)
    assert all(u.new_token_ids for u in updates)
    assert sum(u.finished for u in updates) == len(reqs)


@pytest.mark.parametrize("max_tokens,max_model_len", [(3, 256), (50, 8)])
def test_no_token_is_scheduled_beyond_the_limits_even_in_flight(max_tokens, max_model_len):
    [req] = make_requests(1, prompt_len=5, max_tokens=max_tokens, ignore_eos=True)
    allowed = min(max_tokens, max_model_len - req.num_prompt_tokens)
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(req)
    runner = FakeRunner.for_scheduler(sched)
    results = []
    plan = sched.schedule()
    while plan is not None:  # never update: everything schedulable is scheduled
        results.append(runner.execute(plan))
        plan = sched.schedule()
    assert sum(len(r.slots) for r in results) == allowed
    for result in results:
        sched.update(result)
    assert req.finish_reason is FinishReason.LENGTH and len(req.output_token_ids) == allowed
    assert sched.schedule().finished == [0] and sched.schedule() is None


def test_abort_with_tokens_in_flight_discards_them():
    reqs = make_requests(2, prompt_len=4, max_tokens=20, ignore_eos=True)
    sched = make_scheduler(requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    sched.update(runner.execute(sched.schedule()))
    in_flight = [runner.execute(sched.schedule()), runner.execute(sched.schedule())]
    kept = list(reqs[0].output_token_ids)
    sched.abort(reqs[0].request_id)
    updates = [u for result in in_flight for u in sched.update(result)]
    assert reqs[0].output_token_ids == kept
    assert {u.request.request_id for u in updates} == {reqs[1].request_id}
    drive(sched, runner, depth=2)
    assert_matches_reference(reqs)


def test_preempted_requests_wait_for_their_tokens_in_flight():
    reqs = make_requests(4, prompt_len=4, max_tokens=24, ignore_eos=True)
    sched = make_scheduler(num_blocks=9, block_size=4, max_num_seqs=4, requests=reqs)
    runner = FakeRunner.for_scheduler(sched)

    def check(s, inflight):
        plan = runner.plans[-1]
        for nr in plan.new_requests:
            req = next(r for r in reqs if r.slot == nr.slot)
            assert len(nr.token_ids) == req.num_tokens  # the token list it was resent with was complete
    drive(sched, runner, depth=2, on_step=check)
    assert sched.stats()["num_preemptions"] > 0
    assert_matches_reference(reqs)


def test_host_logits_mode_samples_on_the_driver():
    reqs = make_requests(3, prompt_len=lambda i: 3 + i, max_tokens=5, min_tokens=2, seed=4)
    sched = make_scheduler(requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    while sched.has_unfinished():
        plan = sched.schedule()
        device = runner.execute(plan)  # stands in for the driver's own sampling
        rows = sched.sampling_rows(plan.step_id)
        vocab = 4
        host = StepResult(plan.step_id, device.slots, b"", logits=bytes(4 * vocab * len(rows)),
                          logits_shape=(len(rows), vocab))
        for (ws, position), slot in zip(rows, device.slots):
            req = next(r for r in reqs if r.slot == slot)
            assert position == req.num_tokens  # one step in flight: it samples the next token
            assert ws == WorkerSampling.from_params(req.params, req.num_prompt_tokens, req.eos_token_ids)
        assert all(row.token != USE_RESIDENT for row in plan.rows)
        with pytest.raises(ValueError, match="sampled ids"):
            sched.update(host)  # ids not filled in yet
        host.token_ids = device.token_ids
        sched.update(host)
    assert_matches_reference(reqs)
    with pytest.raises(ValueError, match="not in flight"):
        sched.sampling_rows(10**6)


def test_logprobs_arrive_parallel_to_tokens():
    asking, silent = make_requests(2, prompt_len=4, max_tokens=6, ignore_eos=True, logprobs=3)
    silent.params.logprobs = None
    sched = make_scheduler()
    sched.add_request(asking)
    sched.add_request(silent)
    updates = drive(sched, FakeRunner.for_scheduler(sched), depth=2)
    for u in updates:
        if u.request is asking:
            assert [lp.token_id for lp in u.new_logprobs] == u.new_token_ids
            assert all(len(lp.top_ids) == 3 == len(lp.top_logprobs) for lp in u.new_logprobs)
        else:
            assert u.new_logprobs == []
    assert [lp.token_id for lp in asking.output_logprobs] == asking.output_token_ids
    assert silent.output_logprobs == []


def test_bad_results_are_refused_without_changing_state():
    reqs = make_requests(2, prompt_len=4, max_tokens=6, ignore_eos=True, logprobs=1)
    sched = make_scheduler(requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    with pytest.raises(ValueError, match="no step is in flight"):
        sched.update(StepResult(0))
    first, second = sched.schedule(), None
    r1 = runner.execute(first)
    second = sched.schedule()
    r2 = runner.execute(second)
    bad = [
        (r2, "must come first"),
        (StepResult(r1.step_id, r1.slots[::-1], r1.token_ids, r1.logprobs), "slots"),
        (StepResult(r1.step_id, r1.slots, r1.token_ids[:4], r1.logprobs), "sampled ids"),
        (StepResult(r1.step_id, r1.slots, r1.token_ids, []), "logprobs"),
    ]
    for result, message in bad:
        with pytest.raises(ValueError, match=message):
            sched.update(result)
        assert sched.num_inflight_steps == 2 and all(r.output_token_ids == [] for r in reqs)
    sched.update(r1)
    sched.update(r2)
    drive(sched, runner)
    assert_matches_reference(reqs)


@pytest.mark.parametrize("depth", [1, 2])
def test_recover_recomputes_everything_with_the_same_outputs(depth):
    reqs = workload()
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_seqs=4, requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    lost = []
    for _ in range(12):
        lost.append(runner.execute(sched.schedule()))
        if len(lost) == depth:
            sched.update(lost.pop(0))
    running = [r for r in reqs if r.status is RequestStatus.RUNNING]
    assert running and sched.num_inflight_steps == len(lost)
    sched.recover()
    assert sched.num_inflight_steps == 0 and sched.stats()["kv_blocks_used"] == 0
    assert sched.num_running == 0 and sched.num_waiting == sum(not r.is_finished for r in reqs)
    if lost:
        with pytest.raises(ValueError):
            sched.update(lost[0])
    fresh = FakeRunner.for_scheduler(sched)  # the restarted worker knows nothing
    plan = sched.schedule()
    admitted = [next(r for r in reqs if r.slot == nr.slot) for nr in plan.new_requests]
    assert admitted == sorted(admitted, key=lambda r: r.arrival_seq)  # arrival order
    assert admitted[0] is min((r for r in reqs if not r.is_finished), key=lambda r: r.arrival_seq)
    sched.update(fresh.execute(plan))
    drive(sched, fresh, depth=depth)
    assert_matches_reference(reqs)


def test_fail_all_finishes_everything_with_the_message():
    reqs = make_requests(5, prompt_len=4, max_tokens=8)
    sched = make_scheduler(max_num_seqs=2, requests=reqs)
    runner = FakeRunner.for_scheduler(sched)
    sched.update(runner.execute(sched.schedule()))
    in_flight = runner.execute(sched.schedule())
    unfinished = [r for r in reqs if not r.is_finished]
    failed = sched.fail_all("worker died")
    assert failed == unfinished
    assert all(r.finish_reason is FinishReason.ERROR and r.error == "worker died" for r in failed)
    assert not sched.has_unfinished() and sched.stats()["kv_blocks_used"] == 0
    assert sched.update(in_flight) == []  # late tokens are discarded
    assert sorted(sched.schedule().finished) == [0, 1]  # the worker is told to drop them


def test_a_request_on_the_worker_at_every_failure_is_failed_and_the_rest_recompute_the_same():
    """recover(max_failures=2): the request on the worker at two failures in a row is failed; those
    with one failure on record are admitted one at a time, and a sampled token clears the record."""
    reqs = make_requests(3, prompt_len=6, max_tokens=6)
    pill = reqs[2]
    sched = make_scheduler(max_num_seqs=4, requests=reqs)
    FakeRunner.for_scheduler(sched).execute(sched.schedule())  # all three admitted; the worker dies
    assert sched.recover(max_failures=2) == [] and sched.stats()["suspect_requests"] == 3
    runner = FakeRunner.for_scheduler(sched)
    plan = sched.schedule()
    assert [nr.slot for nr in plan.new_requests] == [reqs[0].slot]  # suspects one at a time, oldest first
    sched.update(runner.execute(plan))  # its first token: no longer a suspect
    assert reqs[0].num_failures == 0 and sched.stats()["suspect_requests"] == 2
    plan = sched.schedule()  # the next suspect joins (reqs[0] decodes beside it)
    assert [nr.slot for nr in plan.new_requests] == [reqs[1].slot]
    sched.update(runner.execute(plan))
    plan = sched.schedule()
    assert [nr.slot for nr in plan.new_requests] == [pill.slot]
    runner.execute(plan)  # the pill takes the worker down again
    failed = sched.recover(max_failures=2)
    assert failed == [pill] and pill.finish_reason is FinishReason.ERROR and "r2" in pill.error
    assert sched.stats()["poisoned_requests"] == 1 and sched.stats()["suspect_requests"] == 2
    drive(sched, FakeRunner.for_scheduler(sched))
    assert_matches_reference(reqs[:2])
    assert sched.stats()["suspect_requests"] == 0


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("cfg", [{}, {"num_blocks": 12, "block_size": 4, "max_num_seqs": 4}])
def test_pipeline_stages_take_disjoint_batches_in_turn(stages, depth, cfg):
    """With max_concurrent_batches B (pipeline stages) any B consecutive steps hold disjoint
    requests and the decodes split about evenly over them; with more than B steps in flight
    (depth 2 a stage) a request whose token is still in flight re-enters on its resident token,
    as with one stage. The sequences are the step-by-step ones either way."""
    reqs = workload()
    sched = make_scheduler(**cfg, requests=reqs, max_concurrent_batches=stages)
    runner = FakeRunner.for_scheduler(sched)
    inflight, sizes, resident = [], [], 0  # the results of the steps in flight
    while sched.has_unfinished():
        while len(inflight) < stages * depth and (plan := sched.schedule()) is not None:
            decodes = {row.slot: row for row in plan.rows if row.token is not None}
            recent = set().union(*(r.slots for r in inflight if r.step_id > plan.step_id - stages))
            assert not recent & decodes.keys()  # none sampled by the B - 1 steps before, if in flight
            waiting = decodes.keys() & set().union(*(r.slots for r in inflight))
            assert all(decodes[s].token == USE_RESIDENT for s in waiting)  # the token still in flight
            resident += len(waiting)
            sizes.append(len(decodes))
            inflight.append(runner.execute(plan))  # the worker computes steps in order as they come
        sched.update(inflight.pop(0))
    assert_matches_reference(reqs, sched.config.max_total_tokens)
    running = len(reqs) if not cfg else cfg["max_num_seqs"]
    assert max(sizes) <= -(-running // stages)  # no step takes more than its share of the decodes
    assert (resident > 0) == (depth > 1)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_burst_of_arrivals_spreads_over_the_stages_batches(stages):
    """Requests arriving together are admitted over B steps, about 1/B each (with one stage, all
    that fit at once): every stage prefills a batch of its own instead of one waiting on another."""
    reqs = make_requests(12, prompt_len=4, max_tokens=6)
    sched = make_scheduler(requests=reqs, max_num_seqs=12, max_num_batched_tokens=256, max_concurrent_batches=stages)
    runner = FakeRunner.for_scheduler(sched)
    plans = [sched.schedule() for _ in range(stages)]
    assert [len(p.new_requests) for p in plans] == [12 // stages] * stages
    for plan in plans:
        sched.update(runner.execute(plan))
    drive(sched, runner, depth=2 * stages)
    assert_matches_reference(reqs, sched.config.max_total_tokens)
