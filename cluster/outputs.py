"""What callers get back: RequestOutput (whole) and StreamDelta (incremental)."""

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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """The newest piece of one request's output. The last delta has finish_reason set
    and carries the whole RequestOutput in `output`."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
