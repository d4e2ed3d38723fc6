"""The HTTP server's connection limits, and the one place uvicorn's options are built.

uvicorn bounds concurrency (`limit_concurrency`: past it a request gets a 503 and its
connection is closed), idle keep-alive connections (`timeout_keep_alive`) and the listen
backlog. Its httptools protocol bounds nothing else: a connection that sends nothing, or
a request's headers a byte at a time, stays open for good, and a request's headers may be
megabytes long or number in the tens of thousands (`h11_max_incomplete_event_size` is the
h11 protocol's alone). LimitedHttpToolsProtocol (cluster/openai/http_protocol.py) adds those
bounds: a request's head (its request line and headers) must arrive within
`request_header_timeout` seconds (else 408, or a plain close when nothing arrived), in at
most `max_header_bytes` bytes and `max_headers` headers (else 431); either way the
connection is closed. A request body must arrive within `request_body_timeout` seconds of
the handler's first read (408, from cluster/openai/app.py's BodyLimit, which counts the body's
bytes already).

Both places the server runs (the engine actor's process, cluster/openai/http_server.py, and
`raylm serve --frontend process`, cluster/cli.py) take uvicorn's options from
uvicorn_options(), so each limit is set once. This module imports neither uvicorn nor
pydantic: the CLI reads its defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import math

DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's and vLLM's
DEFAULT_LIMIT_CONCURRENCY = 4096  # open connections plus running requests
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # request line and headers
DEFAULT_MAX_HEADERS = 100  # as Apache's LimitRequestFields
DEFAULT_REQUEST_HEADER_TIMEOUT_S = 10.0
DEFAULT_REQUEST_BODY_TIMEOUT_S = 60.0
DEFAULT_BACKLOG = 2048  # uvicorn's
GRACEFUL_SHUTDOWN_S = 5  # how long a stopping server waits for open requests


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one HTTP connection may hold and for how long; `limit_concurrency` None: no limit."""

    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    request_header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT_S
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    backlog: int = DEFAULT_BACKLOG

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "request_header_timeout", "request_body_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("max_header_bytes", "max_headers", "backlog", "limit_concurrency"):
            value = getattr(self, name)
            if name == "limit_concurrency" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def uvicorn_options(limits: HttpLimits, access_log: bool) -> dict:
    """uvicorn.Config's keyword arguments, the app and where to listen aside. Lifespan off:
    the app has no startup hooks (and uvicorn exits when one fails); no WebSockets."""
    from cluster.openai.http_protocol import LimitedHttpToolsProtocol

    return dict(http=functools.partial(LimitedHttpToolsProtocol, limits=limits), ws="none", lifespan="off",
                log_level="info", access_log=access_log, timeout_keep_alive=limits.timeout_keep_alive,
                limit_concurrency=limits.limit_concurrency, backlog=limits.backlog,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
