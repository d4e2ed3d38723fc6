"""`raylm serve` as a user meets it: a detached engine actor, the HTTP server, the
official openai client, and cluster.connect() from another handle."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

import cluster
from cluster import SamplingParams
from cluster.remote.engine_actor import NAMESPACE
from tests.cluster.conftest import (
    SERVED_MODEL,
    aborted_requests,
    finished_requests,
    served_stats,
    wait_until_idle,
)
from tests.oracle import hf_greedy_text

pytestmark = pytest.mark.ray

KEY = "sk-test-raylm"
MODEL = SERVED_MODEL
SERVED = {"api_key": KEY, "max_body_bytes": 4096, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def server(served_engine):
    return served_engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0)


def test_health_is_503_until_loaded_then_200(server):
    assert server["loading_status"] == 503
    assert httpx.get(server["base"] + "/health").status_code == 200


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_matches_the_python_handle(server, client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    direct = server["state"].handle.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0))
    assert r.choices[0].text == direct.text
    assert r.usage.completion_tokens == len(direct.token_ids)
    assert r.usage.prompt_tokens == direct.num_prompt_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_and_streaming_with_usage(client):
    msgs = [{"role": "user", "content": "北京故宫是"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    message = whole.choices[0].message  # a thinking model may spend all 16 tokens on reasoning
    assert (text, reasoning) == (message.content or "", message.model_extra["reasoning_content"] or "")
    assert text or reasoning
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]


def test_streamed_completion_joins_to_the_whole(client):
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    for _token, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy took the best
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert len(c.choices[0].logprobs.content) == len(c.choices[0].logprobs.content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)


def test_auth_is_required_on_v1(server):
    anon = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.models.list()
    r = httpx.get(server["base"] + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("max_tokens", 0),
    ("logprobs", 21), ("temperature", "hot"), ("stop", 5), ("n", 0), ("max_tokens", 10**6),
])
def test_bad_fields_get_400_naming_the_field(server, client, field, value):
    kwargs = {"extra_body": {field: value}} if field == "top_k" else {field: value}  # top_k: a vLLM extension
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", **kwargs)
    assert field in str(e.value)
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1


def test_unknown_model_bad_json_and_big_body(server, client):
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="Hello")
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server["base"] + "/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server["base"] + "/v1/completions", headers=h,
                   content=json.dumps({"model": MODEL, "prompt": "x" * 10000}).encode())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(server["base"] + "/v1/completions", headers=h, content=json.dumps({"model": MODEL}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_metrics_count_requests_by_finish_reason(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server["base"] + "/metrics", headers=AUTH).text  # with a key, /metrics needs it too
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert lines['raylm_requests_total{finish_reason="length"}'] >= 1
    assert lines["raylm_time_to_first_token_seconds_count"] >= 1
    for g in ("raylm_requests_running", "raylm_requests_waiting", "raylm_kv_cache_usage_ratio",
              "raylm_prefix_cache_hit_rate", "raylm_bytes_pulled_per_decode_step"):
        assert g in lines
    # 3 tokens took at least a prefill and two decode steps, each with worker time
    assert lines["raylm_engine_steps_total"] >= 3 and lines["raylm_decode_steps_total"] >= 2
    assert lines["raylm_engine_steps_total"] > lines["raylm_decode_steps_total"]
    assert lines["raylm_worker_step_seconds_total"] > 0


def test_connect_gives_a_full_handle(server):
    h = cluster.connect(server["name"])
    out = h.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
    assert len(out.token_ids) == 4
    deltas = list(h.stream("Hello", SamplingParams(max_tokens=4, temperature=0)))
    assert "".join(d.text for d in deltas) == out.text
    assert h.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2)).finish_reason
    assert h.stats()["generated_tokens"] >= 4
    with pytest.raises(ValueError, match="max_tokens"):
        h.generate("Hello", SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="no raylm engine"):
        cluster.connect("no-such-engine")


def test_connect_loads_the_tokenizer_before_the_first_request(server, monkeypatch):
    """Loading it takes seconds (transformers and torch imports); `raylm serve` tokenizes on its
    event loop, so a first load inside a request would stall every request of the first burst."""
    import workers.loader

    loads = []
    real = workers.loader.load_tokenizer
    monkeypatch.setattr(workers.loader, "load_tokenizer", lambda path: loads.append(path) or real(path))
    h = cluster.connect(server["name"])
    assert len(loads) == 1  # at connect
    h.generate("Hello", SamplingParams(max_tokens=2, temperature=0))
    h.apply_chat_template([{"role": "user", "content": "hi"}])
    assert len(loads) == 1


def test_coroutines_tokenize_long_text_prompts_off_the_event_loop(server, monkeypatch):
    """A long prompt's tokenizing (~20 ms for 8K tokens) would stall every stream of the loop;
    it runs on a thread, with the same outputs. Short ones stay inline; n choices tokenize once."""
    import asyncio
    import threading

    from cluster.core.engine import LocalEngine
    from cluster.handle import OFF_LOOP_TOKENIZE_CHARS
    from cluster.remote.remote_engine import RemoteEngine

    calls = []
    for cls in (LocalEngine, RemoteEngine):
        real = cls.encode_text
        monkeypatch.setattr(cls, "encode_text",
                            lambda self, p, real=real: calls.append(threading.current_thread()) or real(self, p))
    long_prompt = ("The quick brown fox jumps over the lazy dog. " * 100)[:OFF_LOOP_TOKENIZE_CHARS + 10]
    params = SamplingParams(max_tokens=3, temperature=0)

    async def run(h, prompt):
        return await h.agenerate(prompt, params), threading.current_thread()

    with cluster.launch(num_kv_blocks=256, threads_per_worker=1) as launched:
        for h in (cluster.connect(server["name"]), launched):
            want = h.generate(long_prompt, params)
            calls.clear()
            out, loop_thread = asyncio.run(run(h, long_prompt))
            assert (out.token_ids, out.prompt, out.prompt_token_ids) == (want.token_ids, long_prompt,
                                                                         want.prompt_token_ids)
            assert len(calls) == 1 and calls[0] is not loop_thread
            calls.clear()
            _, loop_thread = asyncio.run(run(h, "Hello"))
            assert all(c is loop_thread for c in calls)  # inline (the engine's own tokenize, for a launch)
            calls.clear()
            three = h.generate("Hello", SamplingParams(max_tokens=2, temperature=0, n=3))
            assert len(three.outputs) == 3 and len(calls) == 1


def test_a_connected_handle_tokenizes_and_renders_chats_as_the_engine_would(server, ray_session):
    """connect() tokenizes text and renders chat templates in the caller's process (the
    engine actor then sees token ids only): outputs stay HF's, templates stay the engine's."""
    h = cluster.connect(server["name"])
    prompt = "Once upon a time"
    out = h.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
    [want] = hf_greedy_text([prompt], 8)
    assert out.token_ids == want[:len(out.token_ids)] and len(out.token_ids) == min(8, len(want))
    assert out.prompt == prompt and out.prompt_token_ids == h.tokenizer.encode(prompt, add_special_tokens=False)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    actor = ray_session.get_actor(server["name"], namespace=NAMESPACE)
    for kwargs in ({}, {"enable_thinking": False}):
        assert h.apply_chat_template(messages, None, kwargs) == ray_session.get(
            actor.apply_chat_template.remote(messages, None, kwargs))
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        h.apply_chat_template(messages, None, {"tokenize": True})
    with pytest.raises(ValueError, match="prompt must not be empty"):
        h.generate("", SamplingParams(max_tokens=2))


def test_tokenize_and_detokenize_round_trip_as_vllm_serves_them(server):
    base, tok = server["base"], server["state"].handle.tokenizer
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "北京故宫是"}, headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("北京故宫是") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server["state"].handle.max_model_len
    back = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, headers=AUTH)
    assert back.json() == {"prompt": "北京故宫是"}
    chat = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                      headers=AUTH)
    want = server["state"].handle.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat.json()["tokens"]) == want
    for path, bad, param in (("/tokenize", {"model": MODEL}, None),
                             ("/detokenize", {"model": MODEL, "tokens": [10**9]}, None),
                             ("/detokenize", {"model": MODEL, "tokens": "abc"}, "tokens")):
        r = httpx.post(base + path, json=bad, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# 4,000 tokens outlast a 1.5 s client timeout on every CPU seen so far (900 did not on a Zen 5)
LONG = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_non_streaming_client_that_gives_up_aborts_its_request(server):
    wait_until_idle(server)
    before, tokens_before = aborted_requests(server), served_stats(server)["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/completions", json=LONG, headers=AUTH, timeout=1.5)
    after = wait_until_idle(server)
    assert aborted_requests(server) == before + 1
    assert after["generated_tokens"] - tokens_before < LONG["max_tokens"]
    assert after["kv_blocks_used"] == 0


def test_a_streaming_client_that_disconnects_aborts_its_request(server):
    wait_until_idle(server)
    before, tokens_before = aborted_requests(server), served_stats(server)["generated_tokens"]
    with httpx.stream("POST", server["base"] + "/v1/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    after = wait_until_idle(server)
    assert aborted_requests(server) == before + 1
    assert after["generated_tokens"] - tokens_before < LONG["max_tokens"]


def test_list_prompts_return_in_input_order(server, client):
    prompts = ["Once upon a time", "Hello", "北京故宫是", "The quick brown fox jumps over the lazy dog"]
    one_by_one = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
                  for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == one_by_one
    with pytest.raises(openai.BadRequestError, match="token ids"):  # one bad prompt fails the whole request
        client.completions.create(model=MODEL, prompt=[[5, 6, 7], [10**6]], max_tokens=8)
    assert wait_until_idle(server)["kv_blocks_used"] == 0


def test_many_concurrent_streams_share_one_channel_in_order(server):
    import asyncio

    h = cluster.connect(server["name"])
    prompts = [f"request {i} says" + " hello" * (i % 5) for i in range(24)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = h.generate(prompts, params)
    before = h.stats()

    async def one(p):
        deltas = [d async for d in h.astream(p, params)]
        return deltas

    async def main():
        return await asyncio.gather(*[one(p) for p in prompts])

    streams = asyncio.run(main())
    after = h.stats()
    h.shutdown()
    for deltas, want in zip(streams, expected):
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        assert deltas[-1].output.token_ids == want.token_ids and deltas[-1].finish_reason == "length"
    deltas = after["frontend_deltas"] - before["frontend_deltas"]
    batches = after["frontend_batches"] - before["frontend_batches"]
    assert deltas >= sum(len(s) for s in streams)
    assert batches < deltas / 4, "deltas should cross in batches, not one message each"


def test_a_frontend_that_goes_away_has_its_requests_aborted(server, ray_session, tmp_path):
    import subprocess
    import sys

    wait_until_idle(server)
    before, before_length = aborted_requests(server), finished_requests(server, "length")
    script = (
        "import sys, time, cluster\n"
        f"h = cluster.connect({server['name']!r}, address={ray_session.get_runtime_context().gcs_address!r}, "
        "lease_s=1.0)\n"
        "for i in range(3):\n"
        "    h.engine.add_request('Hello', cluster.SamplingParams(max_tokens=4000, ignore_eos=True))\n"
        "print('submitted', flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "submitted"
        deadline = time.monotonic() + 60
        while served_stats(server)["num_running"] + served_stats(server)["num_waiting"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()  # no goodbye: the engine only notices the missing heartbeat
        proc.wait()
    after = wait_until_idle(server)
    # the lease runs 1 s after the kill (and the last pull's wait): 4,000 tokens take longer on the CPUs
    # seen so far (900 tokens and a 2 s lease did not on a Zen 5), but a fast host may still finish one
    aborted, finished = aborted_requests(server) - before, finished_requests(server, "length") - before_length
    assert aborted >= 1 and aborted + finished == 3
    assert after["frontends_expired"] >= 1 and after["kv_blocks_used"] == 0
