"""`raylm serve --engines 1` as a user runs it: a Ray of its own, Serve's proxy on the port asked
for, the openai client with the API key, Ctrl-C stopping it all (`make test-serve`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.cluster.conftest import free_port, log_tail

pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]


def wait_healthy(proc, log, base: str) -> None:
    import time

    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_tail(log)
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"never healthy\n{log_tail(log)}")


def haproxy_pids(session: int) -> list[int]:
    """The HAProxy processes in a process session (Serve's HAProxy ingress runs the bundled binary)."""
    out = subprocess.run(["ps", "-eo", "pid=,sess=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if line.split()[1] == str(session) and "haproxy" in line.split(None, 2)[2].split()[0]]


def start_serve(log, port: int, key: str, proxy: str, ingress: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--engines", "1", "--address", "local", "--port", str(port),
         "--num-kv-blocks", "64", "--max-num-seqs", "8", "--disable-access-log", "--serve-proxy", proxy,
         "--serve-ingress", ingress],
        stdout=log, stderr=subprocess.STDOUT, env=dict(env, RAYLM_API_KEY=key, PYTHONUNBUFFERED="1"),
        start_new_session=True)


@pytest.mark.parametrize("proxy,ingress,optimized", [("python", "deployment", False), ("haproxy", "direct", False),
                                                     ("haproxy", "deployment", True)])
def test_raylm_serve_with_engines_serves_until_interrupted(tmp_path, proxy, ingress, optimized):
    """Each front door; `optimized`: Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED, whose handles refuse to
    block inside a replica (the ingress's /health and /metrics ask an engine from a thread)."""
    port, key = free_port(), "k-serve"
    log = open(tmp_path / "serve.log", "w+")
    proc = start_serve(log, port, key, proxy, ingress,
                       dict(os.environ, RAY_SERVE_THROUGHPUT_OPTIMIZED="1" if optimized else "0"))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, log, base)  # Serve's proxy answers (404, 503) before the application is up
        assert bool(haproxy_pids(proc.pid)) == (proxy == "haproxy")
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        out = client.completions.create(model="tiny-qwen3", prompt="北京故宫是", max_tokens=8, temperature=0)
        assert out.choices[0].text and out.usage.completion_tokens >= 1
        chunks = list(client.completions.create(model="tiny-qwen3", prompt="北京故宫是", max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text  # streamed the same
        assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert metrics.status_code == 200 and b"raylm_" in metrics.content
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log_tail(log)
        assert not haproxy_pids(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_two_servers_behind_haproxy_on_one_host_each_serve(tmp_path):
    """Serve's HAProxy takes fixed ports and files under /tmp unless told otherwise: each `raylm serve`
    that starts its own Ray gives its HAProxy its own, so a second server on the host neither fails to
    bind nor replaces the first's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_SERVE_HAPROXY_", "RAY_SERVE_FALLBACK_"))}
    key, servers = "k-two", []
    try:
        for i in range(2):
            port, log = free_port(), open(tmp_path / f"serve{i}.log", "w+")
            servers.append((start_serve(log, port, key, "haproxy", "direct", env), log, f"http://127.0.0.1:{port}"))
        for proc, log, base in servers:
            wait_healthy(proc, log, base)
        for proc, log, base in servers:
            client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            out = client.completions.create(model="tiny-qwen3", prompt="Hello", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens >= 1, log_tail(log)
            assert len(haproxy_pids(proc.pid)) >= 1  # each behind an HAProxy of its own
        for proc, log, _ in servers:
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=120) == 0, log_tail(log)
    finally:
        for proc, _, _ in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
