"""`raylm serve`'s default frontend: the HTTP server inside the engine actor's process
(cluster/openai/http_server.py), with cluster.connect() handles attached over the channel beside it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
import ray

import cluster
from cluster import SamplingParams
from cluster.config import DEFAULT_GIL_SWITCH_INTERVAL_MS
from cluster.openai.serving_config import ServingConfig
from cluster.remote.engine_actor import NAMESPACE, launch_detached
from tests.cluster.conftest import (
    SERVED_MODEL,
    aborted_requests,
    free_port,
    log_tail,
    start_raylm_serve,
    wait_healthy,
    wait_until_idle,
)

pytestmark = pytest.mark.ray


def _spec(port: int) -> ServingConfig:
    return ServingConfig(model_names=(SERVED_MODEL,), port=port, access_log=False)


def _gone(ray_session, name: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray_session.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def embedded(ray_session, tmp_path_factory):
    """`raylm serve` at its default, --frontend engine, started as a user would; its
    engine also reached over the channel by a connect() handle."""
    name = "embedded-http"
    proc, log, base = start_raylm_serve(ray_session, tmp_path_factory.mktemp("embedded") / "serve.log", name,
                                        "engine", api_key="")
    try:
        seen = wait_healthy(proc, log, base)
        handle = cluster.connect(name)
        yield {"base": base, "name": name, "seen": seen, "proc": proc, "log": log,
               "state": SimpleNamespace(handle=handle)}
        handle.shutdown()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)


def test_health_says_loading_until_the_engine_is_up(embedded):
    assert (503, "loading") in [(code, body["status"]) for code, body in embedded["seen"]]
    r = httpx.get(embedded["base"] + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    # the engine's process (HTTP thread and step loop on one GIL) switches threads at the CLI's default
    info = embedded["state"].handle.engine.info
    assert info["gil_switch_interval_ms"] == pytest.approx(DEFAULT_GIL_SWITCH_INTERVAL_MS)


def test_http_requests_skip_the_channel_and_equal_a_connected_handles(embedded):
    h = embedded["state"].handle
    prompts = [f"request {i} says" + " hello" * (i % 4) for i in range(16)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = [o.text for o in h.generate(prompts, params)]  # over the channel
    before = h.stats()

    async def stream(client, p):
        body = {"model": SERVED_MODEL, "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text = []
        async with client.stream("POST", embedded["base"] + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(text)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[stream(client, p) for p in prompts])

    assert asyncio.run(main()) == expected
    r = httpx.post(embedded["base"] + "/v1/completions", timeout=60,
                   json={"model": SERVED_MODEL, "prompt": prompts[:3], "max_tokens": 10, "temperature": 0,
                         "ignore_eos": True})
    assert [c["text"] for c in r.json()["choices"]] == expected[:3]
    after = h.stats()
    assert after["frontend_deltas"] == before["frontend_deltas"]  # none of it crossed the channel
    assert after["generated_tokens"] - before["generated_tokens"] == 19 * 10
    assert wait_until_idle(embedded)["kv_blocks_used"] == 0


def test_a_streaming_client_that_disconnects_aborts_its_request(embedded):
    wait_until_idle(embedded)
    before = aborted_requests(embedded)
    body = {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", embedded["base"] + "/v1/completions", json=body, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: ")
    after = wait_until_idle(embedded)
    assert aborted_requests(embedded) == before + 1
    assert after["kv_blocks_used"] == 0


def test_a_port_in_use_is_an_error_naming_it_and_leaves_no_engine(ray_session):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            launch_detached(cluster.EngineConfig(threads_per_worker=1), "embedded-port-taken", http=_spec(port))
    assert _gone(ray_session, "embedded-port-taken")


def test_an_engine_that_cannot_start_leaves_health_503_with_the_reason(ray_session, tmp_path):
    port = free_port()
    actor, started = launch_detached(cluster.EngineConfig(model=str(tmp_path), threads_per_worker=1),
                                     "embedded-bad-model", http=_spec(port))
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="config.json|model"):
            ray_session.get(started, timeout=120)
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert r.status_code == 503
        assert r.json()["status"] == "unavailable" and "engine failed to start" in r.json()["reason"]
        assert r.headers["Retry-After"]
    finally:
        ray_session.kill(actor, no_restart=True)


COLOR = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
         "required": ["color"], "additionalProperties": False}


def test_chat_n_choices_and_json_output_through_the_local_handle(embedded):
    base = embedded["base"] + "/v1/chat/completions"
    messages = [{"role": "user", "content": "Name a color."}]
    r = httpx.post(base, timeout=120, json={"model": SERVED_MODEL, "messages": messages, "n": 2, "seed": 7,
                                            "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    again = httpx.post(base, timeout=120, json={"model": SERVED_MODEL, "messages": messages, "n": 2, "seed": 7,
                                                "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in again.json()["choices"]] == \
        [c["message"]["content"] for c in r.json()["choices"]]  # seeded per choice
    assert 2 <= r.json()["usage"]["completion_tokens"] <= 16  # summed over both choices
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}}
    js = httpx.post(base, timeout=120, json={"model": SERVED_MODEL, "messages": messages, "max_tokens": 200,
                                             "response_format": fmt, "temperature": 0})
    assert js.status_code == 200, js.text
    choice = js.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])["color"] in COLOR["properties"]["color"]["enum"]
    bad = httpx.post(base, timeout=30, json={"model": SERVED_MODEL, "messages": messages, "n": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_raylm_serve_exits_with_an_error_when_its_engine_dies(embedded, ray_session):  # last: it ends the server
    ray_session.kill(ray_session.get_actor(embedded["name"], namespace=NAMESPACE), no_restart=True)
    assert embedded["proc"].wait(timeout=60) == 1, log_tail(embedded["log"])
    assert "the engine actor died" in log_tail(embedded["log"])
