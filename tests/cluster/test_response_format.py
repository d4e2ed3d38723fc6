"""Request bodies to grammars, without Ray: what response_format and a forced tool_choice
ask the worker to constrain, how the forced prefix and the tool-call grammar fit together
into one well-formed Qwen3 call, and the 400 when xgrammar is not installed."""

from __future__ import annotations

import json
import sys

import pytest

from cluster.openai import api_models as oa
from cluster.openai.tool_calls import parse_tool_calls
from workers.loader import bundled_model_path, load_tokenizer
from workers.sampling.grammar import GrammarCompilerCache, xgrammar_available
from workers.tiny_model.corpus import TOOLS

needs_xgrammar = pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed (raylm[structured])")
WEATHER, TIME = TOOLS["get_weather"], TOOLS["get_time"]


def _chat(**kw) -> oa.ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return oa.ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **kw})


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompilerCache(load_tokenizer(bundled_model_path()), 2048, ())


def _accepts(compiler, spec, text: str) -> bool:
    m = compiler.matcher(spec)
    return m.accept_string(text) and m.is_completed()


@needs_xgrammar
@pytest.mark.parametrize("choice,rest,name,wrong", [
    ({"type": "function", "function": {"name": "get_time"}}, ' {"city": "Paris"}}\n</tool_call>', "get_time",
     ' {"city": 5}}\n</tool_call>'),  # a number where the schema says string
    ("required", 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "get_weather",
     'got_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),  # no such function
])
def test_the_forced_prefix_and_the_tool_grammar_make_one_well_formed_call(compiler, choice, rest, name, wrong):
    body = _chat(tools=[WEATHER, TIME], tool_choice=choice)
    spec = body.sampling_params(16, None).grammar
    assert _accepts(compiler, spec, rest)
    content, [call] = parse_tool_calls(body.forced_prefix() + rest)
    assert content is None and call.name == name and set(json.loads(call.arguments)) == {"city"}
    assert not _accepts(compiler, spec, rest.replace("city", "town"))  # arguments off the tool's schema
    assert not _accepts(compiler, spec, rest.replace("</tool_call>", "</tool>"))
    assert not _accepts(compiler, spec, wrong)


@needs_xgrammar
def test_response_format_asks_for_its_grammar_and_thinking_goes_off():
    text = _chat(response_format={"type": "text"})
    assert text.sampling_params(16, None).grammar is None
    obj = _chat(response_format={"type": "json_object"})
    assert obj.sampling_params(16, None).grammar.kind == "json_object"
    assert obj.template_kwargs()["enable_thinking"] is False  # the reply starts with the JSON
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                 ).sampling_params(16, None).grammar
    assert (spec.kind, json.loads(spec.text)) == ("json_schema", schema)
    unnamed = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert unnamed.sampling_params(16, None).grammar.kind == "json_object"  # no schema: any object
    completion = oa.CompletionRequest.model_validate({"model": "m", "prompt": "hi",
                                                      "response_format": {"type": "json_object"}})
    assert completion.sampling_params(16, None).grammar.kind == "json_object"


def test_without_xgrammar_response_format_is_refused_and_forced_calls_keep_their_prefix(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ValueError, match=r"^response_format 'json_object' needs xgrammar.*raylm\[structured\]"):
        _chat(response_format={"type": "json_object"}).sampling_params(16, None)
    forced = _chat(tools=[WEATHER], tool_choice="required")
    assert forced.sampling_params(16, None).grammar is None and forced.forced_prefix()


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                              "tool_choice": "required"}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_a_request_that_needs_a_grammar_builds_it_off_the_event_loop(monkeypatch, route, body):
    """Building one imports xgrammar the first time (seconds); on the server's event loop that
    would stall every other request's stream meanwhile. Requests without one stay on the loop."""
    import asyncio
    import threading

    import httpx

    from cluster.openai.app import ServerState, build_app

    built_on = []
    real = oa._Common.sampling_params
    monkeypatch.setattr(oa._Common, "sampling_params",
                        lambda self, *a: built_on.append(threading.current_thread()) or real(self, *a))

    class Handle:  # refuses every prompt once its params are built
        sampling_defaults: dict = {}

        def apply_chat_template(self, *a):
            return "hi"

        async def agenerate(self, prompt, params):
            raise ValueError("prompt refused by this test")

    state = ServerState(["m"], api_key=None)
    state.handle = Handle()

    async def post():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://raylm") as c:
            return await c.post(route, json={"model": "m", **body}), threading.current_thread()

    r, loop_thread = asyncio.run(post())
    assert r.status_code == 400 and "refused by this test" in r.json()["error"]["message"]
    needs_grammar = "response_format" in body or "tools" in body
    assert len(built_on) == 1 and (built_on[0] is not loop_thread) == needs_grammar
