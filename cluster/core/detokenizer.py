"""Incremental detokenizing and stop strings for one request, on the driver.

Byte-level BPE tokens may end in the middle of a UTF-8 character. The detokenizer
decodes a short sliding window of tokens and only releases text once the window's
decoding no longer ends in U+FFFD, so a streamed delta never splits a character
(the same offsets scheme vLLM uses). With a fast (Rust) tokenizer the windows are kept and decoded
in Rust by tokenizers' DecodeStream, one call per token, the same scheme; the Python windows serve a
slow tokenizer, the text still held at finish (flush), and a decoder whose longer window does not
begin with the shorter one's text (DecodeStream refuses it). Stop strings are searched in the newly grown tail
of the text; the text is cut before the stop string, and while streaming the last
(longest stop - 1) characters are held back so a stop string is never half-shown.
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 4  # prompt tokens kept as decoding context for the first outputs


def _decoder(tokenizer, skip_special_tokens: bool):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer: no Python-side post-processing overhead
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _decode_stream(tokenizer, skip_special_tokens: bool, context: list[int]):
    """(the Rust tokenizer, a DecodeStream whose windows start as ours do), or (None, None). A context
    that decodes to a partial character (a prompt cut inside one) starts the stream's windows
    elsewhere than ours, so such a request keeps the Python windows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or DecodeStream is None:
        return None, None
    if REPLACEMENT in backend.decode(context, skip_special_tokens=skip_special_tokens):
        return None, None
    return backend, DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()):
        self._decode = _decoder(tokenizer, skip_special_tokens)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context  # decoding context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._backend, self._stream = _decode_stream(tokenizer, skip_special_tokens, context)
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
        if self._stream is None:
            self._ids.extend(token_ids)
            self._window_step()
            return self.stop_reason
        for i, token in enumerate(token_ids):
            self._ids.append(token)
            try:
                piece = self._stream.step(self._backend, token)
            except Exception:  # tokenizers raises its own type: a window that does not begin with its prefix's text
                self._stream = None  # our windows mirror the stream's, so the Python path takes over exactly
                self._ids.extend(token_ids[i + 1:])
                self._window_step()
                return self.stop_reason
            if piece is not None:
                self._advance(piece)
                if self.stop_reason is not None:
                    break
        return self.stop_reason

    def _window_step(self) -> None:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self._advance(full[len(prefix):])

    def _advance(self, new_text: str) -> None:
        """The window's new text is whole characters: the next prefix window starts where this one's new tokens did."""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._grow(new_text)

    def flush(self) -> None:
        """At finish: release text still held for an incomplete character."""
        self._stream = None  # nothing is held past this point
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
