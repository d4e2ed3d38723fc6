"""Structured output through the official openai client against a served engine on the
bundled tiny model: response_format json_schema (output validates against the schema,
whole and streamed) and json_object, on /v1/chat/completions and /v1/completions; a forced
tool call (named or "required") whose arguments validate against the tool's schema even
when the model would have written others; and a 400 naming response_format for each bad
value."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.cluster.test_openai_qwen3 import MODEL, _chat, _joined, base, client  # noqa: F401  (fixtures)
from workers.sampling.grammar import xgrammar_available
from workers.tiny_model.corpus import TOOLS

pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed (raylm[structured])")]

WEATHER, TIME, CURRENCY = TOOLS["get_weather"], TOOLS["get_time"], TOOLS["convert_currency"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "enum": ["Paris", "Tokyo", "Berlin"]},
                         "admin": {"type": "boolean"}},
          "required": ["name", "age", "city", "admin"]}


def _schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_output_validates_against_its_schema_whole_and_streamed(client):  # noqa: F811
    r = _chat(client, "Tell me about Paris.", response_format=_schema_format(PERSON))
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # the grammar ended, so the model could only say EOS
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    streamed = _joined(_chat(client, "Tell me about Paris.", response_format=_schema_format(PERSON), stream=True))
    assert streamed == ("", choice.message.content, [], "stop")


def test_json_object_on_chat_and_a_json_schema_on_completions(client):  # noqa: F811
    r = _chat(client, "What is the weather in Tokyo?", response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=48, temperature=0,
                                  extra_body={"response_format": _schema_format({"type": "object", "properties": {
                                      "capital": {"type": "string", "maxLength": 12}}, "required": ["capital"]})})
    assert set(json.loads(c.choices[0].text)) == {"capital"}


def test_a_named_tool_call_has_that_name_and_arguments_valid_against_its_schema(client):  # noqa: F811
    # the model would call get_time with {"city": ...}; the grammar makes it fill convert_currency's fields
    r = _chat(client, "What time is it in Paris?", tools=[TIME, CURRENCY], max_tokens=128,
              tool_choice={"type": "function", "function": {"name": "convert_currency"}})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "convert_currency" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), CURRENCY["function"]["parameters"])


def test_a_required_tool_call_is_one_of_the_offered_tools_with_valid_arguments(client):  # noqa: F811
    r = _chat(client, "What is the capital of France?", tools=[WEATHER, TIME], tool_choice="required")
    [call] = r.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert r.choices[0].finish_reason == "tool_calls"


SCHEMA_FIELD = "response_format.json_schema.schema"
BAD = [
    (_schema_format({"type": "object", "properties": {"a": {"type": "strin"}}}), {}, SCHEMA_FIELD),
    (_schema_format({"$ref": "#/definitions/nope"}), {}, SCHEMA_FIELD),
    ({"type": "json_schema"}, {}, "response_format.json_schema"),
    ({"type": "xml"}, {}, "response_format.type"),
    ({"type": "json_object"}, {"tools": [WEATHER], "tool_choice": "required"}, "response_format"),
    ({"type": "json_object"}, {"chat_template_kwargs": {"enable_thinking": True}}, "response_format"),
]


@pytest.mark.parametrize("fmt,extra,field", BAD)
def test_a_bad_response_format_is_a_400_naming_it(client, base, fmt, extra, field):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "hi", max_tokens=4, response_format=fmt, extra_body=extra)
    err = e.value.body if "message" in (e.value.body or {}) else e.value.body["error"]
    assert err["param"] == field and "response_format" in err["message"]
    assert httpx.post(base + "/v1/chat/completions", timeout=60, json={  # the engine keeps serving
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "response_format": {"type": "json_object"}}).status_code == 200
