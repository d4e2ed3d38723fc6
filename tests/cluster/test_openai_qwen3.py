"""What Qwen3 users ask of the OpenAI server, through the official openai client against a
served engine on the bundled (trained) tiny model: thinking on and off, tool calls parsed
from the model's own output (whole and streamed), tool results in a later turn, forced
calls, penalties and logit_bias, and a 400 naming the field for each bad value."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import openai
import pytest

import cluster
from tests.cluster.conftest import SERVED_MODEL
from workers.tiny_model.corpus import TOOLS

pytestmark = pytest.mark.ray

MODEL = SERVED_MODEL
SERVED = {"num_kv_blocks": 128}
WEATHER, TIME = TOOLS["get_weather"], TOOLS["get_time"]


@pytest.fixture(scope="module")
def base(served_engine):
    return served_engine["base"]


@pytest.fixture
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _chat(client, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def _joined(stream):
    """(reasoning, content, tool calls by index, finish_reason) of a streamed reply."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for c in d.tool_calls or []:
                slot = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = c.id or slot["id"]
                slot["name"] += (c.function.name or "") if c.function else ""
                slot["arguments"] += (c.function.arguments or "") if c.function else ""
            reason = choice.finish_reason or reason
    return reasoning, content, [calls[i] for i in sorted(calls)], reason


def test_thinking_on_splits_reasoning_from_the_answer(client):
    r = _chat(client, "What is the capital of France?")
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert msg.content.startswith("The capital of ") and "think>" not in msg.content
    assert r.choices[0].finish_reason == "stop"
    streamed = _joined(_chat(client, "What is the capital of France?", stream=True))
    assert streamed == (reasoning, msg.content, [], "stop")


def test_thinking_off_through_chat_template_kwargs(client):
    r = _chat(client, "What is the capital of France?", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] is None
    assert msg.content.startswith("The capital of ") and "think>" not in msg.content


def test_a_tool_call_from_the_models_own_output_whole_and_streamed(client):
    r = _chat(client, "What is the weather in Paris?", tools=[TIME, WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    # the tiny model picks the right tool but not always the right city: it knows its corpus only
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    reasoning, content, calls, reason = _joined(_chat(client, "What is the weather in Paris?", tools=[TIME, WEATHER],
                                                      stream=True))
    assert reason == "tool_calls" and content == "" and reasoning == choice.message.model_extra["reasoning_content"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_tool_results_come_back_in_a_tool_turn(client):
    first = _chat(client, "What is the weather in Tokyo?", tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "What is the weather in Tokyo?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"city": "Tokyo", "condition": "rainy", "temperature": 12})}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=96)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "degrees" in r.choices[0].message.content  # an answer from the tool's result, not another call


def test_tool_choice_none_required_and_named(client):
    none = _chat(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="none")
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason == "stop"
    required = _chat(client, "What is the capital of France?", tools=[WEATHER], tool_choice="required")
    [call] = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert required.choices[0].finish_reason == "tool_calls"
    named = _chat(client, "What time is it in Paris?", tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments), dict)
    streamed = _joined(_chat(client, "What time is it in Paris?", tools=[WEATHER, TIME], stream=True,
                             tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert [(c["name"], c["arguments"]) for c in streamed[2]] == [("get_time", call.function.arguments)]


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
]


@pytest.mark.parametrize("extra,field", BAD)
def test_bad_values_are_a_400_naming_the_field(base, extra, field):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field.split(".")[0].split("[")[0] in err["message"]
    assert httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


# ---- penalties and logit_bias ----------------------------------------------------------------

def _tokenizer():
    from workers.loader import bundled_model_path, load_tokenizer

    return load_tokenizer(bundled_model_path())


def test_logit_bias_forces_a_token_under_greedy(client):
    tok = _tokenizer()
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    [forced] = tok.encode(" river", add_special_tokens=False)
    assert " river" not in plain.choices[0].text
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 8) and r.choices[0].finish_reason == "length"
    banned = tok.encode(plain.choices[0].text, add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  logit_bias={str(banned): -100})
    assert banned not in tok.encode(r.choices[0].text, add_special_tokens=False)


def test_frequency_penalty_stops_the_greedy_model_repeating_a_token(served_engine, base, client):
    """Greedy with EOS ignored, the tiny model repeats EOS; a frequency penalty lowers a token's
    logit by 2 for each time it was generated, so the most repeated token comes back less often."""
    handle = served_engine["state"].handle
    prompt = "The quick brown fox"
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True, skip_special_tokens=False)
    plain = handle.generate(prompt, cluster.SamplingParams(**params))
    top, repeats = Counter(plain.token_ids).most_common(1)[0]
    assert repeats >= 4, "the unpenalized continuation was meant to repeat a token"
    penalized = handle.generate(prompt, cluster.SamplingParams(frequency_penalty=2.0, **params))
    counts = Counter(penalized.token_ids)
    assert counts[top] < repeats and max(counts.values()) < repeats
    ids = plain.token_ids
    first_repeat = next(i for i, t in enumerate(ids) if t in ids[:i])  # until then nothing is penalized
    assert penalized.token_ids[:first_repeat] == ids[:first_repeat]
    # the same through the HTTP server
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, frequency_penalty=2.0,
                                  extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert r.choices[0].text == penalized.text
    r = _chat(client, "What is the capital of France?", presence_penalty=1.0, max_tokens=16,
              extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].message.content or r.choices[0].message.model_extra["reasoning_content"]


@pytest.mark.parametrize("kwargs,field,shown", [
    ({"presence_penalty": 3}, "presence_penalty", "3"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "-2.5"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "0"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "999999"),
    ({"logit_bias": {"5": 200}}, "logit_bias", "200"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "five"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "301"),
])
def test_bad_penalties_are_a_400_naming_the_field_and_value(client, kwargs, field, shown):
    for create in (client.completions.create, client.chat.completions.create):
        body = {"prompt": "Hello"} if create == client.completions.create else {
            "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=4, **body, **kwargs)
        assert field in e.value.message and shown in e.value.message
        assert e.value.param == field
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
