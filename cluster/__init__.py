"""raylm's public face: launch or connect to an engine, then generate.

    import cluster
    with cluster.launch() as llm:            # the bundled tiny Qwen3 on the CPU
        print(llm.generate("北京故宫是", cluster.SamplingParams(max_tokens=32)).text)
"""

from __future__ import annotations

import logging

from cluster.config import EngineConfig
from cluster.errors import EngineDeadError, EngineOverloadedError
from cluster.handle import LLMHandle
from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta, TokenLogprob
from scheduler.request import SamplingParams

log = logging.getLogger(__name__)

__all__ = [
    "launch", "connect", "LLMHandle", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
    "StreamDelta", "TokenLogprob", "RequestMetrics", "EngineOverloadedError", "EngineDeadError",
]


def ensure_ray(address: str | None = None) -> bool:
    """Join a running Ray (this process's, `address`, or one started with `ray start`),
    else start a local one. Returns True when this call initialized Ray here.

    A Ray started here runs its workers at this process's priority: Ray's default renices
    worker processes to 15, so on a busy host the HTTP server and its clients (at 0)
    would starve the engine and its workers (set RAY_worker_niceness to override)."""
    import os

    import ray

    if ray.is_initialized():
        return False
    opts = dict(include_dashboard=False, logging_level=logging.WARNING)
    if address == "local":  # a new single-node Ray of our own, whatever else runs here
        os.environ.setdefault("RAY_worker_niceness", "0")
    if address not in (None, "local"):
        _check_reachable(address)
    if address is not None:
        ray.init(address=address, **opts)
        return True
    try:
        _check_reachable("auto")
        ray.init(address="auto", **opts)
    except ConnectionError as e:
        if isinstance(e, RayUnreachableError):
            log.warning("%s; starting a Ray of this process's own instead", e)
        os.environ.setdefault("RAY_worker_niceness", "0")  # read by the raylet this starts
        ray.init(address="local", **opts)  # not None: that would read the stale address file again
    return True


PROBE_TIMEOUT_S = 3.0


class RayUnreachableError(ConnectionError):
    """A Ray address (given, or found for "auto") where nothing accepts a connection."""


def _check_reachable(address: str) -> None:
    """ConnectionError, naming the address and where it came from, when the Ray that
    `address` ("auto": RAY_ADDRESS or the address file of the last `ray start`) points to
    does not accept a TCP connection: ray.init would retry it for minutes (a cluster that
    stopped without `ray stop` leaves its address file behind). Nothing found for "auto"
    is left to ray.init (it says so); Ray Client addresses are not probed."""
    import os
    import socket

    source = "the address given"
    if address == "auto":
        try:
            from ray._private.services import get_ray_address_from_environment
            from ray._private.utils import get_ray_address_file

            resolved = get_ray_address_from_environment("auto", None)
        except ConnectionError:
            return  # no Ray found: ray.init raises its own ConnectionError
        except Exception:  # Ray's private helpers moved: let ray.init find it
            return
        source = ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else
                  f"{get_ray_address_file(None)}, written by the last `ray start`")
        address = resolved
    if not isinstance(address, str) or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()  # "[::1]:6379"
    except OSError as e:
        raise RayUnreachableError(f"the Ray cluster at {address} (from {source}) does not answer ({e}); start it "
                              f"(`ray start --head`), point RAY_ADDRESS or --address elsewhere, or use "
                              f"--address local") from None


def launch(model: str | None = None, device: str = "cpu", num_replicas: int = 1, **config) -> LLMHandle:
    """Start an engine driven from this process. No model: the bundled tiny Qwen3.
    Keyword options are EngineConfig fields (validated; unknown ones are an error)."""
    from cluster.engine import Engine

    cfg = EngineConfig.from_kwargs(model=model, device=device, num_replicas=num_replicas, **config)
    owns_ray = ensure_ray()
    try:
        engine = Engine(cfg).start()
    except BaseException:
        if owns_ray:
            import ray

            ray.shutdown()
        raise
    return LLMHandle(engine, owns_ray=owns_ray)


def connect(name: str = "raylm", *, address: str | None = None, namespace: str = "raylm",
            lease_s: float = 30.0) -> LLMHandle:
    """A handle to an engine started by `raylm serve` (a named, detached actor).
    If this process stops answering for `lease_s` seconds (it died, its network went
    away), the engine aborts the requests it left running."""
    from cluster.engine_client import EngineClient

    owns_ray = ensure_ray(address)
    return LLMHandle(EngineClient.attach(name, namespace, lease_s=lease_s), owns_ray=owns_ray)
