"""OpenAI-compatible request bodies and response objects.

Bodies are parsed strictly from JSON (a string where a number belongs is an error,
naming the field); ranges are then checked by SamplingParams, whose errors name the
field and value. Chat requests may offer tools (tool_choice "none", "auto", "required" or a named function)
and pass chat_template_kwargs (e.g. {"enable_thinking": false}) to the template; replies
carry reasoning_content and tool_calls (cluster/openai/chat_output.py). response_format (json_object,
json_schema) and a forced tool call constrain decoding with a grammar (a GrammarSpec checked
here, compiled and applied on the worker: workers/sampling/grammar_masks.py). `n` (1..16, MAX_N) asks
for n choices, indexed 0..n-1 (a list of k prompts on /v1/completions gives k*n, choice i
of prompt p at index p*n + i, as OpenAI numbers them); with a seed, choice i samples with
choice_seed(seed, i); usage counts each prompt once and the completion tokens of every
choice. presence_penalty, frequency_penalty, repetition_penalty (a vLLM extension) and logit_bias
({"token id": bias}, at most MAX_LOGIT_BIAS entries) are applied on the worker's device
(workers/sampling/penalties.py). Features raylm does not have (echo, best_of other than n) are
refused with a 400 that says so, never silently ignored."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.core.chat_template import RESERVED_TEMPLATE_KWARGS, with_request_template
from cluster.outputs import RequestOutput, StreamDelta, TokenLogprob
from scheduler.grammar_spec import GrammarSpec
from scheduler.request import GENERATION_CONFIG_FIELDS, SamplingParams


class StrictModel(BaseModel):
    """A request body part: parsed strictly (no coercion), unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced strictly


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        """The GrammarSpec it asks for (None for "text"); ValueError naming the field when it is
        incomplete or its schema is not one raylm can constrain to."""
        from workers.sampling.grammar import build_grammar, import_xgrammar  # only when a request asks

        if self.type == "text":
            return None
        import_xgrammar(f"response_format {self.type!r}")
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format.json_schema must be given when response_format.type is "json_schema"')
        if self.type == "json_object" or self.json_schema.schema_ is None:  # no schema: any JSON object
            spec = GrammarSpec("json_object")
        else:
            spec = GrammarSpec("json_schema", json.dumps(self.json_schema.schema_))
        try:
            build_grammar(spec)
        except ValueError as e:
            field = "response_format.json_schema.schema" if spec.kind == "json_schema" else "response_format"
            raise ValueError(f"{field} is not a JSON schema raylm can constrain to: {e}") from None
        return spec


# the request fields a model's generation_config.json may give defaults for (max_tokens aside)
SAMPLING_DEFAULT_FIELDS = tuple(f for f in GENERATION_CONFIG_FIELDS.values() if f != "max_tokens")


