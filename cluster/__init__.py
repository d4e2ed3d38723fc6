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
    else start a local one; say which, and why. Returns True when this call initialized Ray here.

    Joining a Ray this process did not start is logged as a warning naming its address and how
    it was found (the address given, RAY_ADDRESS, or the address file of the last `ray start`
    on this machine), since its resources may belong to someone else: `address="local"` starts a
    private one instead. A Ray nothing points to is never joined: ray.init("auto") would also
    take one it finds among this machine's processes, which is another program's own (a
    `raylm serve --address local`, a notebook's ray.init()), so then a private one is started.
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
        ray.init(address="local", **opts)
        log.info("raylm: started a Ray of this process's own (address='local')")
        return True
    if address is not None:
        _check_reachable(address)
        ray.init(address=address, **opts)
        _joined(address, "the address given")
        return True
    if not _pointed_to():
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", **opts)
        log.info("raylm: no Ray pointed to (RAY_ADDRESS, `ray start`'s address file); started one of this process's "
                 "own (pass a running Ray's address to join it)")
        return True
    try:
        found = _check_reachable("auto")
        ray.init(address="auto", **opts)
    except ConnectionError as e:
        if isinstance(e, RayUnreachableError):
            log.warning("%s; starting a Ray of this process's own instead", e)
        os.environ.setdefault("RAY_worker_niceness", "0")  # read by the raylet this starts
        ray.init(address="local", **opts)  # not None: that would read the stale address file again
        log.info("raylm: no running Ray found; started one of this process's own")
        return True
    if found is None:  # found by ray.init itself
        found = (ray.get_runtime_context().gcs_address, "ray.init's search")
    _joined(*found)
    return True


def _pointed_to() -> bool:
    """Whether something points "auto" at a Ray: RAY_ADDRESS, or the address file `ray start` writes."""
    import os

    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        from ray._private.utils import get_ray_address_file

        path = get_ray_address_file(None)
    except Exception:  # Ray's private helper moved: let ray.init look as it does
        return True
    try:
        with open(path, encoding="utf-8") as f:
            return bool(f.read().strip())
    except OSError:
        return False


def _joined(address: str, source: str) -> None:
    log.warning("raylm: joined the running Ray at %s (from %s); its resources may be in use by others: "
                "pass address='local' (raylm serve --address local) for a Ray of this process's own", address, source)


PROBE_TIMEOUT_S = 3.0


class RayUnreachableError(ConnectionError):
    """A Ray address (given, or found for "auto") where nothing accepts a connection."""


def _check_reachable(address: str) -> tuple[str, str] | None:
    """ConnectionError, naming the address and where it came from, when the Ray that
    `address` ("auto": RAY_ADDRESS or the address file of the last `ray start`) points to
    does not accept a TCP connection: ray.init would retry it for minutes (a cluster that
    stopped without `ray stop` leaves its address file behind). Nothing found for "auto"
    is left to ray.init (it says so); Ray Client addresses are not probed. Returns the
    (address, where it came from) that answered, for "auto"; else None."""
    import os
    import socket

    source = "the address given"
    if address == "auto":
        try:
            from ray._private.services import get_ray_address_from_environment
            from ray._private.utils import get_ray_address_file

            resolved = get_ray_address_from_environment("auto", None)
        except ConnectionError:
            return None  # no Ray found: ray.init raises its own ConnectionError
        except Exception:  # Ray's private helpers moved: let ray.init find it
            return None
        source = ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else
                  f"{get_ray_address_file(None)}, written by the last `ray start`")
        address = resolved
    if not isinstance(address, str) or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()  # "[::1]:6379"
    except OSError as e:
        raise RayUnreachableError(f"the Ray cluster at {address} (from {source}) does not answer ({e}); start it "
                              f"(`ray start --head`), point RAY_ADDRESS or --address elsewhere, or use "
                              f"--address local") from None
    return (address, source) if source != "the address given" else None


def launch(model: str | None = None, device: str = "cpu", num_replicas: int = 1, *, address: str | None = None,
           **config) -> LLMHandle:
    """Start an engine driven from this process. No model: the bundled tiny Qwen3.
    `address`: the Ray to join ("local": a private one; None: the one RAY_ADDRESS or `ray start`'s
    address file points to, else a private one). Keyword options are EngineConfig fields
    (validated; unknown ones are an error)."""
    from cluster.core.engine import LocalEngine

    cfg = EngineConfig.from_kwargs(model=model, device=device, num_replicas=num_replicas, **config)
    owns_ray = ensure_ray(address)
    try:
        engine = LocalEngine(cfg).start()
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
    from cluster.remote.remote_engine import RemoteEngine

    owns_ray = ensure_ray(address)
    return LLMHandle(RemoteEngine.attach(name, namespace, lease_s=lease_s), owns_ray=owns_ray)
