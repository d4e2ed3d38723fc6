"""The prompt text of a chat, checked and rendered with the model's own template.

One function serves the engine (cluster/engine.py) and every connected frontend
(cluster/engine_client.py), which renders and tokenizes locally when it has the model's
tokenizer, so the engine actor's event loop spends no time on templates or tokenizing.
"""

from __future__ import annotations

_RESERVED = {"messages", "tools", "add_generation_prompt", "tokenize"}


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """OpenAI-style messages (an assistant turn may carry tool_calls and no content), the
    tools offered, and extra template variables such as enable_thinking -> prompt text."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {messages!r}")
    for i, m in enumerate(messages):
        content_ok = isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls"))
        if not isinstance(m.get("role"), str) or not content_ok:
            raise ValueError(f"messages[{i}] needs string 'role' and 'content', got {m!r}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of dicts, got {tools!r:.200}")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=True, **kwargs)


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