class _Common(StrictModel):
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
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None  # {"token id": bias}; SamplingParams checks keys and values
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    user: str | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> tuple[str, object] | None:
        """The first field asking for something raylm does not do, with its value."""
        return None

    def sampling_params(self, max_tokens_default: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """`defaults` (the model's recommended sampling, LLMHandle.sampling_defaults) fill the
        fields this request left out; max_tokens falls back to `max_tokens_default` after them."""
        given = self.model_fields_set
        d = {k: v for k, v in (defaults or {}).items() if k not in given}
        pick = {k: d.get(k, getattr(self, k)) for k in SAMPLING_DEFAULT_FIELDS}
        max_tokens = self.requested_max_tokens()
        max_tokens = max_tokens if max_tokens is not None else d.get("max_tokens", max_tokens_default)
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, **pick, seed=self.seed, stop=self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            n=self.n,
            grammar=self.grammar(),
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def grammar(self) -> GrammarSpec | None:
        return self.response_format.grammar() if self.response_format is not None else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    # a list must hold something: the schema says so (minItems), _prompt_given refuses [] naming `prompt`
    prompt: (str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]
             | Annotated[list[list[int]], Field(min_length=1)])
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_given(cls, value):
        """[] fails every member of the union; this one error names the field instead of each member."""
        if isinstance(value, list) and not value:
            raise ValueError("an empty list holds no prompt to complete")
        return value

    def unsupported(self):
        if self.echo:
            return "echo", self.echo
        if self.suffix:
            return "suffix", self.suffix
        if self.best_of not in (None, self.n):  # best_of == n returns every candidate: plain n
            return "best_of", self.best_of
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class ToolCallIn(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        m = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in self.tool_calls]
        if self.reasoning_content is not None:
            m["reasoning_content"] = self.reasoning_content
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # the request's own template (vLLM's field): needs the server's opt-in

    def check(self) -> None:
        """What pydantic cannot say alone; each error starts with the field's name."""
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise ValueError(f"messages[{i}].content must be given for role {m.role!r} (only an assistant "
                                 "turn with tool_calls may leave it out)")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError(f"tool_choice {_shown(choice)!r} needs tools, but none are offered")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the "
                             f"tools offered: {self.tool_names()}")
        names = self.tool_names()
        if len(set(names)) != len(names):
            raise ValueError(f"tools must have distinct names, got {names}")
        reserved = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_RESERVED)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: the server sets them, or they are "
                             "options of HF's apply_chat_template, not template variables")
        with_request_template(self.chat_template_kwargs, self.chat_template)  # given once at most
        if self.structured():
            if self.forced_prefix():
                raise ValueError(f"response_format {self.response_format.type!r} cannot be combined with "
                                 f"tool_choice {_shown(choice)!r}: both constrain the whole reply")
            if (self.chat_template_kwargs or {}).get("enable_thinking") is True:
                raise ValueError(f"response_format {self.response_format.type!r} cannot be combined with "
                                 "enable_thinking true: the grammar constrains the whole reply, thinking included")

    def structured(self) -> bool:
        """Whether response_format asks for structured output."""
        return self.response_format is not None and self.response_format.type != "text"

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def effective_tool_choice(self) -> str | NamedToolChoice:
        if not self.tools or self.tool_choice == "none":
            return "none"
        return self.tool_choice or "auto"

    def chat_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools the prompt lists: none when tool_choice is "none"."""
        if self.effective_tool_choice() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_kwargs(self) -> dict:
        """chat_template_kwargs, with the chat_template field in it as "chat_template" (render_chat's key)."""
        kwargs = with_request_template(self.chat_template_kwargs, self.chat_template)
        if self.forced_prefix() or self.structured():
            kwargs["enable_thinking"] = False  # the call, or the structured reply, starts right after the prompt
        return kwargs

    def forced_prefix(self) -> str:
        """The start of a tool call that "required" or a named function puts at the end of the prompt
        (the rest is constrained by cluster/openai/tool_grammar.py's grammar, which starts where this ends)."""
        choice = self.effective_tool_choice()
        if isinstance(choice, NamedToolChoice):
            # no space after the colon: the model's tokens put it in front of the next "{"
            return '<tool_call>\n{"name": ' + json.dumps(choice.function.name) + ', "arguments":'
        return '<tool_call>\n{"name": "' if choice == "required" else ""

    def stop_strings(self) -> list[str]:
        """Stop strings: the client's, plus the end of a call when only one call may be made."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        one_call = isinstance(self.effective_tool_choice(), NamedToolChoice) or not self.parallel_tool_calls
        if self.effective_tool_choice() != "none" and one_call:
            stop.append("</tool_call>")
        return stop

    def grammar(self) -> GrammarSpec | None:
        """response_format's grammar, or a forced tool call's (the part after forced_prefix)."""
        choice = self.effective_tool_choice()
        if choice == "required" or isinstance(choice, NamedToolChoice):
            from cluster.openai.tool_grammar import tool_call_grammar
            from workers.sampling.grammar import xgrammar_available

            if not xgrammar_available():  # as before xgrammar: the prompt forces the call's start only
                return None

            tools = [{"name": t.function.name, "parameters": t.function.parameters} for t in self.tools]
            return tool_call_grammar(tools, choice.function.name if isinstance(choice, NamedToolChoice) else None)
        return super().grammar()

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def sampling_params(self, max_tokens_default, logprobs, defaults=None) -> SamplingParams:
        self.check()
        params = super().sampling_params(max_tokens_default, logprobs, defaults)
        stop = self.stop_strings()
        return dataclasses.replace(params, stop=tuple(stop)) if stop else params

    def logprobs_n(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise ValueError(f"top_logprobs needs logprobs=true, got top_logprobs={self.top_logprobs}")
            return None
        return self.top_logprobs if self.top_logprobs is not None else 0


TEMPLATE_RESERVED = RESERVED_TEMPLATE_KWARGS  # cluster/core/chat_template.py says which and why


def _shown(value) -> object:
    return value.model_dump() if isinstance(value, BaseModel) else value


# ---- responses ----
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason)


MIN_LOGPROB = -9999.0  # what a ruled-out token's logprob (-inf) is sent as, as vLLM's server does: JSON has no inf


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token a grammar or a filter rules out, among the top
    n when fewer than n are allowed), anything else below MIN_LOGPROB, and NaN become MIN_LOGPROB."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(lps: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    if lps is None:
        return None
    offsets, pos = [], text_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [json_logprob(lp.logprob) for lp in lps],
            "top_logprobs": [{t: json_logprob(v) for _, t, v in lp.top} for lp in lps], "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None
    return {"content": [
        {"token": lp.token, "logprob": json_logprob(lp.logprob), "bytes": list(lp.token.encode()),
         "top_logprobs": [{"token": t, "logprob": json_logprob(v), "bytes": list(t.encode())} for _, t, v in lp.top]}
        for lp in lps]}


def completion_response(rid: str, model: str, outputs: list[RequestOutput]) -> dict:
    """One output per prompt, each with its n choices: choice i of prompt p is index p*n + i."""
    choices = [{"index": p * len(o.outputs) + c.index, "text": c.text, "logprobs": completion_logprobs(c.logprobs),
                "finish_reason": finish_reason(c.finish_reason)} for p, o in enumerate(outputs) for c in o.outputs]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(sum(o.num_prompt_tokens for o in outputs),
                                               sum(o.num_generated_tokens for o in outputs))}


def chat_response(rid: str, model: str, out: RequestOutput, parsers: list | None = None) -> dict:
    """parsers: each choice's ChatOutput (reasoning and tool calls); None leaves the text as content."""
    choices = []
    for c in out.outputs:
        if parsers is None:
            message, reason = {"role": "assistant", "content": c.text}, finish_reason(c.finish_reason)
        else:
            parsed = parsers[c.index]
            message, reason = parsed.message(c.text), finish_reason(parsed.finish_reason(c.finish_reason))
        choices.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c.logprobs),
                        "finish_reason": reason})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(out.num_prompt_tokens, out.num_generated_tokens)}


def completion_chunk(rid: str, model: str, created: int, delta: StreamDelta, text_offset: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": delta.index, "text": delta.text,
                         "logprobs": completion_logprobs(delta.logprobs, text_offset),
                         "finish_reason": finish_reason(delta.finish_reason)}]}


class CompletionChunkText:
    """completion_chunk's JSON text for a delta without logprobs, from a prefix encoded once
    per stream: the same object, in the same key order, as json.dumps(completion_chunk(...))."""

    def __init__(self, rid: str, model: str, created: int):
        head = json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model},
                          ensure_ascii=False)
        self.head = head[:-1] + ', "choices": [{"index": '

    def __call__(self, delta: StreamDelta) -> str:
        reason = finish_reason(delta.finish_reason)
        return (f'{self.head}{delta.index}, "text": {json.dumps(delta.text, ensure_ascii=False)}, '
                f'"logprobs": null, "finish_reason": {"null" if reason is None else json.dumps(reason)}}}]}}')


def chat_chunk(rid: str, model: str, created: int, delta: dict, logprobs=None, reason: str | None = None,
               index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish_reason(reason)}]}


def usage_chunk(rid: str, obj: str, model: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
