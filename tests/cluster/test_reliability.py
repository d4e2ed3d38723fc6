"""Faults, bad input and overload: nothing accepted is lost, nothing bad reaches a worker."""

from __future__ import annotations

import asyncio
import math
import pickle
import time

import pytest

import cluster
from cluster import EngineOverloadedError, SamplingParams
from scheduler.protocol import ProtocolError, StepPlan, StepResult
from tests.cluster.faults import GREEDY, PROMPTS, N, arm_fault, generate_in_background, wait_for_tokens
from tests.oracle import hf_greedy_text

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def expected():
    return hf_greedy_text(PROMPTS, N)


def test_killed_worker_is_replaced_and_outputs_are_unchanged(ray_session, faulty_workers, expected):
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1) as llm:
        arm_fault(llm, "sleep", after_steps=3, seconds=30)  # every request is still running when the kill lands
        t, box = generate_in_background(llm, PROMPTS, GREEDY)
        wait_for_tokens(llm, llm.stats()["generated_tokens"] + 3)
        ray_session.kill(llm.engine.replicas[0].worker, no_restart=True)
        t.join(timeout=120)
        stats = llm.stats()
    assert [o.token_ids for o in box["outs"]] == expected
    assert [o.finish_reason for o in box["outs"]] == [("stop" if len(e) < N else "length") for e in expected]
    assert stats["worker_restarts"] == 1
    assert stats["kv_blocks_used"] == 0


def test_after_the_restart_budget_requests_fail_and_other_replicas_serve(ray_session, faulty_workers):
    with cluster.launch(num_replicas=2, num_kv_blocks=64, threads_per_worker=1, max_worker_restarts=1) as llm:
        rep0 = llm.engine.replicas[0]
        arm_fault(llm, "exit", after_steps=2, replica=0)
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        streams = [llm.engine.add_request(p, long) for p in PROMPTS]
        on_rep0 = [s for s in streams if rep0.scheduler.get_request(s.request_id) is not None]
        assert on_rep0, "routing should have given replica 0 some requests"
        # The replacement dies too: the budget of one restart is spent.
        deadline = time.monotonic() + 60
        while rep0.stats.restarts < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while rep0.worker is None:
            time.sleep(0.01)
        ray_session.kill(rep0.worker, no_restart=True)
        outs = [s.result() for s in streams]
        after = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        stats = llm.stats()
    failed = [o for o in outs if o.finish_reason == "error"]
    assert failed and all("failed" in o.error for o in failed)
    assert len(failed) == len(on_rep0)
    assert all(o.finish_reason == "length" for o in outs if o not in failed)
    assert all(len(o.token_ids) == 4 for o in after)
    assert stats["replicas_alive"] == 1


def test_overload_completes_or_refuses_every_request(ray_session):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with cluster.launch(num_kv_blocks=24, block_size=4, max_num_seqs=16, max_waiting_requests=600,
                        threads_per_worker=1) as llm:

        async def flood():
            return await asyncio.gather(*[llm.agenerate(f"request {i} " * (1 + i % 5), params) for i in range(1000)],
                                        return_exceptions=True)

        results = asyncio.run(flood())
        stats = llm.stats()
        leftover = stats["open_requests"]
    refused = [r for r in results if isinstance(r, EngineOverloadedError)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(refused) + len(done) == 1000
    assert refused and done
    assert all(len(r.token_ids) == 4 and r.finish_reason == "length" for r in done)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_preemptions"] > 0
    assert leftover == 0


@pytest.mark.parametrize("prompt,params,field", [
    ("", None, "prompt"),
    ("word " * 300, None, "max_model_len"),
    (42, None, "prompt"),
    ("Hello", dict(max_tokens=0), "max_tokens"),
    ("Hello", dict(max_tokens=10**6), "max_tokens"),
    ("Hello", dict(temperature=-0.5), "temperature"),
    ("Hello", dict(temperature=math.nan), "temperature"),
    ("Hello", dict(top_p=0.0), "top_p"),
    ("Hello", dict(top_p=1.01), "top_p"),
    ("Hello", dict(top_k=-2), "top_k"),
    ("Hello", dict(logprobs=21), "logprobs"),
    ("Hello", dict(stop=[1, 2]), "stop"),
    ("Hello", dict(max_tokens="8"), "max_tokens"),
])
def test_bad_input_names_the_field_and_never_reaches_a_worker(ray_session, prompt, params, field, bad_input_engine):
    llm = bad_input_engine
    before = llm.stats()
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, SamplingParams(**params) if params else None)
    after = llm.stats()
    assert after["steps"] == before["steps"] and after["worker_restarts"] == 0
    assert len(llm.generate("Hello", SamplingParams(max_tokens=2)).token_ids) >= 1


@pytest.fixture(scope="module")
def bad_input_engine(ray_session):
    with cluster.launch(num_kv_blocks=32, max_model_len=256, threads_per_worker=1) as llm:
        yield llm


def test_protocol_refuses_pickles_and_garbage():
    evil = pickle.dumps({"step_id": 1})
    for data in (evil, b"", b"\xc1", b"\x93\x01\x02\x03"):
        with pytest.raises(ProtocolError):
            StepPlan.from_bytes(data)
        with pytest.raises(ProtocolError):
            StepResult.from_bytes(data)


def test_http_overload_is_429_in_openai_error_json(ray_session):
    import httpx

    from cluster.openai.app import ServerState, build_app

    body = {"model": "m", "prompt": "Hello", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    with cluster.launch(num_kv_blocks=32, max_num_seqs=1, max_waiting_requests=2, threads_per_worker=1) as llm:
        state = ServerState(["m"], api_key=None)
        state.handle = llm

        async def flood():
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://raylm", timeout=120) as c:
                return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(10)])

        responses = asyncio.run(flood())
        assert llm.stats()["kv_blocks_used"] == 0
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}
    refused = [r.json()["error"] for r in responses if r.status_code == 429]
    assert all(e["type"] == "rate_limit_error" and "retry" in e["message"] for e in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in responses if r.status_code == 200)


def test_with_no_replica_left_requests_fail_and_new_ones_are_refused(ray_session, faulty_workers):
    from cluster import EngineDeadError

    with cluster.launch(num_kv_blocks=32, threads_per_worker=1, max_worker_restarts=0) as llm:
        arm_fault(llm, "exit", after_steps=1)
        out = llm.generate("Hello", SamplingParams(max_tokens=8))
        with pytest.raises(EngineDeadError):
            llm.generate("Hello", SamplingParams(max_tokens=8))
        stats = llm.stats()
    assert out.finish_reason == "error" and "failed" in out.error
    assert stats["replicas_alive"] == 0
