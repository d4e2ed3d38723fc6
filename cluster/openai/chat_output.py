"""One chat choice's text as OpenAI message fields: reasoning_content, content, tool_calls.

The text goes through the reasoning split first (what follows </think> is the answer), then,
when tools were offered, through the tool-call parser. The same object serves a whole output
(`message`) or a stream (`feed` per delta, then `finish`), and the stream's pieces add up to
the whole. A forced prefix (the start of a call that tool_choice put in the prompt) is fed
first, so the call it opens is parsed with the rest and never shown as content.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.openai.reasoning import ReasoningStream, opens_in_think
from cluster.openai.tool_calls import ToolCallStream, new_call_id


class ChatOutput:
    def __init__(self, prompt: str, *, parse_tools: bool, forced_prefix: str = "",
                 new_id: Callable[[], str] = new_call_id):
        self._reasoning = ReasoningStream(opens_in_think(prompt))
        self._tools = ToolCallStream(new_id) if parse_tools else None
        self.num_calls = 0
        if forced_prefix:
            self.feed(forced_prefix)  # it opens a call: nothing to hand out yet

    def feed(self, text: str) -> dict:
        """The delta fields (reasoning_content / content / tool_calls) this text adds."""
        return self._fields(*self._reasoning.feed(text), final=False)

    def finish(self) -> dict:
        """The fields held back until the end of the output."""
        return self._fields(*self._reasoning.finish(), final=True)

    def feed_last(self, text: str) -> dict:
        """The last delta of a stream: its fields and everything held back."""
        a, b = self.feed(text), self.finish()
        out = {k: a.get(k, "") + b.get(k, "") for k in ("reasoning_content", "content") if k in a or k in b}
        calls = a.get("tool_calls", []) + b.get("tool_calls", [])
        return {**out, "tool_calls": calls} if calls else out

    def message(self, text: str) -> dict:
        """A whole output as an assistant message."""
        fields = self.feed_last(text)
        calls = fields.get("tool_calls", [])
        msg = {"role": "assistant", "content": fields.get("content"), "reasoning_content": fields.get("reasoning_content")}  # noqa: E501
        if calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: a call ends the turn as "tool_calls" unless the output was cut short."""
        return "tool_calls" if self.num_calls and reason in ("stop", "abort") else reason

    def _fields(self, reasoning: str, content: str, *, final: bool) -> dict:
        out = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        calls = []
        if self._tools is not None:
            content, calls = self._tools.feed(content) if content else ("", [])
            if final:
                more, late = self._tools.finish()
                content, calls = content + more, calls + late
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [c.to_openai(self.num_calls + i) for i, c in enumerate(calls)]
            self.num_calls += len(calls)
        return out
