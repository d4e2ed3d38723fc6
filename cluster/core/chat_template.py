"""The prompt text of a chat, checked and rendered with a chat template, within bounds.

`render_chat` serves the engine (cluster/core/engine.py) and every connected frontend
(cluster/remote/remote_engine.py), which renders and tokenizes locally when it has the model's
tokenizer, so the engine actor's event loop spends no time on templates or tokenizing.

The model's own template renders through HF's apply_chat_template. A template a request brings
(the `chat_template` field, or chat_template_kwargs.chat_template: vLLM's names) is the client's
code: it is refused unless the server opted in (EngineConfig.trust_request_chat_template,
`raylm serve --trust-request-chat-template`, as vLLM's --trust-request-chat-template), and then
renders in raylm's own sandbox (cluster/core/template_sandbox.py), with the variables HF gives a
template, within MAX_RENDER_S and MAX_PROMPT_CHARS. Every failure of a template is a
ValueError that starts with the field at fault: "chat_template: ..." for the request's
template, "messages: ..." for the model's template failing on the messages given.
"""

from __future__ import annotations

from collections.abc import Mapping

import jinja2

from cluster.core.template_sandbox import MAX_PROMPT_CHARS, BoundExceeded, render_bounded

# set by the server, or options of HF's apply_chat_template that change what it returns
# rather than variables of the template; chat_template is the one option a request may give
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "add_generation_prompt", "conversation", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# what the model's own template may raise on messages it cannot format (raise_exception is a TemplateError)
_TEMPLATE_FAILURES = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError, AttributeError,
                      RecursionError, MemoryError)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # HF's names for a message's reasoning


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None, trust_request_template: bool = False) -> str:
    """OpenAI-style messages (an assistant turn may carry tool_calls and no content), the
    tools offered, and extra template variables such as enable_thinking -> prompt text.

    template_kwargs["chat_template"], when given, is the request's own template: refused
    unless `trust_request_template` (the server's opt-in), else rendered in the bounded sandbox.
    """
    _check_chat(messages, tools)
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: the server sets them, or they are options "
                         "of HF's apply_chat_template, not template variables")
    source = kwargs.pop("chat_template", None)
    if source is None:
        return _render_model_template(tokenizer, messages, tools, kwargs)
    if not trust_request_template:
        raise ValueError(f"chat_template: request-supplied chat templates (the chat_template field or "
                         f"chat_template_kwargs.chat_template) are refused, got {source!r:.60}; the server must be "
                         "started with --trust-request-chat-template")
    if not isinstance(source, str) or not source:
        raise ValueError(f"chat_template must be a non-empty Jinja template string, got {source!r:.80}")
    try:
        return render_bounded(source, template_context(tokenizer, messages, tools, kwargs))
    except BoundExceeded as e:
        raise ValueError(f"chat_template: {e}") from None
    except Exception as e:  # the client's own code failing, whatever it raised
        raise ValueError(f"chat_template: the request's chat template failed: {_described(e)}") from None


def with_request_template(template_kwargs: dict | None, chat_template: str | None) -> dict:
    """A request's chat_template_kwargs with its top-level chat_template field (vLLM's name
    for a request's template) put in as "chat_template", where render_chat looks for it."""
    kwargs = dict(template_kwargs or {})
    if chat_template is not None:
        if "chat_template" in kwargs:
            raise ValueError("chat_template: given both as a field and in chat_template_kwargs; give it once")
        kwargs["chat_template"] = chat_template
    return kwargs


def template_context(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> dict:
    """The variables HF's apply_chat_template gives a template (transformers'
    render_jinja_template): the tokenizer's special tokens (bos_token, eos_token, ...) and
    the caller's kwargs; messages without their None-valued keys, reasoning also under
    HF's other names for it; tools; documents; add_generation_prompt. Everything is
    rebuilt from plain JSON types, as HF does, so the template meets no object's methods."""
    kwargs = dict(kwargs)
    documents = kwargs.pop("documents", None)
    chat = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        chat.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    special = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    return _plain({**special, **kwargs, "messages": chat, "tools": tools or None, "documents": documents,
                   "add_generation_prompt": True})


def _render_model_template(tokenizer, messages, tools, kwargs: dict) -> str:
    """The model's own template through HF (as always); its failures and an output over
    MAX_PROMPT_CHARS are the messages' fault: the template is the server's."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except _TEMPLATE_FAILURES as e:
        raise ValueError(f"messages: the model's chat template failed on these messages: {_described(e)}") from None
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"messages: the chat renders to a prompt of {len(text):,} characters, over the bound of "
                         f"{MAX_PROMPT_CHARS:,} (MAX_PROMPT_CHARS)")
    return text


def _check_chat(messages, tools) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {messages!r:.200}")
    for i, m in enumerate(messages):
        content_ok = isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls"))
        if not isinstance(m.get("role"), str) or not content_ok:
            raise ValueError(f"messages[{i}] needs string 'role' and 'content', got {m!r:.200}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of dicts, got {tools!r:.200}")


def _described(e: BaseException) -> str:
    where = f" (line {e.lineno})" if isinstance(e, jinja2.TemplateSyntaxError) and e.lineno else ""
    return f"{type(e).__name__}: {str(e):.300}{where}"


def _plain(value):
    """value rebuilt from JSON types (str, int, float, bool, None, dict, list, tuple); any
    other object becomes a placeholder naming its type, as HF's _plain_template_data does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A text prompt's token ids, as the engine encodes them (no special tokens added)."""
    if not prompt:
        raise ValueError("prompt must not be empty")
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return backend.encode(prompt, add_special_tokens=False).ids
    return tokenizer.encode(prompt, add_special_tokens=False)


def _plain_backend(tokenizer):
    """The Rust tokenizer behind a fast HF tokenizer, when calling it directly gives what `tokenizer.encode` gives.

    `encode` wraps it in a batch of one, keyword handling and a BatchEncoding (~15% of a 128-token
    prompt's encode, paid per request on the serving path). Direct calls are only equivalent while the
    backend neither truncates nor pads (transformers resets both per call; a tokenizer.json may set them),
    so anything else keeps the wrapper.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "encode", None)):
        return None
    plain = getattr(backend, "truncation", None) is None and getattr(backend, "padding", None) is None
    return backend if plain else None
