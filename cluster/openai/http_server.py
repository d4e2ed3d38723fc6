"""The HTTP server inside the engine actor's process: `raylm serve`'s default frontend.

With the HTTP server in a process of its own, every request and every delta crosses the
frontend channel (cluster/remote/messages.py): msgpack both ways, a Ray call per batch on each
side, a second event loop, Ray's threads in two processes, all of it CPU taken from the cores
the workers share (docs/benchmarks.md measures it). Here uvicorn runs in the engine actor's process on a
thread and event loop of its own (uvloop where installed), and its routes hold a local
LLMHandle over the actor's Engine: a request goes straight to the scheduler and its
deltas come back through its RequestStream's loop handoff, as in `cluster.launch()`.
Other frontends (`cluster.connect()`) still attach over the channel. `raylm serve
--frontend process` keeps the separate process (for a host with cores to spare, where
one GIL for the HTTP thread and the replica threads would be the limit).

The socket is bound before the engine loads, so /health answers 503 "loading" meanwhile
and a port in use is an error at once.
"""

from __future__ import annotations

import asyncio
import socket
import threading

from cluster.openai.http_limits import DEFAULT_BACKLOG
from cluster.openai.serving_config import ServingConfig


def bind(host: str, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """A listening TCP socket on host:port (OSError, naming both, when it cannot be had)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


class HttpServer:
    """uvicorn serving build_app() from a thread of this process, as `serving` says."""

    def __init__(self, serving: ServingConfig):
        from cluster.openai.app import ServerState

        if not isinstance(serving, ServingConfig):
            raise ValueError(f"serving must be a ServingConfig, got {type(serving).__name__}")
        self.serving = serving
        self.limits = serving.limits
        self.state = ServerState(list(serving.model_names), serving.api_key, serving.metrics_without_auth)
        self._server = None
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        import uvicorn

        from cluster.openai.app import build_app
        from cluster.openai.http_limits import uvicorn_options

        sock = bind(self.serving.host, self.serving.port, self.limits.backlog)
        app = build_app(self.state, self.serving.max_body_bytes,
                        self.limits.request_body_timeout)
        config = uvicorn.Config(app, **uvicorn_options(self.limits, self.serving.access_log))
        self._server = uvicorn.Server(config)
        # its own thread and loop (uvloop where installed, as `uvicorn.run` picks), not the actor's:
        # no signal handlers there, and a failure ends that thread, not the actor
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="raylm-http",
                                        daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                sock.close()
                raise RuntimeError(f"the HTTP server on {self.serving.host}:{self.serving.port} did not start "
                                   "(its log says why)")
            await asyncio.sleep(0.01)

    def serve(self, handle) -> None:
        """The engine is up: routes answer from `handle` from now on."""
        self.state.handle = handle

    def failed(self, reason: str) -> None:
        """The engine could not start: /health is 503 "unavailable" with the reason."""
        self.state.startup_error = reason

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def stop(self) -> None:
        if self._server is not None and self.running:
            self._server.should_exit = True
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
