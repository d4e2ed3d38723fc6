"""/tokenize and /detokenize, as vLLM's OpenAI server has them (its load client and
users' tooling probe them): a prompt or a chat's messages -> token ids, and back. A chat may
bring its own template (chat_template), refused unless the server opted in (cluster/core/chat_template.py)."""

from __future__ import annotations

from cluster.core.chat_template import with_request_template
from cluster.openai.api_models import ChatMessage, StrictModel


class TokenizeRequest(StrictModel):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # rendered with the chat template first
    add_special_tokens: bool = True
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # the request's own template (vLLM's field): needs the server's opt-in

    def unsupported(self):
        return None


class DetokenizeRequest(StrictModel):
    model: str
    tokens: list[int]

    def unsupported(self):
        return None


def tokenize(handle, body: TokenizeRequest) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise ValueError(f"give exactly one of prompt and messages, got prompt={body.prompt!r:.80} "
                         f"and {'no' if body.messages is None else len(body.messages)} messages")
    if body.messages is None and body.chat_template is not None:
        raise ValueError(f"chat_template formats messages, but this request gives a prompt: {body.prompt!r:.80}")
    tok = handle.tokenizer
    if body.messages is not None:
        kwargs = with_request_template(body.chat_template_kwargs, body.chat_template)
        text = handle.apply_chat_template([m.for_template() for m in body.messages], None, kwargs)
        ids = tok.encode(text, add_special_tokens=False)  # the template wrote the special tokens
    else:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": handle.max_model_len, "tokens": ids}


def detokenize(handle, body: DetokenizeRequest) -> dict:
    vocab = len(handle.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"tokens must be ids in [0, {vocab}), got {bad[:5]}")
    return {"prompt": handle.tokenizer.decode(body.tokens)}
