"""`raylm bench --serve-http`: the real `raylm serve` over HTTP, as vLLM's `bench serve` drives it.

Starts `raylm serve` as its own process (the bundled tiny model unless --model), waits
for /health, then sends N streaming /v1/completions requests (random prompts of
--input-len tokens decoded to text, --output-len tokens each, ignore_eos, greedy) from
concurrent clients, all at once or as a Poisson process at --rate, and reports what
vLLM's serving benchmark reports: request and output-token throughput, TTFT, TPOT (per
request: (latency - TTFT) / (tokens - 1)), ITL (the gaps between streamed chunks) and
end-to-end latency, as mean, median and p99. `--in-process` also runs the same requests
through `cluster.launch()` in this process (no HTTP), for the served/in-process ratio;
`--through-serve` also serves them as the Ray Serve application of one engine
(`raylm serve --engines 1`: Serve's proxy, the ingress deployment, the engine deployment), for
what Serve's path costs against `raylm serve`'s one process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from cluster.ports import free_port


@dataclass
class RequestRecord:
    ok: bool = False
    status: int = 0
    ttft: float | None = None
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def random_prompts(tokenizer, n: int, input_len: int, seed: int = 0) -> list[str]:
    """Like vLLM's random dataset: random token ids, decoded to text (about input_len tokens)."""
    rng = random.Random(seed)
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(len(tokenizer)) if i not in specials]
    prompts = []
    for _ in range(n):  # decoded random bytes re-encode longer: cut to length and decode again, as vLLM does
        text = tokenizer.decode([rng.choice(vocab) for _ in range(input_len)])
        prompts.append(tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:input_len]))
    return prompts


class _Completion(asyncio.Protocol):
    """One streaming completion on a connection of its own, read straight from the event loop's
    callbacks: HTTP/1.1 status and headers, chunked transfer framing, SSE events. The clients
    share the host's cores with the server they measure, so they must cost as little CPU as they
    can: aiohttp's (a response object, a stream reader and a task woken per arrival) cost about a
    third more per streamed token (docs/bench/log/serving-passes.md). The timing is the same:
    `now` is when the bytes arrived."""

    def __init__(self, request: bytes, rec: RequestRecord, t0: float, done: asyncio.Future):
        self.request, self.rec, self.t0, self.done = request, rec, t0, done
        self.last = t0
        self.head = bytearray()
        self.raw = bytearray()  # a chunked body as sent, framing and all, not yet de-chunked
        self.events = b""  # de-chunked SSE text not yet split into events
        self.body = bytearray()  # an error response's body
        self.chunked = False
        self.length: int | None = None
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.done.done():
            return
        if not self.rec.status:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.head[:end]).split(b"\r\n")
            self.rec.status = int(lines[0].split()[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == b"transfer-encoding":
                    self.chunked = b"chunked" in value
                elif name == b"content-length":
                    self.length = int(value)
            data = bytes(self.head[end + 4:])
            self.head = bytearray()
        if self.chunked:
            self.raw += data
            payload, ended = self._dechunk()
        else:
            payload, ended = data, False
        if self.rec.status != 200:
            self.body += payload
            if ended or (self.length is not None and len(self.body) >= self.length):
                self._finish(error=self._error_text())
            return
        self.events += payload
        self._events(now)
        if ended and not self.done.done():
            self._finish(error="the stream ended without [DONE]")

    def _dechunk(self) -> tuple[bytes, bool]:
        """The whole chunks received so far (each one write of the server's), and whether the
        last, empty one was among them."""
        out = []
        while True:
            eol = self.raw.find(b"\r\n")
            if eol < 0:
                return b"".join(out), False
            size = int(bytes(self.raw[:eol]).split(b";")[0], 16)
            if size == 0:
                return b"".join(out), True
            if len(self.raw) < eol + 2 + size + 2:
                return b"".join(out), False
            out.append(bytes(self.raw[eol + 2:eol + 2 + size]))
            del self.raw[:eol + 4 + size]

    def _error_text(self) -> str:
        return f"HTTP {self.rec.status}: " + bytes(self.body).decode(errors="replace")[:200]

    def _events(self, now: float) -> None:
        rec = self.rec
        *events, self.events = self.events.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data:"):
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
                self._finish()
                return
            chunk = json.loads(payload)
            if chunk.get("usage"):
                rec.output_tokens = chunk["usage"]["completion_tokens"]
                rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            if rec.ttft is None:
                rec.ttft = now - self.t0
            else:
                rec.itl.append(now - self.last)
            self.last = now

    def _finish(self, error: str | None = None) -> None:
        self.rec.latency = time.perf_counter() - self.t0
        self.rec.ok, self.rec.error = error is None, error
        self.done.set_result(self.rec)
        self.transport.close()

    def connection_lost(self, exc) -> None:
        if self.done.done():
            return
        if self.rec.status and self.rec.status != 200 and exc is None:  # an error body that ran to EOF
            self._finish(error=self._error_text())
        else:
            self._finish(error=f"the connection closed before the response ended ({exc or 'EOF'})")


async def _one(host: str, port: int, request: bytes) -> RequestRecord:
    loop = asyncio.get_running_loop()
    rec, done = RequestRecord(), loop.create_future()
    t0 = time.perf_counter()
    try:
        await loop.create_connection(lambda: _Completion(request, rec, t0, done), host, port)
    except OSError as e:
        rec.error, rec.latency = f"{type(e).__name__}: {e}", time.perf_counter() - t0
        return rec
    return await done


def _request(host: str, port: int, path: str, body: dict, api_key: str | None) -> bytes:
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{auth}Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            ).encode() + payload


async def drive(base: str, model: str, prompts: list[str], output_len: int, rate: float = float("inf"),
                seed: int = 0, api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    """Send every prompt as a streaming completion, each on its own connection; returns the
    records and the wall time."""
    from urllib.parse import urlsplit

    url = urlsplit(base)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"base must be an http://host:port URL, got {base!r}")
    host, port = url.hostname, url.port or 80
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        tasks.append(asyncio.create_task(_one(host, port, _request(host, port, "/v1/completions", body, api_key))))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    records = await asyncio.gather(*tasks)
    return records, time.perf_counter() - t0


def run_loop(coro):
    """asyncio.run, on uvloop where installed (uvicorn's own choice for the server): the
    clients' loop shares the host's cores with the server, so it should cost little."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(prefix: str, seconds: list[float]) -> dict:
    return {f"{prefix}_mean": statistics.fmean(seconds) if seconds else None,
            f"{prefix}_median": _percentile(seconds, 50), f"{prefix}_p99": _percentile(seconds, 99)}


def figures(records: list[RequestRecord], elapsed: float) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "requests": len(records), "completed": len(ok),
        "failed": {str(s): sum(1 for r in records if not r.ok and r.status == s)
                   for s in sorted({r.status for r in records if not r.ok})},
        "duration_s": elapsed, "request_throughput": len(ok) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed,
        **summarize("ttft", [r.ttft for r in ok if r.ttft is not None]),
        **summarize("tpot", tpot),
        **summarize("itl", [x for r in ok for x in r.itl]),
        **summarize("e2el", [r.latency for r in ok]),
    }


def engine_state(base: str) -> dict:
    """What the server's /metrics says is left once the load is over (it should be nothing)."""
    import httpx

    wanted = ("raylm_kv_blocks_used", "raylm_requests_running", "raylm_requests_waiting", "raylm_preemptions_total")
    lines = httpx.get(base + "/metrics", timeout=30).text.splitlines()
    found = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in lines if ln.split(" ")[0] in wanted}
    return {k.removeprefix("raylm_"): v for k, v in found.items()}


