"""Qwen3's reasoning split: the <think> block of an output is reasoning, the rest content.

A Qwen3 output in thinking mode reads "<think>\\nreasoning\\n</think>\\n\\ncontent". Some
templates open the block in the prompt, so the output holds only "reasoning</think>content";
`opens_in_think(prompt)` says whether that is the case. Rules, the same for a whole text and
for a stream of deltas:
- the output is in a think block if the prompt left one open or the output starts with <think>;
- reasoning runs until </think> (or the end, when the output stops mid-thought) and content
  follows; an output not in a think block is all content;
- newlines next to the tags are formatting: reasoning is stripped of them at both ends and
  content at its start.
`ReasoningStream` splits deltas cut anywhere, even inside a tag, and what it hands out adds up
to `split_reasoning` of the whole text. Never raises on odd text: it becomes content.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def opens_in_think(prompt: str) -> bool:
    """Whether the prompt ends inside a think block (its last <think> is not closed)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def split_reasoning(text: str, in_think: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; each None when there is none."""
    stream = ReasoningStream(in_think)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """feed(delta) -> (reasoning_delta, content_delta); finish() -> the held-back rest."""

    def __init__(self, in_think: bool = False):
        self._state = "think" if in_think else "start"  # start -> think -> content, or start -> content
        self._held = ""           # text not yet handed out
        self._fresh = True        # at the start of the reasoning or of the content: leading newlines go

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("start", "think")

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        reasoning, content = "", ""
        while True:
            if self._state == "start":
                if self._held.startswith(THINK_START):
                    self._held, self._state, self._fresh = self._held[len(THINK_START):], "think", True
                    continue
                if THINK_START.startswith(self._held):
                    break  # "" or a part of "<think>": wait for more
                self._state, self._fresh = "content", True
                continue
            if self._state == "think":
                if self._fresh:
                    self._held = self._held.lstrip("\n")
                    if not self._held:
                        break
                    self._fresh = False
                end = self._held.find(THINK_END)
                if end != -1:
                    reasoning += self._held[:end].rstrip("\n")
                    self._held, self._state, self._fresh = self._held[end + len(THINK_END):], "content", True
                    continue
                keep = _partial_tag(self._held, THINK_END)
                body = self._held[:len(self._held) - keep]
                newlines = len(body) - len(body.rstrip("\n"))  # trailing newlines may end the reasoning
                keep += newlines
                reasoning += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                break
            if self._fresh:
                self._held = self._held.lstrip("\n")
                if not self._held:
                    break
                self._fresh = False
            content += self._held
            self._held = ""
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: hand out what was held back."""
        held, self._held = self._held, ""
        if self._state == "think":
            return held.rstrip("\n"), ""
        if self._state == "start":
            return "", held
        return "", held.lstrip("\n") if self._fresh else held
