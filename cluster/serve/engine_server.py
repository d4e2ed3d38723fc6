"""EngineServer: one raylm engine as a Ray Serve replica (the "RaylmEngine" deployment).

Each Serve replica is a whole LocalEngine: its scheduler(s), step loops, detokenizer, and the
worker actors it starts. The deployment's `placement_group_bundles` ask for those workers'
resources (a bundle per rank: its NPU / GPU and CPUs); Serve reserves them as one placement
group before the replica starts and the engine puts its ranks in those bundles
(cluster/core/placement.py), so an engine and its workers are placed, scaled and replaced as
one unit. The replica itself asks for no CPU of its own and shares bundle 0 with rank 0.

Requests come from the ingress through Serve's DeploymentHandle, one call per request:
`generate([request_id, prompt, params, group])` streams that request's deltas, each item the
msgpack of every delta that arrived since the last item (cluster/remote/messages.py's entries).
The first delta leaves at once (time to first token is not delayed); later ones are held until
`stream_interval_ms` has passed since the last item (or the request ends) and sent joined into
one delta, as Ray Serve LLM batches its streams: each item costs a Ray object and a wake-up in
three processes (engine, ingress, Serve's proxy), and each delta its encoding and decoding, which
at one token per item were most of the path's cost (docs/benchmarks.md).
Serve cancelling the call (the client went away) aborts the request.

`check_health` is Serve's health check: it fails only when no replica of this engine can serve
and none is on its way back (every one gave up or stopped), so Serve replaces an engine that
cannot recover by itself and leaves one alone while it restarts a worker.
"""

from __future__ import annotations

import asyncio
import sys

import cluster.remote.messages as messages
from cluster.config import DEFAULT_GIL_SWITCH_INTERVAL_MS, EngineConfig
from cluster.openai.serving_config import DEFAULT_MAX_BODY_BYTES
from cluster.outputs import StreamDelta
from cluster.remote.engine_calls import EngineCalls

DEFAULT_STREAM_INTERVAL_MS = 50.0


def check_stream_interval_ms(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 10_000:
        raise ValueError(f"stream_interval_ms must be a number of milliseconds in [0, 10000], got {value!r}")


class EngineServer(EngineCalls):
    async def __init__(self, config: dict, stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS,
                       gil_switch_interval_ms: float | None = DEFAULT_GIL_SWITCH_INTERVAL_MS):
        from cluster.core.engine import LocalEngine

        check_stream_interval_ms(stream_interval_ms)
        if gil_switch_interval_ms is not None:  # the step loops share the GIL with Serve's event loop, as in
            sys.setswitchinterval(gil_switch_interval_ms / 1000)  # raylm serve's engine actor (engine_actor.py)
        self.stream_interval_s = stream_interval_ms / 1000
        self.engine = LocalEngine(EngineConfig(**config))
        await asyncio.get_running_loop().run_in_executor(None, self.engine.start)

    async def generate(self, request: list):
        """One request's deltas, in batches: [request_id, prompt (text or token ids), params
        (SamplingParams fields or None), group]."""
        request_id, prompt, params, group = request
        loop = asyncio.get_running_loop()
        stream = self.engine.add_request(prompt, messages.params_from(params), request_id, loop, group=group)
        held, sent_at = [], None
        try:
            async for batch in stream.batches():
                held += batch
                now = loop.time()
                if sent_at is None or held[-1].finished or now - sent_at >= self.stream_interval_s:
                    yield messages.pack([messages.delta_entry(StreamDelta.joined(held))])
                    held, sent_at = [], now
        finally:  # finished, failed, or cancelled by Serve because the caller went away
            for rid in stream.unfinished_ids():
                self.engine.abort(rid)

    async def check_health(self) -> None:
        h = await self.health()
        if h["status"] == "unavailable" and not any(r["state"] in ("starting", "restarting") for r in h["replicas"]):
            raise RuntimeError(f"raylm engine cannot serve: {h['reason']}")

    def __del__(self):  # Serve stops the replica: stop the workers with it
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class DirectEngineServer(EngineServer):
    """An engine replica that is also the HTTP ingress (`ingress="direct"`): the OpenAI app runs
    in the replica over its own engine, as in `raylm serve`'s one process, and Serve's HAProxy
    ingress forwards each connection straight to it (no Python proxy, no ingress replica relaying
    the stream). Serve wraps it with `serve.ingress()`; its ASGI app is built after the engine
    has started."""

    async def __init__(self, config: dict, stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS,
                       gil_switch_interval_ms: float | None = DEFAULT_GIL_SWITCH_INTERVAL_MS,
                       model_names: tuple[str, ...] = (), api_key: str | None = None,
                       metrics_without_auth: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        from cluster.handle import LLMHandle
        from cluster.openai.app import ServerState

        await super().__init__(config, stream_interval_ms, gil_switch_interval_ms)
        self.state = ServerState(list(model_names), api_key, metrics_without_auth)
        self.state.handle = LLMHandle(self.engine)
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        from cluster.openai.app import build_app

        return build_app(self.state, self.max_body_bytes)
