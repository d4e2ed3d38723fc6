"""Engine: what LLMHandle needs of an engine, whichever process it runs in.

LocalEngine (cluster/core/engine.py) drives its replicas from this process; RemoteEngine
(cluster/remote/remote_engine.py) reaches one running as a named Ray actor. Both implement
this protocol, and LLMHandle depends on nothing else of either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cluster.config import EngineConfig
    from cluster.core.stream import RequestStream
    from scheduler.request import SamplingParams


class Engine(Protocol):
    config: EngineConfig
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict  # the checkpoint's recommended sampling, for requests that leave it unset

    @property
    def tokenizer(self): ...

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, loop=None, sink=None, group: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Accept a request; its deltas go to the returned stream (or to `sink`)."""

    def abort(self, request_id: str) -> bool: ...

    def encode_text(self, prompt: str) -> list[int] | None:
        """A text prompt's ids as add_request would compute them; None where no tokenizer is at hand."""

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> str: ...

    def health(self) -> dict: ...

    def stats(self) -> dict: ...

    def worker_stats(self) -> list[dict]: ...

    def metrics_text(self) -> bytes: ...

    def shutdown(self) -> None: ...
