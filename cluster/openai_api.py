"""OpenAI-compatible request bodies and response objects.

Bodies are parsed strictly from JSON (a string where a number belongs is an error,
naming the field); ranges are then checked by SamplingParams, whose errors name the
field and value. Features raylm does not have (n > 1, echo, penalties, logit_bias,
tools) are refused with a 400 that says so, never silently ignored."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.outputs import RequestOutput, StreamDelta, TokenLogprob
from scheduler.request import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    user: str | None = None

    def unsupported(self) -> tuple[str, object] | None:
        """The first field asking for something raylm does not do, with its value."""
        if self.n != 1:
            return "n", self.n
        if self.presence_penalty != 0:
            return "presence_penalty", self.presence_penalty
        if self.frequency_penalty != 0:
            return "frequency_penalty", self.frequency_penalty
        if self.logit_bias:
            return "logit_bias", self.logit_bias
        return None

    def sampling_params(self, max_tokens_default: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else max_tokens_default,
            min_tokens=self.min_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self):
        if self.echo:
            return "echo", self.echo
        if self.suffix:
            return "suffix", self.suffix
        if self.best_of not in (None, 1):
            return "best_of", self.best_of
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None

    def unsupported(self):
        if self.tools:
            return "tools", "(function calling is not supported)"
        return super().unsupported()

    def chat_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def logprobs_n(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise ValueError(f"top_logprobs needs logprobs=true, got top_logprobs={self.top_logprobs}")
            return None
        return self.top_logprobs if self.top_logprobs is not None else 0


# ---- responses ----
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason)


def completion_logprobs(lps: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    if lps is None:
        return None
    offsets, pos = [], text_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t: v for _, t, v in lp.top} for lp in lps], "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for _, t, v in lp.top]}
        for lp in lps]}


def completion_response(rid: str, model: str, outputs: list[RequestOutput]) -> dict:
    choices = [{"index": i, "text": o.text, "logprobs": completion_logprobs(o.logprobs),
                "finish_reason": finish_reason(o.finish_reason)} for i, o in enumerate(outputs)]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(sum(o.num_prompt_tokens for o in outputs),
                                               sum(len(o.token_ids) for o in outputs))}


def chat_response(rid: str, model: str, out: RequestOutput) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "logprobs": chat_logprobs(out.logprobs), "finish_reason": finish_reason(out.finish_reason)}],
            "usage": usage(out.num_prompt_tokens, len(out.token_ids))}


def completion_chunk(rid: str, model: str, created: int, delta: StreamDelta, text_offset: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": delta.text, "logprobs": completion_logprobs(delta.logprobs, text_offset),
                         "finish_reason": finish_reason(delta.finish_reason)}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, logprobs=None, reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish_reason(reason)}]}


def usage_chunk(rid: str, obj: str, model: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
