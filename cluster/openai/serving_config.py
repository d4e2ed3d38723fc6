"""ServingConfig: how `raylm serve` serves HTTP, validated once where the CLI reads it.

Where it listens, who may call it, what one request may hold and how long a connection may
take (HttpLimits), and in which process the server runs. EngineConfig says how the engine runs;
this says how it is served: `raylm serve` builds both, and the HTTP server (in the engine actor's
process, or in its own) takes this one whole. No uvicorn or pydantic import: the CLI reads it.
"""

from __future__ import annotations

import dataclasses
import os

from cluster.openai.http_limits import HttpLimits

DEFAULT_MAX_BODY_BYTES = 1 << 20
def served_model_name(model: str | None) -> str:
    """The model id the API answers to by default: the checkpoint directory's name."""
    return os.path.basename(os.path.normpath(model)) if model else "tiny-qwen3"


HTTP_PROCESSES = ("engine", "process")  # where the server runs: the engine actor's process, or the CLI's own
# under Ray Serve (cluster/serve/deployments.py): an OpenAI ingress deployment before the engines, or none
SERVE_INGRESS_MODES = ("deployment", "direct")


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    model_names: tuple[str, ...]  # the model ids the API answers to
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # every route but /health needs it when set
    metrics_without_auth: bool = False  # /metrics open without the key, for a scraper that has none
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    access_log: bool = True
    limits: HttpLimits = HttpLimits()
    # advanced: "engine" serves from the engine actor's process (no channel between them); "process"
    # from the CLI's own, over the channel, for a host whose cores would make one GIL the limit
    http_process: str = "engine"

    def __post_init__(self) -> None:
        names = self.model_names
        if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"model_names must be a non-empty list of model ids, got {names!r}")
        object.__setattr__(self, "model_names", tuple(names))
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if not isinstance(self.limits, HttpLimits):
            raise ValueError(f"limits must be an HttpLimits, got {self.limits!r}")
        if self.http_process not in HTTP_PROCESSES:
            raise ValueError(f"http_process must be one of {HTTP_PROCESSES}, got {self.http_process!r}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
