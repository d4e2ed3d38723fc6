"""raylm as a Ray Serve application on a two-node local Ray: two engines (one per node, each
with its worker on that node's faked NPU) behind the ingress; the openai client; prefix-aware
routing; an engine killed under a 1,000-request flood. `make test-serve`."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytestmark = [pytest.mark.serve, pytest.mark.timeout(900)]

APP = "raylm"
ENGINE = {"device": "cpu", "accelerator_resource": "NPU", "max_num_seqs": 16, "max_num_batched_tokens": 512,
          "max_waiting_requests": 2000}
PROMPTS = ["北京故宫是", "The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


def alive_actors(class_name: str) -> list:
    from ray.util.state import list_actors

    return list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")], limit=1000)


def engines_running(app: str = APP) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return 0
    counts = status.deployments["RaylmEngine"].replica_states
    return counts.get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def two_engines(serve_cluster):
    from ray import serve

    from cluster.serve import build_openai_app

    _, base = serve_cluster
    serve.run(build_openai_app(ENGINE, num_engines=2), name=APP, route_prefix="/")
    yield base
    serve.delete(APP)


def test_two_engines_on_two_nodes_serve_the_openai_client(two_engines):
    import openai

    from cluster import SamplingParams
    from cluster.serve import connect_app
    from tests.oracle import hf_greedy_text

    workers = alive_actors("WorkerActor")
    assert len(workers) == 2 and len({w.node_id for w in workers}) == 2  # one engine's worker per node

    client = openai.OpenAI(base_url=two_engines + "/v1", api_key="unused", max_retries=0)
    texts = [None] * len(PROMPTS)

    def ask(i):
        texts[i] = client.completions.create(model="tiny-qwen3", prompt=PROMPTS[i], max_tokens=12,
                                             temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    llm = connect_app(APP)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == hf_greedy_text(PROMPTS, 12)
    assert texts == [o.text for o in outs]

    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model="tiny-qwen3", messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-qwen3", messages=messages, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join((c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", None)
                                                              or "") for c in chunks if c.choices)
    joined = (whole.choices[0].message.content or "") + (getattr(whole.choices[0].message, "reasoning_content", None)
                                                         or "")
    assert streamed and sorted(streamed) == sorted(joined)  # reasoning and content parts, in stream order
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    bad = client.completions.with_raw_response
    with pytest.raises(openai.BadRequestError, match="temperature"):
        bad.create(model="tiny-qwen3", prompt="x", temperature=-1)
    assert llm.health()["status"] == "ok"


def test_requests_sharing_a_prefix_go_to_the_engine_that_cached_it(two_engines):
    from cluster import SamplingParams
    from cluster.serve import connect_app

    llm = connect_app(APP)
    prefix = "A long shared system prompt about the history of the Forbidden City. " * 6
    params = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate(prefix + "Question 0?", params)
    assert first.metrics.num_cached_tokens == 0
    later = [llm.generate(prefix + f"Question {i}?", params) for i in range(1, 9)]
    # two engines: a router blind to prefixes would send about half of these where nothing is cached
    assert all(o.metrics.num_cached_tokens >= 64 for o in later), [o.metrics.num_cached_tokens for o in later]


def test_an_engine_killed_under_a_flood_loses_no_request(two_engines):
    import ray

    from cluster import SamplingParams
    from cluster.errors import EngineDeadError, EngineOverloadedError
    from cluster.serve import connect_app

    llm = connect_app(APP)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    victim = alive_actors("ServeReplica:raylm:RaylmEngine")[0]

    async def flood():
        tasks = [asyncio.ensure_future(llm.agenerate(f"request {i} " * (1 + i % 5), params)) for i in range(1000)]
        while sum(t.done() for t in tasks) < 100:
            await asyncio.sleep(0.05)
        ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 600)

    results = asyncio.run(flood())
    done = [r for r in results if not isinstance(r, BaseException) and r.finish_reason == "length"]
    failed = [r for r in results if not isinstance(r, BaseException) and r.finish_reason == "error"]
    refused = [r for r in results if isinstance(r, (EngineOverloadedError, EngineDeadError))]
    assert len(done) + len(failed) + len(refused) == 1000, [r for r in results if isinstance(r, BaseException)][:3]
    assert all(len(r.token_ids) == 8 for r in done)
    assert all("lost the engine" in r.error and len(r.token_ids) < 8 for r in failed)  # its tokens so far
    assert len(done) > 900
    wait_for(lambda: engines_running() == 2, 120, "Serve replaced the killed engine")
    for _ in range(8):  # whichever engine answers: nothing left running or holding KV blocks
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["open_requests"] == 0
