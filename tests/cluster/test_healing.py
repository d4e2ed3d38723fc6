"""/health tells the truth and replicas heal: worker deaths within the restart budget are
restarted, beyond it the replica is down (503 with Retry-After at once, never a hang),
and after the cool-down it serves again."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import cluster
from cluster import EngineDeadError, SamplingParams
from cluster.openai.app import ServerState, build_app

pytestmark = pytest.mark.ray

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
BODY = {"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def _wait(predicate, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill_worker_mid_step(ray_session, llm, index: int):
    """Start a long request on replica `index`, kill its worker once it is generating."""
    rep = llm.engine.replicas[index]
    failures = rep.health_state.budget.total_restarts + rep.health_state.budget.give_ups
    _wait(lambda: rep.health_state.state == "up", f"replica {index} up")
    steps = rep.stats.steps
    stream = llm.engine.add_request("Hello", LONG)
    _wait(lambda: rep.stats.steps > steps + 1, "a step on the replica")
    ray_session.kill(rep.worker, no_restart=True)
    _wait(lambda: rep.health_state.budget.total_restarts + rep.health_state.budget.give_ups > failures,
          "the failure to be noticed")
    return stream


def _http(llm, *requests):
    """Run (method, path, json) requests against the OpenAI app over the handle."""
    state = ServerState(["m"], api_key=None)
    state.handle = llm

    async def go():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://raylm", timeout=60) as c:
            return [await c.request(m, p, json=j) for m, p, j in requests]

    return asyncio.run(go())


def _metric(text: str, name: str) -> float:
    return next(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_health_is_degraded_then_503_with_the_reason_and_requests_fail_fast(ray_session):
    with cluster.launch(num_replicas=2, num_kv_blocks=64, threads_per_worker=1, max_worker_restarts=0,
                        replica_cooldown_s=600) as llm:
        ok, = _http(llm, ("GET", "/health", None))
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
        lost = _kill_worker_mid_step(ray_session, llm, 0).result()
        assert lost.finish_reason == "error"
        health, served, metrics = _http(llm, ("GET", "/health", None), ("POST", "/v1/completions", BODY),
                                        ("GET", "/metrics", None))
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        states = {r["replica"]: r for r in health.json()["replicas"]}
        assert states[0]["state"] == "down" and "died" in states[0]["last_error"]
        assert states[1]["state"] == "up"
        assert served.status_code == 200  # replica 1 serves
        assert _metric(metrics.text, 'raylm_replica_up{replica="0"}') == 0.0
        assert _metric(metrics.text, 'raylm_replica_up{replica="1"}') == 1.0
        assert _metric(metrics.text, 'raylm_replica_give_ups_total{replica="0"}') == 1.0

        _kill_worker_mid_step(ray_session, llm, 1).result()
        t0 = time.monotonic()
        health, refused = _http(llm, ("GET", "/health", None), ("POST", "/v1/completions", BODY))
        elapsed = time.monotonic() - t0
        with pytest.raises(EngineDeadError) as e:
            llm.generate("Hello", SamplingParams(max_tokens=2))
        stats = llm.stats()
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert "no replica can serve" in health.json()["reason"]
    assert int(health.headers["Retry-After"]) > 60  # the cool-down, not a guess
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert int(refused.headers["Retry-After"]) > 60
    assert elapsed < 30, "refusals must be immediate, not wait for a replica"
    assert e.value.retry_after_s > 60
    assert [r["state"] for r in stats["replicas"]] == ["down", "down"] and stats["replicas_alive"] == 0


@pytest.mark.heavy
def test_a_replica_heals_after_repeated_worker_deaths(ray_session):
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1, max_worker_restarts=2, restart_window_s=300,
                        restart_backoff_s=0.05, replica_cooldown_s=3) as llm:
        rep = llm.engine.replicas[0]
        first = _kill_worker_mid_step(ray_session, llm, 0)
        _wait(lambda: rep.health_state.state == "up", "the first restart")
        assert first.result().finish_reason == "length"  # recomputed, not lost
        _kill_worker_mid_step(ray_session, llm, 0)
        _wait(lambda: rep.health_state.state == "up", "the second restart")
        third = _kill_worker_mid_step(ray_session, llm, 0)  # over the budget of 2 in the window
        assert third.result().finish_reason == "error"
        assert rep.health_state.state == "down"
        health, = _http(llm, ("GET", "/health", None))
        assert health.status_code == 503
        _wait(lambda: rep.health_state.state == "up", "the rejoin after the cool-down")
        out = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        health, = _http(llm, ("GET", "/health", None))
        stats = llm.stats()
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r0 = stats["replicas"][0]
    assert r0["restarts"] == 2 and r0["give_ups"] == 1 and r0["rejoins"] == 1
    assert stats["kv_blocks_used"] == 0
