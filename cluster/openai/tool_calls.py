"""Qwen3 (hermes-style) tool calls in model output: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.

A block whose body is a JSON object with a string "name" and an object "arguments" (or
"parameters") is a call; anything else, a broken block included, is content, verbatim. A last
block left open at the end of the output counts when its body parses. Content is the text
outside the calls with surrounding whitespace removed. `ToolCallStream` takes deltas cut
anywhere (inside a tag too) and hands out content deltas as they come and each call once its
block is closed, so what it hands out adds up to `parse_tool_calls` of the whole text.
Nothing here raises on model output.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's function.arguments holds)

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse_call(body: str, new_id: Callable[[], str] = new_call_id) -> ToolCall | None:
    """The call a block's body holds, or None when it is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content None when there is none."""
    stream = ToolCallStream(new_id)
    c1, calls1 = stream.feed(text)
    c2, calls2 = stream.finish()
    return (c1 + c2) or None, calls1 + calls2


def _partial_tag(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """feed(delta) -> (content_delta, new calls); finish() -> the rest."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._held = ""        # text not yet classified (a possible tag start, or an open block)
        self._in_call = False
        self._space = ""       # whitespace after the last content: handed out only if content follows
        self._started = False  # any content handed out yet (leading whitespace is dropped)
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._held += delta
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._held.find(CALL_END)
                if end == -1:
                    break
                body, self._held = self._held[:end], self._held[end + len(CALL_END):]
                self._in_call = False
                self._close(body, True, content, calls)
                continue
            start = self._held.find(CALL_START)
            if start != -1:
                content.append(self._text(self._held[:start]))
                self._held, self._in_call = self._held[start + len(CALL_START):], True
                continue
            keep = _partial_tag(self._held, CALL_START)
            content.append(self._text(self._held[:len(self._held) - keep]))
            self._held = self._held[len(self._held) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: an open block is a call if its body parses; the rest is content."""
        held, self._held = self._held, ""
        content, calls = [], []
        if self._in_call:
            self._in_call = False
            self._close(held, False, content, calls)
        else:
            content.append(self._text(held))
        return "".join(content), calls

    def _close(self, body: str, closed: bool, content: list, calls: list) -> None:
        call = parse_call(body.strip(), self._new_id)
        if call is None:
            content.append(self._text(CALL_START + body + (CALL_END if closed else "")))
            return
        calls.append(call)
        self.num_calls += 1

    def _text(self, text: str) -> str:
        """Content to hand out: whitespace is held until more content follows it."""
        if not text:
            return ""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out = self._space + body
        self._space = text[len(body):]
        return out
