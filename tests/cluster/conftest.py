"""Fixtures of the cluster tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from cluster.ports import free_port  # noqa: F401 (the tests import it from here)
from workers.actor import WORKER_ACTOR_ENV

SERVED_MODEL = "tiny-qwen3"  # the name the served engine answers to


@pytest.fixture
def faulty_workers(monkeypatch):
    """Engines launched during the test start tests.cluster.faults.FaultyWorker, whose
    `arm_fault` makes a later step exit, hang or raise."""
    from tests.cluster.faults import FAULTY_WORKER

    monkeypatch.setenv(WORKER_ACTOR_ENV, FAULTY_WORKER)


def start_raylm_serve(ray_session, log_path, name: str, frontend: str, api_key: str = "k-cli", extra=()):
    """`raylm serve` as a user starts it, joining the session's Ray: (process, its log file, base URL);
    `extra`: more of its flags."""
    port = free_port()
    env = dict(os.environ, RAYLM_API_KEY=api_key, PYTHONUNBUFFERED="1")
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--address", ray_session.get_runtime_context().gcs_address,
         "--name", name, "--port", str(port), "--num-kv-blocks", "64", "--threads-per-worker", "1",
         "--disable-access-log", "--frontend", frontend, *extra],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log, f"http://127.0.0.1:{port}"


def wait_healthy(proc, log, base: str) -> list[tuple[int, dict]]:
    """Poll /health until 200; returns every (status, body) seen on the way."""
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_tail(log)
        try:
            r = httpx.get(base + "/health", timeout=2)
            seen.append((r.status_code, r.json()))
        except httpx.TransportError:
            pass
        if seen and seen[-1][0] == 200:
            return seen
        time.sleep(0.1)
    pytest.fail(f"never healthy: {seen[-3:]}\n{log_tail(log)}")


def log_tail(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-3000:]


@pytest.fixture(scope="module")
def served_engine(ray_session, request):
    """`raylm serve --frontend process` inside the test process, one per test module: a
    detached engine actor on the bundled tiny model, the HTTP server on a free port in this
    process, and its handle connected over the channel (test_embedded_http.py covers the
    default layout, the HTTP server inside the engine actor).

    A module tunes it with a SERVED dict: api_key (None), max_body_bytes (the server's
    default), num_kv_blocks (64), engine (more EngineConfig fields, {}). Yields {"base": the server's URL, "state": its
    ServerState, "loading_status": /health's status before the engine was up, "name": the
    engine actor's name, for cluster.connect}."""
    import uvicorn

    import cluster
    from cluster.openai.app import ServerState, build_app
    from cluster.openai.http_limits import HttpLimits, uvicorn_options
    from cluster.openai.serving_config import DEFAULT_MAX_BODY_BYTES
    from cluster.remote.engine_actor import launch_detached

    opts = {"api_key": None, "max_body_bytes": DEFAULT_MAX_BODY_BYTES, "num_kv_blocks": 64,
            "engine": {}, **getattr(request.module, "SERVED", {})}
    name = "served-" + request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    config = cluster.EngineConfig(num_kv_blocks=opts["num_kv_blocks"], threads_per_worker=1, **opts["engine"])
    actor, started = launch_detached(config, name)
    state = ServerState([SERVED_MODEL], opts["api_key"])
    port = free_port()
    options = {**uvicorn_options(HttpLimits(), access_log=False), "log_level": "warning"}  # as raylm serve's
    srv = uvicorn.Server(uvicorn.Config(build_app(state, max_body_bytes=opts["max_body_bytes"]), host="127.0.0.1",
                                        port=port, **options))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    loading = httpx.get(f"{base}/health")
    ray_session.get(started)
    state.handle = cluster.connect(name)
    yield {"base": base, "state": state, "loading_status": loading.status_code, "name": name}
    srv.should_exit = True
    thread.join(timeout=10)
    ray_session.kill(actor, no_restart=True)


def served_stats(server) -> dict:
    return server["state"].handle.stats()


def wait_until_idle(server, timeout=60) -> dict:
    """The served engine's stats once nothing runs or waits (within `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        s = served_stats(server)
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"requests still running: {s['num_running']}"
        time.sleep(0.05)


def aborted_requests(server) -> float:
    return finished_requests(server, "abort")


def finished_requests(server, reason: str) -> float:
    """How many requests the served engine has finished with `reason` (its /metrics, which
    needs the API key when the server has one)."""
    key = getattr(server["state"], "api_key", None)
    text = httpx.get(server["base"] + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}).text
    for ln in text.splitlines():
        if ln.startswith(f'raylm_requests_total{{finish_reason="{reason}"}}'):
            return float(ln.split(" ")[1])
    return 0.0
