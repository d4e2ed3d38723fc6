"""What an engine's clients (RemoteEngine, the Serve ingress's ServeEngine) share: ClientTokenizer,
the model's tokenizer in the client's process where the model's files are, and ClientEngine, what
a client keeps of the engine it reaches and how it puts a request on the wire.

A frontend that tokenizes and renders chat templates itself (a `cluster.connect()` handle, the
HTTP server of `raylm serve --frontend process`, the Ray Serve ingress) takes that CPU off the
engine's process, whose GIL its replica loops share. Where the files are not on the
frontend's machine (or the model is a random-weights spec), the engine does it instead.
"""

from __future__ import annotations

import uuid

from cluster.config import EngineConfig
from cluster.core.chat_template import encode_prompt, render_chat


class ClientTokenizer:
    def __init__(self, model_path: str, trust_request_chat_template: bool = False, tokenizer=None):
        self.model_path = model_path
        self.trust_request_chat_template = trust_request_chat_template
        self._tokenizer = tokenizer
        if tokenizer is not None:
            return
        # loaded now, not on the first request: it imports transformers and torch (seconds), and a
        # frontend tokenizes on its event loop, which would stall every request meanwhile
        try:
            self._tokenizer = self._load()
        except Exception:  # a random-weights spec, or the files live on other nodes only
            self._tokenizer = None

    def _load(self):
        from workers.loader import load_tokenizer

        return load_tokenizer(self.model_path)

    @property
    def tokenizer(self):
        """The tokenizer (loading it from the model path raises where the files are not here)."""
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return self._tokenizer

    @property
    def local(self):
        """The tokenizer when this process has it, else None."""
        return self._tokenizer

    def encode(self, prompt: str) -> list[int] | None:
        """A text prompt's token ids as the engine would compute them; None: the engine tokenizes."""
        return encode_prompt(self._tokenizer, prompt) if self._tokenizer is not None else None

    def render(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> str | None:
        """The chat template's prompt text; None: the engine renders it."""
        if self._tokenizer is None:
            return None
        return render_chat(self._tokenizer, messages, tools, template_kwargs, self.trust_request_chat_template)


class ClientEngine:
    """The engine's facts from its `info` (config, model path, lengths, sampling defaults) and the
    client-side tokenizer; subclasses send requests their own way."""

    def __init__(self, info: dict):
        self.info = info
        self.config = EngineConfig(**info["config"])
        self.model_path = info["model_path"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.sampling_defaults = info.get("sampling_defaults") or {}
        self.client_tokenizer = ClientTokenizer(self.model_path, self.config.trust_request_chat_template)

    @property
    def tokenizer(self):
        return self.client_tokenizer.tokenizer

    def encode_text(self, prompt: str) -> list[int] | None:
        return self.client_tokenizer.encode(prompt)

    def wire_request(self, prompt, request_id: str | None, prompt_token_ids: list[int] | None) -> tuple[str, object]:
        """(request id, the prompt as sent): token ids where this process can tokenize (or the caller
        did, `prompt_token_ids`), else the prompt as given."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        if prompt_token_ids and isinstance(prompt, str):
            return rid, list(prompt_token_ids)
        wire = self.encode_text(prompt) if isinstance(prompt, str) else None
        return rid, prompt if wire is None else wire
