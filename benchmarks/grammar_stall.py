"""What a replica's first structured-output request costs the streams beside it: `raylm serve`
(the bundled tiny model) as it starts by default (the tokenizer and xgrammar loaded into the
worker while it starts) and with --lazy-structured-output (loaded in the step of the first
request with a grammar), in turn, ROUNDS times each on a fresh server.

    .venv/bin/python benchmarks/grammar_stall.py [--rounds 2] [--port 8411]

Each round streams one plain 400-token completion, sends a `response_format: json_object`
chat request 0.5 s in, and prints that request's latency and the largest gap between the
plain stream's chunks. Needs xgrammar (raylm[structured]). A script, not a test.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai


def one_round(base: str) -> tuple[float, float, float]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    gaps: list[float] = []

    def plain() -> None:
        last = None
        for _ in client.completions.create(model="tiny-qwen3", prompt="Once upon a time", max_tokens=400,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    t = threading.Thread(target=plain)
    t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "json please"}],
                                   max_tokens=20, response_format={"type": "json_object"})
    took = time.perf_counter() - t0
    t.join()
    gaps.sort()
    return took, gaps[-1], gaps[len(gaps) // 2]


def serve(port: int, extra: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--served-model-name", "tiny-qwen3",
                             "--port", str(port), "--name", f"grammar-stall-{port}", "--address", "local", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"raylm serve exited; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"raylm serve did not get healthy; see {log_path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8411)
    a = p.parse_args()
    for r in range(a.rounds):
        for label, extra in (("prepared at start (default)", []),
                             ("--lazy-structured-output", ["--lazy-structured-output"])):
            proc = serve(a.port, extra, f"/tmp/raylm-grammar-stall-{a.port}.log")
            try:
                took, worst, median = one_round(f"http://127.0.0.1:{a.port}")
            finally:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=60)
            print(f"round {r + 1}, {label}: structured request {took:.2f} s; the plain stream's largest gap "
                  f"{worst * 1000:.0f} ms (median {median * 1000:.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
