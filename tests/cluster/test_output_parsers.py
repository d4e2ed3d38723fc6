"""The Qwen3 reasoning split and the tool-call parser on hand-written outputs, whole and as
deltas cut at every place (inside tags too). No Ray, no model."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.openai.reasoning import ReasoningStream, opens_in_think, split_reasoning
from cluster.openai.tool_calls import ToolCallStream, parse_tool_calls


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _cuts(text: str, pieces: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), min(pieces - 1, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


def _stream_reasoning(deltas: list[str], in_think: bool = False) -> tuple[str | None, str | None]:
    s = ReasoningStream(in_think)
    r, c = "", ""
    for d in deltas:
        dr, dc = s.feed(d)
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    return (r + dr) or None, (c + dc) or None


def _stream_tools(deltas: list[str]):
    s = ToolCallStream(_ids())
    content, calls = "", []
    for d in deltas:
        dc, new = s.feed(d)
        content += dc
        calls += new
    dc, new = s.finish()
    return (content + dc) or None, calls + new


REASONING_CASES = [
    # (output, prompt left a think block open, reasoning, content)
    ("<think>\nThe user asks for Paris.\n</think>\n\nThe capital is Paris.", False,
     "The user asks for Paris.", "The capital is Paris."),
    ("The capital is Paris.", False, None, "The capital is Paris."),
    ("\n\nThe capital is Paris.", False, None, "The capital is Paris."),  # after an empty think in the prompt
    ("The user asks.\nTwo lines.\n</think>\n\nAnswer.", True, "The user asks.\nTwo lines.", "Answer."),
    ("<think>\nStill thinking when max_tokens ran out", False, "Still thinking when max_tokens ran out", None),
    ("thinking, cut off\n", True, "thinking, cut off", None),
    ("<think>\n\n</think>\n\nJust the answer.", False, None, "Just the answer."),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # only the first </think> closes
    ("<thinking> is not a tag", False, None, "<thinking> is not a tag"),
    ("a < b and <think> later", False, None, "a < b and <think> later"),
    ("<thi", False, None, "<thi"),
    ("", False, None, None),
    ("<think>\n北京故宫是什么？\n</think>\n\n北京故宫是皇家宫殿。", False, "北京故宫是什么？", "北京故宫是皇家宫殿。"),
]


@pytest.mark.parametrize("text,in_think,reasoning,content", REASONING_CASES)
def test_reasoning_split_whole_and_at_every_cut(text, in_think, reasoning, content):
    assert split_reasoning(text, in_think) == (reasoning, content)
    for i in range(len(text) + 1):  # every two-piece cut, the empty pieces included
        assert _stream_reasoning([text[:i], text[i:]], in_think) == (reasoning, content), i
    assert _stream_reasoning(list(text), in_think) == (reasoning, content)  # one character per delta


def test_reasoning_stream_hands_out_text_as_soon_as_it_is_known():
    s = ReasoningStream()
    assert s.feed("<think>\nI") == ("I", "")
    assert s.feed(" think.\n</th") == (" think.", "")  # the newline may end the reasoning; "</th" may be a tag
    assert s.in_reasoning
    assert s.feed("ink>\n\nHi") == ("", "Hi")
    assert not s.in_reasoning
    assert s.feed(" there") == ("", " there")
    assert s.finish() == ("", "")


def test_whether_the_prompt_leaves_a_think_block_open():
    assert opens_in_think("<|im_start|>assistant\n<think>\n")
    assert not opens_in_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_in_think("<|im_start|>assistant\n")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"city": "东京"}}\n</tool_call>'
TOOL_CASES = [
    # (output, content, [(name, arguments as parsed JSON)])
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    (CALL + "\n" + CALL2, None, [("get_weather", {"city": "Paris"}), ("get_time", {"city": "东京"})]),
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("Before.\n" + CALL + "\nAfter.", "Before.\n\nAfter.", [("get_weather", {"city": "Paris"})]),
    ("No tools here.", "No tools here.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', []),  # broken JSON
    (CALL + '\n<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', [("get_weather", {"city": "Paris"})]),  # no name: content
    ('<tool_call>["get_weather"]</tool_call>', '<tool_call>["get_weather"]</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": 3}</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>', []),  # noqa: E501
    ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None, [("f", {"x": 1})]),
    ('<tool_call>\n{"name": "f", "parameters": {"x": [1, 2]}}\n</tool_call>', None, [("f", {"x": [1, 2]})]),
    ('<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", {})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),  # left open at the end, but whole
    ('<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),
    ("a <tool_c", "a <tool_c", []),
    ("</tool_call> stray", "</tool_call> stray", []),
    ("   ", None, []),
    ("", None, []),
]


@pytest.mark.parametrize("text,content,calls", TOOL_CASES)
def test_tool_calls_whole_and_at_every_cut(text, content, calls):
    got_content, got = parse_tool_calls(text, _ids())
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert [c.id for c in got] == [f"call_{i}" for i in range(len(calls))]
    for i in range(len(text) + 1):
        c, g = _stream_tools([text[:i], text[i:]])
        assert (c, g) == (got_content, got), i
    assert _stream_tools(list(text)) == (got_content, got)
    for seed in range(5):
        assert _stream_tools(_cuts(text, 4, seed)) == (got_content, got)


def test_a_call_is_handed_out_when_its_block_closes():
    s = ToolCallStream(_ids())
    assert s.feed("Checking.\n<tool") == ("Checking.", [])
    assert s.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_') == ("", [])
    content, calls = s.feed("call>\n")
    assert content == "" and len(calls) == 1 and calls[0].name == "get_weather" and s.num_calls == 1
    assert calls[0].to_openai(0) == {"index": 0, "id": "call_0", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert s.finish() == ("", [])


def test_call_ids_are_unique_by_default():
    _, calls = parse_tool_calls(CALL + CALL)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", "{", "}", '"name"', ": ", '"f"',
                          '"arguments"', "[", "]", "\n", " ", "x", "<think>", "</think>", "\\", '"', "北"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=30), st.integers(1, 6), st.integers(0, 10**6), st.booleans())
def test_parsers_never_raise_and_streams_add_up_to_the_whole(pieces, cuts, seed, in_think):
    text = "".join(pieces)
    whole = parse_tool_calls(text, _ids())
    assert _stream_tools(_cuts(text, cuts, seed)) == whole
    assert _stream_reasoning(_cuts(text, cuts, seed), in_think) == split_reasoning(text, in_think)


def test_chat_output_splits_reasoning_then_tool_calls_whole_and_streamed():
    from cluster.openai.chat_output import ChatOutput

    text = "<think>\nThe user wants Paris weather.\n</think>\n\n" + CALL
    msg = ChatOutput("<|im_start|>assistant\n", parse_tools=True, new_id=_ids()).message(text)
    assert msg == {"role": "assistant", "content": None, "reasoning_content": "The user wants Paris weather.",
                   "tool_calls": [{"id": "call_0", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    out = ChatOutput("<|im_start|>assistant\n", parse_tools=True, new_id=_ids())
    fields = [out.feed(d) for d in _cuts(text, 7, 3)] + [out.finish()]
    assert "".join(f.get("reasoning_content", "") for f in fields) == msg["reasoning_content"]
    assert sum((f.get("tool_calls", []) for f in fields), []) == [{"index": 0, **msg["tool_calls"][0]}]
    assert not any("content" in f for f in fields)
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    # without tools the same text stays content after the reasoning
    plain = ChatOutput("<|im_start|>assistant\n", parse_tools=False).message(text)
    assert plain["content"] == CALL and "tool_calls" not in plain


def test_chat_output_with_a_forced_call_prefix():
    from cluster.openai.chat_output import ChatOutput

    prefix = '<tool_call>\n{"name": "get_time", "arguments":'
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n" + prefix
    out = ChatOutput(prompt, parse_tools=True, forced_prefix=prefix, new_id=_ids())
    msg = out.message(' {"city": "Tokyo"}}\n')  # a stop string cut "</tool_call>"
    assert msg["content"] is None and msg["reasoning_content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"city": "Tokyo"}'}
