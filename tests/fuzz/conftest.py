"""The server the fuzz suite attacks: `raylm serve` as a user starts it, with an API key, on a
Ray of its own (`--address local`), so it shares nothing with the Ray tests and a crash of it
shows as a dead process, not as a broken test session."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import SERVED_MODEL, free_port, log_tail, wait_healthy

API_KEY = "fuzz-key"
MAX_MODEL_LEN = 128  # bounds every generation (a chat without max_tokens runs until the context is full)
# the counters of /metrics that say a replica died, its step loop failed or a request was blamed for either
FAULT_COUNTERS = ("raylm_worker_restarts_total", "raylm_step_loop_failures_total", "raylm_poisoned_requests_total")
ERRORED_REQUESTS = 'raylm_requests_total{finish_reason="error"}'


@dataclasses.dataclass
class FuzzServer:
    base: str
    api_key: str
    model: str
    log_path: Path
    proc: subprocess.Popen

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def counters(self) -> dict[str, float]:
        """The fault counters of /metrics, and the requests finished with `error`."""
        text = httpx.get(self.base + "/metrics", headers=self.auth, timeout=30).text
        values = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in (*FAULT_COUNTERS, ERRORED_REQUESTS):
                values[name] = float(value)
        missing = [n for n in FAULT_COUNTERS if n not in values]
        assert not missing, f"/metrics lacks {missing}:\n{text[-2000:]}"
        values.setdefault(ERRORED_REQUESTS, 0.0)
        return values

    def serves_a_normal_request(self) -> None:
        """A plain greedy completion: 200 with a finish_reason, or the assertion names what came back."""
        r = httpx.post(self.base + "/v1/completions", headers=self.auth, timeout=60,
                       json={"model": self.model, "prompt": "The capital of France is", "max_tokens": 8,
                             "temperature": 0})
        assert r.status_code == 200, f"a normal request got {r.status_code}: {r.text[:500]}\n{self.log_tail()}"
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text[:500]


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory):
    """`raylm serve --address local` with an API key on a free port of 127.0.0.1 (the bundled tiny
    model, 64 KV blocks, one torch thread, MAX_MODEL_LEN; requests' own chat templates allowed, so
    the fuzzer reaches the template sandbox, the most hostile input there is); yields a FuzzServer
    once /health is 200, and stops the process group it started (SIGINT, as a user's Ctrl-C)."""
    log_path = tmp_path_factory.mktemp("fuzz") / "serve.log"
    port = free_port()
    env = dict(os.environ, RAYLM_API_KEY=API_KEY, PYTHONUNBUFFERED="1")
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--address", "local", "--name", "raylm-fuzz",
         "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "64", "--threads-per-worker", "1",
         "--max-model-len", str(MAX_MODEL_LEN), "--trust-request-chat-template", "--disable-access-log"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, log, base)
        yield FuzzServer(base, API_KEY, SERVED_MODEL, log_path, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                print(f"raylm serve did not stop on SIGINT within 60 s; killed\n{log_tail(log)}")
        log.close()
