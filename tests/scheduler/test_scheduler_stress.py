"""Randomized arrivals, aborts, driver-side stops, worker restarts and tiny pools.

Invariants are checked after every schedule() and update(): free + used = total, no
negative reference counts, reference counts equal the running requests' block tables,
every running request's blocks cover its computed tokens, and nothing is used at the end.
Outputs must equal (or, when cut short, be a prefix of) an uninterrupted run's.
"""

import random
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.request import FinishReason, Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from tests.factories import EOS, FakeRunner, assert_matches_reference, check_invariants

BASES = [[100 + (b * 37 + j * 11) % 50 for j in range(48)] for b in range(3)]  # shared prefixes


def can_run(cfg: SchedulerConfig, n: int) -> bool:
    return n < cfg.max_model_len and -(-(n + 1) // cfg.block_size) <= cfg.num_blocks


def simulate(cfg: SchedulerConfig, specs, events, depth: int) -> None:
    """specs: (arrival step, Request); events: {step: [("abort"|"stop", index) | ("recover", None)]}."""
    sched = Scheduler(cfg)
    runner = FakeRunner.for_scheduler(sched)
    inflight: deque = deque()
    added, ended_early = [], set()
    arrivals = sorted(specs, key=lambda s: s[0])
    t = 0
    while arrivals or sched.has_unfinished() or inflight:
        while arrivals and arrivals[0][0] <= t:
            req = arrivals.pop(0)[1]
            if can_run(cfg, req.num_tokens):
                sched.add_request(req)
                added.append(req)
            else:
                try:
                    sched.add_request(req)
                    raise AssertionError("a request that can never run was accepted")
                except ValueError as e:
                    assert req.request_id in str(e)
        for kind, index in events.get(t, ()):
            if kind == "recover":
                sched.recover()
                inflight.clear()
                runner = FakeRunner.for_scheduler(sched)
            elif index < len(added):
                req = added[index]
                was_running = not req.is_finished
                reason = FinishReason.ABORT if kind == "abort" else FinishReason.STOP
                assert sched.finish(req.request_id, reason) is (req if was_running else None)
                if was_running:
                    ended_early.add(req.request_id)
        plan = sched.schedule() if len(inflight) < depth else None
        if plan is not None:
            assert plan.num_tokens <= cfg.max_num_batched_tokens and len(plan.rows) <= cfg.max_num_seqs
            assert not (plan.preempted and plan.new_requests), "admitted while preempting"
            inflight.append(runner.execute(plan))
        elif inflight:
            sched.update(inflight.popleft())
        elif sched.has_unfinished():
            raise AssertionError("stalled")
        check_invariants(sched)
        t += 1
        assert t < 20_000, "did not finish"
    assert sched.stats()["kv_blocks_used"] == 0 and sched.num_running == sched.num_waiting == 0
    assert all(r.is_finished for r in added)
    assert_matches_reference(added, cfg.max_total_tokens, cut_short=ended_early)
    for r in added:
        assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)
        if r.request_id not in ended_early:
            assert r.finish_reason is not FinishReason.ABORT


@st.composite
def scenarios(draw):
    cfg = SchedulerConfig(
        num_blocks=draw(st.integers(2, 40)),
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        max_model_len=draw(st.integers(4, 80)),
        enable_prefix_caching=draw(st.booleans()),
    )
    specs = []
    for i in range(draw(st.integers(1, 10))):
        base = BASES[draw(st.integers(0, len(BASES) - 1))]
        prompt = base[:draw(st.integers(1, 30))] + draw(st.lists(st.integers(64, 99), max_size=4))
        max_tokens = draw(st.integers(1, 20))
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()), stop_token_ids=draw(st.lists(st.integers(0, 63), max_size=2)),
            logprobs=draw(st.sampled_from([None, 0, 2])))
        eos = frozenset(draw(st.sampled_from([[EOS], [EOS, 3], []])))
        specs.append((draw(st.integers(0, 40)), Request(f"q{i}", prompt, params, eos_token_ids=eos)))
    events = {}
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["abort", "stop", "recover"]))
        events.setdefault(draw(st.integers(0, 80)), []).append((kind, draw(st.integers(0, 9))))
    return cfg, specs, events, draw(st.sampled_from([1, 2]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_scenarios_keep_invariants_and_outputs(scenario):
    simulate(*scenario)


def test_seeded_heavy_runs():
    for seed in range(6):
        rng = random.Random(seed)
        cfg = SchedulerConfig(num_blocks=rng.randint(12, 30), block_size=rng.choice([2, 4]),
                              max_num_seqs=rng.randint(3, 8), max_num_batched_tokens=rng.randint(8, 48),
                              max_model_len=64, enable_prefix_caching=True)
        specs = []
        for i in range(80):
            prompt = rng.choice(BASES)[:rng.randint(1, 28)] + [rng.randint(64, 99) for _ in range(rng.randint(0, 3))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
            specs.append((rng.randint(0, 300), Request(f"s{seed}-{i}", prompt, params, eos_token_ids={EOS})))
        events = {rng.randint(0, 400): [(rng.choice(["abort", "stop"]), rng.randint(0, 79))] for _ in range(8)}
        events.setdefault(rng.randint(50, 200), []).append(("recover", None))
        simulate(cfg, specs, events, depth=1 + seed % 2)
