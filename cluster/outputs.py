"""What callers get back: RequestOutput (whole) and StreamDelta (incremental).

A request with n choices (SamplingParams.n) gives one RequestOutput whose `outputs` lists
the n CompletionOutputs in index order, as vLLM's does; its own text, token_ids,
finish_reason, stop_reason and logprobs are choice 0's, so code written for n=1 keeps
working. Stream deltas carry their choice's `index`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One generated token's logprob and the top-n alternatives (raw model distribution)."""

    token_id: int
    token: str  # the token decoded on its own
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, token, logprob), best first


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    ttft: float | None = None  # seconds from arrival to the first generated token
    tpot: float | None = None  # mean seconds per output token after the first
    latency: float | None = None  # seconds from arrival to finish
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for it
    num_accepted_tokens: int = 0  # of those, accepted (acceptance rate: accepted / drafted)


@dataclass
class CompletionOutput:
    """One choice of a request's output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # every choice; empty: just this one

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason,
                                             self.logprobs, self.metrics)]

    @classmethod
    def of_choices(cls, request_id: str, choices: list[RequestOutput]) -> RequestOutput:
        """One request's output from its choices' (index order): choice 0's fields, the first
        error, and every choice in `outputs`."""
        first = choices[0]
        outputs = [CompletionOutput(i, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.metrics)
                   for i, c in enumerate(choices)]
        error = next((c.error for c in choices if c.error), None)
        reason = "error" if any(c.finish_reason == "error" for c in choices) else first.finish_reason
        return cls(request_id, first.prompt, first.prompt_token_ids, first.text, first.token_ids, reason,
                   first.stop_reason, first.logprobs, error, first.metrics, outputs)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated over every choice."""
        return sum(len(c.token_ids) for c in self.outputs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """The newest piece of one request's output. The last delta has finish_reason set
    and carries the whole RequestOutput in `output`. With n choices, each choice's deltas
    carry its `index` and each choice ends with such a last delta of its own."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None  # on a choice's last delta: that choice's whole output
    index: int = 0  # which choice (SamplingParams.n)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def joined(deltas: list[StreamDelta]) -> StreamDelta:
        """Consecutive deltas of one choice as one: their text, ids and logprobs in order, the
        last one's finish and output."""
        if len(deltas) == 1:
            return deltas[0]
        last = deltas[-1]
        logprobs = None if all(d.logprobs is None for d in deltas) else [
            lp for d in deltas for lp in (d.logprobs or ())]
        return StreamDelta(last.request_id, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                           logprobs, last.finish_reason, last.output, last.index)