class ServeProcess:
    """`raylm serve` in its own process group, up until the context ends."""

    def __init__(self, args: list[str], log_path: str, timeout_s: float = 600.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args, self.log_path, self.timeout_s = args, log_path, timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        import httpx

        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"raylm serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"raylm serve was not healthy within {self.timeout_s:.0f} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def in_process_pass(llm, prompts: list[str], output_len: int) -> tuple[list[RequestRecord], float]:
    """The requests through an in-process handle (cluster.launch()), all at once."""
    import cluster

    params = cluster.SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)

    async def one(p: str) -> RequestRecord:
        rec, t0 = RequestRecord(), time.perf_counter()
        last = t0
        async for d in llm.astream(p, params):
            now = time.perf_counter()
            if d.text:
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
            if d.finished:
                rec.output_tokens = len(d.output.token_ids)
                rec.prompt_tokens = d.output.num_prompt_tokens
        rec.latency, rec.ok = time.perf_counter() - t0, True
        return rec

    async def run():
        t0 = time.perf_counter()
        recs = await asyncio.gather(*[one(p) for p in prompts])
        return recs, time.perf_counter() - t0

    return run_loop(run())


def print_figures(name: str, f: dict, out=sys.stdout) -> None:
    def ms(k):
        v = f.get(k)
        return "-" if v is None else f"{v * 1000:.1f}"

    print(f"{name}: {f['completed']}/{f['requests']} ok in {f['duration_s']:.2f} s"
          + (f" (failed by status: {f['failed']})" if f["failed"] else ""), file=out)
    print(f"  output tok/s {f['output_throughput']:.1f}   req/s {f['request_throughput']:.2f}   "
          f"total tok/s {f['total_token_throughput']:.1f}", file=out)
    for k in ("ttft", "tpot", "itl", "e2el"):
        print(f"  {k.upper():5s} ms  mean {ms(k + '_mean')}  median {ms(k + '_median')}  p99 {ms(k + '_p99')}",
              file=out)


SERVED, IN_PROCESS, THROUGH_SERVE = "raylm serve (HTTP)", "raylm in-process", "raylm serve --engines 1 (Ray Serve)"
# WARM_UP: each pass first runs the whole workload untimed. A fresh engine's first burst ran 15-25%
# slower than the ones after it, served and in-process alike (4.0-4.9K vs 5.3-6.8K out tok/s served on
# a 2-core EPYC; its batch shapes are new to the worker), and eight short requests warmed too little of it.


