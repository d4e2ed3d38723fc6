"""`n` choices through the official openai client against a served engine on the bundled
tiny model: choice indexes and counts, streamed deltas per index, seeded reproducibility,
greedy choices equal to n=1, usage over choices, the prompt computed once for all choices,
disconnects aborting every choice, and the 400 naming `n`."""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest

from scheduler.request import MAX_N, choice_seed
from tests.cluster.conftest import SERVED_MODEL, aborted_requests, served_stats, wait_until_idle

pytestmark = pytest.mark.ray

MODEL = SERVED_MODEL
SERVED = {"num_kv_blocks": 256}
PROMPT = "Once upon a time"
SEEDED = {"temperature": 1.0, "seed": 11, "max_tokens": 24}


@pytest.fixture(scope="module")
def server(served_engine):
    return served_engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                          **kw)


def _said(message) -> str:
    """A chat message's reasoning and content (the tiny model thinks first)."""
    return ((message.model_extra or {}).get("reasoning_content") or "") + (message.content or "")


def _streamed_texts(stream, field):
    """{index: joined text}, {index: finish_reasons}, usage chunks of a stream."""
    texts, reasons, usages = defaultdict(str), defaultdict(list), []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += field(c) or ""
            if c.finish_reason is not None:
                reasons[c.index].append(c.finish_reason)
    return dict(texts), dict(reasons), usages


def test_completions_n3_are_seeded_choices_that_differ_and_reproduce(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, logprobs=0, **SEEDED)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3, texts  # each choice samples with its own seed
    again = client.completions.create(model=MODEL, prompt=PROMPT, n=3, logprobs=0, **SEEDED)
    assert [c.text for c in again.choices] == texts
    one = client.completions.create(model=MODEL, prompt=PROMPT, **SEEDED)
    assert one.choices[0].text == texts[0]  # choice 0 keeps the request's seed
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


def test_completions_n3_stream_deltas_carry_their_index(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SEEDED)
    texts, reasons, usages = _streamed_texts(
        client.completions.create(model=MODEL, prompt=PROMPT, n=3, stream=True,
                                  stream_options={"include_usage": True}, **SEEDED), lambda c: c.text)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: [c.finish_reason] for c in whole.choices}
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)]


def test_chat_n3_whole_and_streamed(client):
    whole = _chat(client, n=3, **SEEDED)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    contents = [_said(c.message) for c in whole.choices]
    # each choice samples with its own seed: what one request with that seed says (the tiny
    # model is peaked enough that two choices may still say the same; not all three)
    assert [_said(_chat(client, **{**SEEDED, "seed": choice_seed(SEEDED["seed"], i)}).choices[0].message)
            for i in range(3)] == contents
    assert len(set(contents)) > 1, contents
    assert [_said(c.message) for c in _chat(client, n=3, **SEEDED).choices] == contents
    stream = _chat(client, n=3, stream=True, stream_options={"include_usage": True}, **SEEDED)
    roles, texts, reasons, usages = defaultdict(list), defaultdict(str), defaultdict(list), []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index].append(c.delta.role)
            texts[c.index] += _said(c.delta)
            if c.finish_reason is not None:
                reasons[c.index].append(c.finish_reason)
    assert dict(roles) == {i: ["assistant"] for i in range(3)}
    assert dict(texts) == dict(enumerate(contents))
    assert dict(reasons) == {c.index: [c.finish_reason] for c in whole.choices}
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)]


def test_greedy_choices_are_identical_and_equal_n1(client):
    greedy = {"temperature": 0, "max_tokens": 12}
    one = client.completions.create(model=MODEL, prompt=PROMPT, **greedy)
    two = client.completions.create(model=MODEL, prompt=PROMPT, n=2, **greedy)
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    chat_one = _said(_chat(client, **greedy).choices[0].message)
    assert [_said(c.message) for c in _chat(client, n=2, **greedy).choices] == [chat_one] * 2


def test_list_prompts_with_n_number_choices_prompt_major(client):
    prompts = [PROMPT, "北京故宫是"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, **SEEDED)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=MODEL, prompt=p, n=2, **SEEDED) for p in prompts]
    assert [c.text for c in r.choices] == [c.text for a in alone for c in a.choices]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_choices_compute_the_prompts_full_blocks_once(server, client):
    bs = server["state"].handle.config.block_size
    prompt = "A long prompt the three choices share in the prefix cache: " + "the cat sat on the mat. " * 12
    wait_until_idle(server)
    before = served_stats(server)
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, **SEEDED)
    after = wait_until_idle(server)
    p = r.usage.prompt_tokens
    shared = (p - 1) // bs * bs  # full blocks a hit may cover (never the last prompt token)
    assert shared >= 4 * bs, "the prompt must span several blocks"
    assert after["prompt_tokens"] - before["prompt_tokens"] == p + 2 * (p - shared)
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 2 * shared
    assert after["kv_blocks_used"] == 0


@pytest.mark.parametrize("n", [0, MAX_N + 1, 1000])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_out_of_range_is_a_400_naming_n(client, n, endpoint):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            _chat(client, n=n, max_tokens=2)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, n=n, max_tokens=2)
    assert e.value.body["param"] == "n" and str(n) in e.value.body["message"]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices  # still serving


def test_best_of_other_than_n_is_refused(client):
    assert len(client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=2, max_tokens=2).choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=3, max_tokens=2)
    assert e.value.body["param"] == "best_of"


LONG = {"model": MODEL, "prompt": "Hello", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "n": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_every_choice(server, stream):
    wait_until_idle(server)
    before, tokens_before = aborted_requests(server), served_stats(server)["generated_tokens"]
    if stream:
        with httpx.stream("POST", server["base"] + "/v1/completions", json={**LONG, "stream": True},
                          timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server["base"] + "/v1/completions", json=LONG, timeout=1.5)
    after = wait_until_idle(server)
    assert aborted_requests(server) == before + 3
    assert after["generated_tokens"] - tokens_before < 3 * LONG["max_tokens"]
    assert after["kv_blocks_used"] == 0
