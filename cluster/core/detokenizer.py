"""Incremental detokenizing and stop strings for one request, on the driver.

Byte-level BPE tokens may end in the middle of a UTF-8 character. The detokenizer
decodes a short sliding window of tokens and only releases text once the window's
decoding no longer ends in U+FFFD, so a streamed delta never splits a character
(the same offsets scheme vLLM uses). Stop strings are searched in the newly grown tail
of the text; the text is cut before the stop string, and while streaming the last
(longest stop - 1) characters are held back so a stop string is never half-shown.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 4  # prompt tokens kept as decoding context for the first outputs


def _decoder(tokenizer, skip_special_tokens: bool):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer: no Python-side post-processing overhead
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()):
        self._decode = _decoder(tokenizer, skip_special_tokens)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context  # decoding context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        # the text is the deltas handed out, then what is not yet: appending to one string would copy
        # all of it every token (quadratic in a long output); the unsent tail is a step's text or so
        self._sent: list[str] = []
        self._pending = ""
        self.stop_reason: str | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def text(self) -> str:
        """All of the text so far (cut before a stop string)."""
        return "".join(self._sent) + self._pending

    def append(self, token_ids: list[int]) -> str | None:
        """Add generated tokens; return the stop string they completed, if any."""
        if self.stop_reason is not None:
            return self.stop_reason
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self._grow(full[len(prefix):])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self.stop_reason

    def flush(self) -> None:
        """At finish: release text still held for an incomplete character."""
        if self.stop_reason is not None:
            return
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix):
            self._grow(full[len(prefix):])
        self._prefix_offset = self._read_offset = len(self._ids)

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out; while not final, keep back what may begin a stop string."""
        pending = self._pending
        end = len(pending) if final or self.stop_reason is not None else len(pending) - self._holdback
        if end <= 0:
            return ""
        delta, self._pending = pending[:end], pending[end:]
        self._sent.append(delta)
        return delta

    def _grow(self, new_text: str) -> None:
        # a stop string may begin in the last holdback characters, which take_delta never hands out early
        start = max(0, len(self._pending) - self._holdback)
        self._pending += new_text
        if not self._stop:
            return
        best = -1
        for s in self._stop:
            i = self._pending.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, self.stop_reason = i, s
        if best != -1:
            self._pending = self._pending[:best]