def _served_pass(serve_args, log_path, name, prompts, output_len, rate, seed, label=SERVED) -> dict:
    with ServeProcess(serve_args, log_path) as srv:
        run_loop(drive(srv.base, name, prompts, output_len, rate, seed))  # warm-up: see WARM_UP
        cpu0 = time.thread_time()  # this thread runs the clients' event loop
        records, elapsed = run_loop(drive(srv.base, name, prompts, output_len, rate, seed))
        f = figures(records, elapsed)
        f["client_cpu_s"] = time.thread_time() - cpu0
        f["after"] = engine_state(srv.base)
    print_figures(label, f)
    print(f"  afterwards: {f['after']}; the clients' CPU: {f['client_cpu_s']:.2f} s", flush=True)
    return f


def _in_process_pass(engine, prompts, output_len) -> dict:
    import cluster

    with cluster.launch(**engine) as llm:
        in_process_pass(llm, prompts, output_len)  # warm-up: see WARM_UP
        f = figures(*in_process_pass(llm, prompts, output_len))
    print_figures(IN_PROCESS, f)
    return f


def run(a) -> int:
    """`raylm bench --serve-http`: see the module docstring."""
    import logging

    import ray

    from workers.loader import bundled_model_path, load_tokenizer

    model = None if a.model in (None, "tiny", "bundled") or a.model.startswith("random:") else a.model
    path = model or bundled_model_path()
    tok = load_tokenizer(path)
    prompts = random_prompts(tok, a.num_requests, a.input_len[0], a.seed)
    output_len = a.output_len[0]
    rate = a.rate[0]
    engine = {"dtype": a.compute_dtype if a.compute_dtype != "auto" else "float32",
              "max_num_seqs": a.batch_size[0], "max_num_batched_tokens": a.max_num_batched_tokens}
    if not ray.is_initialized():  # our own Ray unless --address says otherwise; workers at our priority
        if a.address is None:
            os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address=a.address or "local", include_dashboard=False, logging_level=logging.WARNING)
    serve_args = ["--address", ray.get_runtime_context().gcs_address, "--name", "raylm-bench-http",
                  "--dtype", engine["dtype"], "--max-num-seqs", str(engine["max_num_seqs"]),
                  "--max-num-batched-tokens", str(engine["max_num_batched_tokens"])]
    if model:
        serve_args += ["--model", model]
    if a.max_waiting_requests:
        serve_args += ["--max-waiting-requests", str(a.max_waiting_requests)]
    if a.threads_per_worker:
        serve_args += ["--threads-per-worker", str(a.threads_per_worker)]
        engine["threads_per_worker"] = a.threads_per_worker
    name = os.path.basename(os.path.normpath(model)) if model else "tiny-qwen3"
    results, ratios = {}, []
    print(f"workload: {len(prompts)} requests, {a.input_len[0]} prompt tokens (random ids as text), "
          f"{output_len} output tokens, ignore_eos, rate {rate}; load average {os.getloadavg()[0]:.1f}", flush=True)
    log_path = os.path.join(a.profile or "/tmp", "raylm-bench-serve.log")
    rounds = max(1, a.repeat)
    # rounds alternate, in-process first every other one, so drift hits both; the two engines
    # take turns (each worker holds its cores' CPU resources)
    passes = {SERVED: lambda: _served_pass(serve_args, log_path, name, prompts, output_len, rate, a.seed)}
    if a.in_process:
        passes[IN_PROCESS] = lambda: _in_process_pass(engine, prompts, output_len)
    if a.through_serve:
        passes[THROUGH_SERVE] = lambda: _served_pass(serve_args + ["--engines", "1"], log_path, name, prompts,
                                                     output_len, rate, a.seed, THROUGH_SERVE)
    for r in range(rounds):
        suffix = f" #{r + 1}" if rounds > 1 else ""
        got = {}
        for label in list(passes) if r % 2 == 0 else list(passes)[::-1]:
            results[label + suffix] = got[label] = passes[label]()
        if a.in_process:
            ratios.append(got[SERVED]["output_throughput"] / got[IN_PROCESS]["output_throughput"])
            print(f"served / in-process output throughput: {ratios[-1]:.2f}x", flush=True)
        if a.through_serve:
            print(f"Ray Serve / raylm serve output throughput: "
                  f"{got[THROUGH_SERVE]['output_throughput'] / got[SERVED]['output_throughput']:.2f}x", flush=True)
    if len(ratios) > 1:
        print(f"served / in-process over {len(ratios)} alternating rounds: median {statistics.median(ratios):.2f}x "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": {"num_requests": len(prompts), "input_len": a.input_len[0],
                                    "output_len": output_len, "rate": rate}, "engine": engine, "runs": results,
                       "ratios": ratios, "load_avg": os.getloadavg()}, f, indent=1, default=str)
    return 0
