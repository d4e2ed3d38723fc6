"""Chat templates cannot be turned against the server: a request's own template is refused
unless the server opted in, and then renders in a bounded sandbox; every template failure
is a 400 naming the field; the model's own template renders Qwen3 chats as HF renders them.
No Ray: the bundled tiny model's tokenizer, and the HTTP app over a small fake handle."""

from __future__ import annotations

import asyncio
import sys
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import pytest

from cluster.cli import _engine_kwargs, build_parser
from cluster.config import EngineConfig
from cluster.core.chat_template import render_chat
from cluster.openai.app import ServerState, build_app

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# a template of the kind clients send: messages, special tokens, tools as JSON, namespace, loop controls
PLAIN = """{{ bos_token or '' }}{% set ns = namespace(n=0) %}
{% for m in messages %}
{% if m.role == 'system' and not loop.first %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}
[{{ m.role | upper }}] {{ m.content }}{% if m.reasoning_content %} (thought: {{ m.reasoning_content }}){% endif %}
{{ eos_token }}
{% endfor %}
{% if tools %}{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}
{% generation %}turns={{ ns.n }}{% endgeneration %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""


@pytest.fixture(scope="module")
def tok():
    from workers.loader import bundled_model_path, load_tokenizer

    return load_tokenizer(bundled_model_path())


def trusted(tok, template: str, messages=CHAT, tools=None, **kwargs) -> str:
    return render_chat(tok, messages, tools, {"chat_template": template, **kwargs}, trust_request_template=True)


class Handle:
    """What the HTTP routes need of an LLMHandle to render and tokenize a chat."""

    sampling_defaults: dict = {}
    max_model_len = 4096

    def __init__(self, tokenizer, trust: bool):
        self.tokenizer, self.trust = tokenizer, trust

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        return render_chat(self.tokenizer, messages, tools, template_kwargs, self.trust)

    async def agenerate(self, prompt, params):
        raise AssertionError("these requests must be answered before generation")


def post(tok, trust: bool, route: str, body: dict) -> httpx.Response:
    state = ServerState(["m"], api_key=None)
    state.handle = Handle(tok, trust)

    async def run():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://raylm", timeout=60) as c:
            return await c.post(route, json={"model": "m", **body})

    return asyncio.run(run())


# ---- the opt-in ----
@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 'x' }}"}),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 'x' }}"}),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}),
])
def test_a_request_template_is_refused_without_the_servers_opt_in(tok, route, body):
    r = post(tok, False, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template"
    assert err["message"].startswith("chat_template: ") and "--trust-request-chat-template" in err["message"]
    with pytest.raises(ValueError, match=r"^chat_template: .*--trust-request-chat-template"):
        render_chat(tok, CHAT, None, {"chat_template": "{{ 'x' }}"})


def test_with_the_opt_in_a_request_template_is_what_the_prompt_is_made_of(tok):
    body = {"messages": CHAT, "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"}
    r = post(tok, True, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert tok.decode(r.json()["tokens"]) == "<system>Be brief.<user>Hi there"
    plain = post(tok, False, "/tokenize", {"messages": CHAT})  # no template given: the model's, trusted or not
    want = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.decode(plain.json()["tokens"]) == want


def test_a_template_given_both_ways_or_with_a_prompt_is_refused(tok):
    both = post(tok, True, "/v1/chat/completions", {"messages": CHAT, "chat_template": "a",
                                                    "chat_template_kwargs": {"chat_template": "b"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "chat_template", both.text
    prompt = post(tok, True, "/tokenize", {"prompt": "hi", "chat_template": "a"})
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "chat_template", prompt.text


def test_the_opt_in_is_an_engine_config_field_and_a_serve_flag():
    on = build_parser().parse_args(["serve", "--trust-request-chat-template"])
    assert EngineConfig.from_kwargs(**_engine_kwargs(on)).trust_request_chat_template is True
    off = build_parser().parse_args(["serve"])
    assert EngineConfig.from_kwargs(**_engine_kwargs(off)).trust_request_chat_template is False
    with pytest.raises(ValueError, match="trust_request_chat_template must be a bool, got 'yes'"):
        EngineConfig(trust_request_chat_template="yes")


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("renderer", ["LocalEngine", "ClientTokenizer"])
def test_engines_and_their_clients_render_with_the_configs_opt_in(tok, trust, renderer):
    """The engine renders for launched handles, ClientTokenizer (with the model's files at hand) for connected
    handles and the Serve ingress."""
    from cluster.core.engine import LocalEngine
    from cluster.remote.client import ClientTokenizer

    config = EngineConfig(trust_request_chat_template=trust)
    if renderer == "LocalEngine":
        engine = SimpleNamespace(config=config, tokenizer=tok, _need_tokenizer=lambda what: None)
        apply = lambda *args: LocalEngine.apply_chat_template(engine, *args)  # noqa: E731
    else:  # what RemoteEngine and the Serve ingress render with, the model's files at hand
        apply = ClientTokenizer("unused", trust, tokenizer=tok).render
    kwargs = {"chat_template": "{{ messages[-1].content }}"}
    if trust:
        assert apply(CHAT, None, kwargs) == "Hi there"
    else:
        with pytest.raises(ValueError, match="^chat_template: "):
            apply(CHAT, None, kwargs)


def test_options_of_hfs_apply_chat_template_are_not_template_variables(tok):
    for option in ("return_dict", "sanitize_control_tokens", "continue_final_message", "tokenize"):
        with pytest.raises(ValueError, match=rf"^chat_template_kwargs may not set \['{option}'\]"):
            render_chat(tok, CHAT, None, {option: True})


# ---- a trusted template sees what HF gives a template ----
REASONED = [*CHAT, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back", "name": None},
            {"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("template", ["plain", "the model's own"])
@pytest.mark.parametrize("tools,kwargs", [(None, {}), ([WEATHER], {}), ([WEATHER], {"enable_thinking": False})])
def test_a_trusted_template_renders_what_hf_renders(tok, template, tools, kwargs):
    source = PLAIN if template == "plain" else tok.chat_template
    want = tok.apply_chat_template(REASONED, tools=tools, chat_template=source, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    assert trusted(tok, source, REASONED, tools, **kwargs) == want
    assert "Weather in Paris?" in want and (tools is None) == ("get_weather" not in want)


# ---- bounds ----
@pytest.mark.parametrize("template", ["{{ 'ab' * 2000000 }}", "{{ 'a' * 10**12 }}", "{{ ['x'] * 10**9 }}",
                                      "{{ 2 ** (10**8) }}", "{{ '%0999999999d' % 1 }}"])
def test_a_huge_value_is_refused_before_it_is_built(tok, template):
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"^chat_template: .*MAX_PROMPT_CHARS"):
            trusted(tok, template)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000  # every one of these values takes more than this: it was never built


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_loop_that_calls_nothing_is_stopped_by_the_deadline(tok):
    tracer = sys.gettrace()
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^chat_template: rendering ran past .*MAX_RENDER_S"):
        trusted(tok, LOOPS)
    assert time.monotonic() - start < 10  # a hang guard only: the loops alone run for hours
    assert sys.gettrace() is tracer  # the thread's tracing is as it was


GROWN = {  # each builds a value over MAX_PROMPT_CHARS step by step, or asks for one through an argument
    "~ doubling": "{% set ns = namespace(s='ab') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "+ doubling": "{% set ns = namespace(s='ab') %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "shared lists": "{% set ns = namespace(l=[1]) %}{% for i in range(25) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
                    "{{ ns.l | string | length }}",
    "a macro's output": "{% macro m() %}{% for i in range(20000) %}{{ 'x' * 100 }}{% endfor %}{% endmacro %}"
                        "{{ m() | length }}",
    "the prompt": "{% for i in range(20000) %}{{ 'x' * 100 }}{% endfor %}",
    "replace": "{{ ('a' * 500000) | replace('a', 'bbbb') }}",
    "str.replace": "{{ ('a' * 500000).replace('a', 'bbbb') }}",
    "join": "{{ ('a' * 500000) | join('bbbb') }}",
    "str.format": "{{ '{:>999999999}'.format(1) }}",
    "tojson indent": "{{ [[[[1]]]] | tojson(indent=999999) }}",
    "batch": "{{ [1] | batch(10**9, 'x') | list }}",
    "center": "{{ 'a' | center(10**9) }}",
    "range": "{% for i in range(10**9) %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(GROWN))
def test_values_past_the_bounds_are_refused_naming_the_bound(tok, name):
    # measuring a value made of shared parts takes a while: on a loaded machine the deadline may come first
    with pytest.raises(ValueError, match=r"^chat_template: .*\((MAX_PROMPT_CHARS|MAX_RANGE|MAX_RENDER_S)\)"):
        trusted(tok, GROWN[name])


def test_values_within_the_bounds_still_render(tok):
    assert trusted(tok, "{{ ('ab' * 1000) | length }} {{ 2 ** 64 }} {{ range(3) | list }} {{ '%05d' % 42 }}") == (
        "2000 18446744073709551616 [0, 1, 2] 00042")
    assert trusted(tok, "{{ ''.__class__ }}|{{ messages.__len__ }}") == "|"  # the sandbox hides internals


# ---- failures are 400s naming the field ----
FAILING = ["{{ raise_exception('No user query found') }}", "{% if %}", "{% for m in messages %}",
           "{{ ''.__class__.__mro__ }}", "{{ 1 / 0 }}", "{{ namespace(_x=1) }}",
           "{{ 'ab' * 2000000 }}", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"]


@pytest.mark.parametrize("template", FAILING)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_failing_request_template_is_a_400_naming_chat_template(tok, template, route):
    r = post(tok, True, route, {"messages": CHAT, "chat_template": template})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and err["message"].startswith("chat_template: "), err


def test_the_models_template_failing_on_the_messages_names_messages(tok):
    nameless_call = [*CHAT, {"role": "assistant", "content": None,
                             "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]
    with pytest.raises(ValueError, match=r"^messages: the model's chat template failed .*UndefinedError"):
        render_chat(tok, nameless_call)
    with pytest.raises(ValueError, match=r"^messages: .*MAX_PROMPT_CHARS"):
        render_chat(tok, [{"role": "user", "content": "x" * 1_000_001}])


# ---- the model's own template, as before ----
QWEN3_CHATS = {
    "one turn": (CHAT, None, {}),
    "thinking off": (CHAT, None, {"enable_thinking": False}),
    "reasoning kept": (REASONED, None, {}),
    "tools offered": (REASONED, [WEATHER], {}),
    "a tool call and its result": ([
        *REASONED,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18C, sunny"},
    ], [WEATHER], {"enable_thinking": True}),
}


@pytest.mark.parametrize("name", sorted(QWEN3_CHATS))
def test_the_models_template_renders_qwen3_chats_as_hf_does(tok, name):
    messages, tools, kwargs = QWEN3_CHATS[name]
    text = render_chat(tok, messages, tools, kwargs)
    assert text == tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    empty_thought = "<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else ""
    assert text.endswith("<|im_start|>assistant\n" + empty_thought)
    assert ("<tools>" in text) == (tools is not None)
