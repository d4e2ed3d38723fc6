"""Hostile requests against a served engine: each is answered with a 400 naming the field (or a
documented bound), the replica never dies, and a concurrent stream keeps flowing while it is
served. The served engine here compiles grammars with a short deadline so that one schema
runs past it (SERVED)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

from tests.cluster.conftest import SERVED_MODEL, served_stats, wait_until_idle
from workers.sampling.grammar import xgrammar_available

pytestmark = pytest.mark.ray

# as raylm serve runs (structured output prepared at start), with a grammar deadline short enough for a
# schema to run past it, and request templates trusted so that template bombs reach the renderer
SERVED = {"engine": {"prepare_structured_output": True, "grammar_compile_timeout_s": 1.0,
                     "max_grammar_bytes": 200_000, "trust_request_chat_template": True}}
GAP_BOUND_S = 2.5  # a stall guard under a loaded test run; the suite prints the gaps it measured

INT_BOMBS = {
    "seed 2**70": ({"seed": 2**70, "temperature": 1}, "seed"),
    "seed -2**70": ({"seed": -(2**70), "temperature": 1}, "seed"),
    "top_k 2**70": ({"top_k": 2**70}, "top_k"),
    "stop id 2**70 with min_tokens": ({"stop_token_ids": [2**70], "min_tokens": 2}, "stop_token_ids"),
    "stop id past the vocab with min_tokens": ({"stop_token_ids": [5000], "min_tokens": 2}, "stop_token_ids"),
    "temperature 1e308": ({"temperature": 1e308}, "temperature"),
    "repetition_penalty 1e-300": ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    "logit_bias id 2**70": ({"logit_bias": {str(2**70): 1}}, "logit_bias"),
    "max_tokens 10**12": ({"max_tokens": 10**12}, "max_tokens"),
}


def completion(base: str, **fields) -> httpx.Response:
    body = {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 4, **fields}
    return httpx.post(f"{base}/v1/completions", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("fields, field", INT_BOMBS.values(), ids=INT_BOMBS.keys())
def test_an_out_of_range_value_is_a_400_naming_its_field(served_engine, fields, field):
    r = completion(served_engine["base"], **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_after_every_bomb_the_replica_serves_and_health_is_ok(served_engine):
    base = served_engine["base"]
    for fields, _ in INT_BOMBS.values():
        completion(base, **fields)
    r = completion(base, temperature=0)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    stats = served_stats(served_engine)
    assert stats["worker_restarts"] == 0 and stats["loop_failures"] == 0
    assert httpx.get(f"{base}/health").json()["status"] == "ok"


class TimedStream:
    """A long greedy stream on a thread, recording when each chunk arrived."""

    def __init__(self, base: str, max_tokens: int = 1500):
        self.times: list[float] = []
        self.finish_reason = None
        body = {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(base, body), daemon=True)
        self._thread.start()

    def _run(self, base, body) -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.monotonic())
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                    self.finish_reason = reason or self.finish_reason

    def wait_started(self, n: int = 5) -> None:
        deadline = time.monotonic() + 60
        while len(self.times) < n:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.01)

    def largest_gap(self, start: float, end: float) -> float:
        """The longest wait for a chunk between `start` and `end` (monotonic)."""
        points = [start] + [t for t in self.times if start < t < end] + [end]
        return max(b - a for a, b in zip(points, points[1:]))

    def join(self) -> None:
        self._thread.join(timeout=120)


def enum_schema(n: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "string", "enum": [f"value_{i}_abcdefg" for i in range(n)]}}}


@pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed (raylm[structured])")
def test_a_slow_grammar_is_refused_in_bounded_time_and_holds_no_other_stream(served_engine):
    base = served_engine["base"]
    stream = TimedStream(base)
    stream.wait_started()
    start = time.monotonic()
    slow = completion(base, response_format=enum_schema(8000))  # ~175 KB: compiles for seconds on this CPU
    slow_s = time.monotonic() - start
    again_start = time.monotonic()
    again = completion(base, response_format=enum_schema(8000))
    again_s = time.monotonic() - again_start
    huge = completion(base, response_format=enum_schema(20000))
    small = completion(base, max_tokens=8, temperature=0, response_format={"type": "json_object"})
    end = time.monotonic()
    gap = stream.largest_gap(start, end)
    stream.join()
    print(f"\nslow grammar refused after {slow_s:.2f} s, again after {again_s:.3f} s; "
          f"largest inter-token gap of a concurrent stream meanwhile: {gap:.3f} s")
    assert slow.status_code == 400 and "grammar_compile_timeout_s" in slow.json()["error"]["message"], slow.text
    assert slow_s < 10  # the deadline is 1 s; the compile itself takes seconds longer
    assert again.status_code == 400 and again.json()["error"]["message"] == slow.json()["error"]["message"]
    assert huge.status_code == 400 and "max_grammar_bytes" in huge.json()["error"]["message"], huge.text
    assert small.status_code == 200, small.text
    assert small.json()["choices"][0]["text"].startswith("{")  # other grammars compile meanwhile
    assert stream.finish_reason == "length" and len(stream.times) > 100
    assert gap < GAP_BOUND_S
    stats = wait_until_idle(served_engine)
    assert stats["grammars_refused"] == 2 and stats["worker_restarts"] == 0


# ---- a concurrent stream's largest inter-token gap while each kind of bomb is served ----
LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CHAT = [{"role": "user", "content": "hi"}]


def chat_with_template(base: str, template: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": SERVED_MODEL, "messages": CHAT, "max_tokens": 4, "chat_template": template})


def tokenize_with_template(base: str, template: str) -> httpx.Response:
    return httpx.post(f"{base}/tokenize", timeout=60, json={"model": SERVED_MODEL, "messages": CHAT,
                                                           "chat_template": template})


def open_connections(base: str, n: int, payload: bytes) -> list[socket.socket]:
    url = urlparse(base)
    conns = []
    for _ in range(n):
        c = socket.create_connection((url.hostname, url.port), timeout=5)
        if payload:
            c.sendall(payload)
        conns.append(c)
    return conns


def partial_headers(base: str) -> int:
    conns = open_connections(base, 100, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
    time.sleep(1.0)
    for c in conns:
        c.close()
    return 0


def huge_header(base: str) -> int:
    c = open_connections(base, 1, b"")[0]
    try:
        c.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (8 << 20) + b"\r\n\r\n")
    except OSError:  # the server answered 431 and closed before reading it all
        pass
    status = c.recv(64)
    c.close()
    return int(status.split(b" ")[1])


def many_template_bombs(base: str) -> int:
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: chat_with_template(base, LOOP_TEMPLATE).status_code, range(8)))
    assert set(codes) == {400}
    return 400


BOMBS = {
    "a template that repeats a string": lambda b: chat_with_template(b, "{{ 'ab' * 2000000 }}").status_code,
    "a template that loops on nothing": lambda b: chat_with_template(b, LOOP_TEMPLATE).status_code,
    "eight looping templates at once": many_template_bombs,
    "/tokenize with a looping template": lambda b: tokenize_with_template(b, LOOP_TEMPLATE).status_code,
    "100 partial-header connections": partial_headers,
    "an 8 MB header": huge_header,
}
EXPECTED_STATUS = {"100 partial-header connections": 0, "an 8 MB header": 431}


@pytest.mark.parametrize("name", BOMBS)
def test_a_concurrent_stream_keeps_flowing_while_a_bomb_is_served(served_engine, name):
    base = served_engine["base"]
    stream = TimedStream(base)
    stream.wait_started()
    start = time.monotonic()
    status = BOMBS[name](base)
    health_start = time.monotonic()
    health = httpx.get(f"{base}/health", timeout=30)
    health_s = time.monotonic() - health_start
    end = time.monotonic()
    gap = stream.largest_gap(start, end)
    stream.join()
    print(f"\n{name}: answered {status} after {health_start - start:.2f} s; /health in {health_s:.3f} s; "
          f"largest inter-token gap of a concurrent stream meanwhile: {gap:.3f} s")
    assert status == EXPECTED_STATUS.get(name, 400)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert stream.finish_reason == "length"
    assert gap < GAP_BOUND_S


@pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed (raylm[structured])")
def test_a_request_waiting_for_its_grammar_fails_with_its_replica_not_later(ray_session, faulty_workers):
    """A replica that gives up fails the requests waiting for their grammar with the reason at once,
    as it fails its scheduled ones, rather than leaving them to run out their compile deadline."""
    import cluster
    from cluster import SamplingParams
    from scheduler.grammar_spec import GrammarSpec
    from tests.cluster.faults import arm_fault, generate_in_background

    schema = json.dumps(enum_schema(8000)["json_schema"]["schema"])  # compiles for seconds
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1, max_worker_restarts=0, max_grammar_bytes=1 << 20,
                        grammar_compile_timeout_s=60) as llm:
        arm_fault(llm, "exit", after_steps=3)
        stream, box = generate_in_background(llm, ["Hello"], SamplingParams(max_tokens=200, ignore_eos=True))
        t0 = time.monotonic()
        held = llm.generate("Hi", SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", schema)))
        waited = time.monotonic() - t0
        stream.join(timeout=60)
    assert held.finish_reason == "error" and "worker failed" in held.error, held.error
    assert box["outs"][0].finish_reason == "error"
    assert waited < 30  # not the 60 s compile deadline
