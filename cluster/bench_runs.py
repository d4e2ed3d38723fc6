"""The contenders of `raylm bench`, each running a Workload and returning its figures
(and its output ids): raylm through the engine (offline or with Poisson arrivals), the
bare ModelRunner + Scheduler loop in this process, and HF transformers' continuous
batching, generate_batch and plain batched generate on the same weight tensors."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("raylm.bench")

HF_MODES = ("cb", "generate", "generate_batch")


# ---- workload ---------------------------------------------------------------------------

@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        lens = [len(p) for p in self.prompts]
        return {"num_requests": self.num_requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "prompt_len_min": min(lens), "prompt_len_max": max(lens),
                "output_len_min": min(self.output_lens), "output_len_max": max(self.output_lens)}


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    """Seeded random prompts (token ids uniform in the vocab) and output lengths."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*input_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(n)])
        outs.append(rng.randint(*output_len))
    return Workload(prompts, outs)


def _blocks_needed(prompts: list[list[int]], output_lens: list[int], block_size: int) -> int:
    return sum(-(-(len(p) + o) // block_size) for p, o in zip(prompts, output_lens))


def kv_blocks_for(wl: Workload, block_size: int) -> int:
    """Enough KV blocks for every request at once (no preemption), plus the warm-up."""
    return _blocks_needed(wl.prompts, wl.output_lens, block_size) + 8


# ---- figures ----------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _ms_stats(prefix: str, seconds: list[float]) -> dict:
    out = {}
    for name, q in (("p50", 50), ("p99", 99)):
        v = percentile(seconds, q)
        out[f"{prefix}_{name}_ms"] = None if v is None else v * 1e3
    vals = [s for s in seconds if s is not None]
    out[f"{prefix}_mean_ms"] = statistics.fmean(vals) * 1e3 if vals else None
    return out


def _figures(wl: Workload, elapsed: float, generated: int, ttft: list, tpot: list) -> dict:
    return {
        "elapsed_s": elapsed,
        "num_requests": wl.num_requests,
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,  # the tokens the requests asked for
        "generated_tokens": generated,  # what the system computed (more when it runs past a request's length)
        "output_tok_s": wl.output_tokens / elapsed,
        "total_tok_s": (wl.prompt_tokens + wl.output_tokens) / elapsed,
        **_ms_stats("ttft", ttft), **_ms_stats("tpot", tpot),
    }


def _tpot(first: float | None, last: float | None, n: int) -> float | None:
    return (last - first) / (n - 1) if n > 1 and first is not None and last is not None else None


# ---- raylm ------------------------------------------------------------------------------

@dataclass
class EngineSpec:
    model: str
    dtype: str | None
    replicas: int
    threads: int
    device_outputs: bool
    batch_size: int
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    seed: int

    def launch(self):
        import cluster

        return cluster.launch(
            self.model, num_replicas=self.replicas, dtype=self.dtype, threads_per_worker=self.threads,
            device_outputs=self.device_outputs, max_num_seqs=self.batch_size, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, max_num_batched_tokens=self.max_num_batched_tokens, seed=self.seed)

    def params(self) -> dict:
        return {"dtype": self.dtype or "auto", "replicas": self.replicas, "threads_per_worker": self.threads,
                "device_outputs": self.device_outputs, "batch_size": self.batch_size}


def _sampling(wl: Workload):
    from scheduler.request import SamplingParams

    return [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in wl.output_lens]


def _warm_up(llm, vocab_size: int) -> None:
    from scheduler.request import SamplingParams

    rng = random.Random(12345)
    llm.generate([[rng.randrange(vocab_size) for _ in range(24)] for _ in range(2)],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def _stat_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before.get(k, 0) for k in ("steps_returned", "decode_steps", "decode_bytes_pulled",
                                                   "bytes_pulled", "worker_time_s", "decode_rows",
                                                   "num_preemptions", "prefix_hit_tokens")}
    return {
        "steps": d["steps_returned"], "decode_steps": d["decode_steps"], "worker_time_s": d["worker_time_s"],
        "bytes_pulled": d["bytes_pulled"],
        "bytes_per_decode_step": d["decode_bytes_pulled"] / d["decode_steps"] if d["decode_steps"] else None,
        "rows_per_decode_step": d["decode_rows"] / d["decode_steps"] if d["decode_steps"] else None,
        "preemptions": d["num_preemptions"], "prefix_hit_tokens": d["prefix_hit_tokens"],
    }


def _py_spy() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else "py-spy"


class _Profiler:
    """py-spy record (Python stacks, raw collapsed format, not pausing the process) on the
    given pids for the life of a `with` block. Summarize with benchmarks/pyspy_top.py."""

    def __init__(self, directory: str | None, tag: str, pids: dict[str, int]):
        self.directory, self.tag, self.pids, self.procs = directory, tag, pids, []

    def __enter__(self):
        if self.directory:
            os.makedirs(self.directory, exist_ok=True)
            for name, pid in self.pids.items():
                out = os.path.join(self.directory, f"{self.tag}-{name}.txt")
                self.procs.append(subprocess.Popen(
                    [_py_spy(), "record", "--pid", str(pid), "--rate", "50", "--format", "raw", "--nonblocking",
                     "--output", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def run_raylm(spec: EngineSpec, wl: Workload, vocab_size: int, profile_dir: str | None = None,
              tag: str = "raylm") -> tuple[dict, list[list[int]]]:
    t_launch = time.perf_counter()
    with spec.launch() as llm:
        engine = llm._engine
        launch_s = time.perf_counter() - t_launch
        worker_stats = [r.worker_stats() for r in engine.replicas]
        fingerprints = [w.get("weights_fingerprint") for w in worker_stats]
        pids = {f"worker{i}": r.info["pid"] for i, r in enumerate(engine.replicas)}
        log.info("%s: engine up in %.1fs; worker pid(s) %s", tag, launch_s, list(pids.values()))
        _warm_up(llm, vocab_size)
        before = llm.stats()
        with _Profiler(profile_dir, tag, {**pids, "driver": os.getpid()}):
            t0 = time.perf_counter()
            outs = llm.generate(wl.prompts, _sampling(wl), use_tqdm=False)
            elapsed = time.perf_counter() - t0
        after = llm.stats()
    generated = sum(len(o.token_ids) for o in outs)
    fig = _figures(wl, elapsed, generated, [o.metrics.ttft for o in outs], [o.metrics.tpot for o in outs])
    fig.update(_stat_delta(before, after))
    fig.update(launch_s=launch_s, weights_fingerprints=fingerprints, worker_pids=list(pids.values()),
               finish_reasons=sorted({o.finish_reason for o in outs}),
               compute_dtype=_compute_dtype(worker_stats))
    return fig, [o.token_ids for o in outs]


def _compute_dtype(worker_stats: list[dict]) -> str:
    return ",".join(sorted({str(w.get("dtype")) for w in worker_stats}))


def run_serve(spec: EngineSpec, workloads: list[tuple[float, Workload]], vocab_size: int, seed: int) -> list[dict]:
    """One engine; for each (rate, workload), Poisson arrivals at `rate` per second."""
    results = []
    with spec.launch() as llm:
        _warm_up(llm, vocab_size)
        dtype = _compute_dtype([r.worker_stats() for r in llm._engine.replicas])
        for rate, wl in workloads:
            before = llm.stats()
            fig = asyncio.run(_serve_once(llm, wl, rate, seed))
            fig.update(_stat_delta(before, llm.stats()), compute_dtype=dtype)
            results.append(fig)
            log.info("serve rate %s: %.2f output tok/s, TTFT p50 %.0f ms", rate, fig["output_tok_s"],
                     fig["ttft_p50_ms"] or float("nan"))
    return results


async def _serve_once(llm, wl: Workload, rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(wl.num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    params = _sampling(wl)
    start = time.perf_counter()

    async def one(i: int):
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        sent = time.perf_counter()
        times, n = [], 0
        async for delta in llm.astream(wl.prompts[i], params[i]):
            if delta.token_ids:
                times.append(time.perf_counter())
                n += len(delta.token_ids)
        return sent, times, n, time.perf_counter()

    rows = await asyncio.gather(*(one(i) for i in range(wl.num_requests)))
    end = max(r[3] for r in rows)
    ttft = [r[1][0] - r[0] for r in rows]
    tpot = [_tpot(r[1][0], r[1][-1], r[2]) for r in rows]
    itl = [b - a for r in rows for a, b in zip(r[1], r[1][1:])]
    e2e = [r[3] - r[0] for r in rows]
    fig = _figures(wl, end - start, sum(r[2] for r in rows), ttft, tpot)
    fig.update(_ms_stats("itl", itl), **_ms_stats("e2e", e2e), rate=rate,
               request_throughput=wl.num_requests / (end - start))
    return fig


# ---- in-process: the bare step loop and the peers -----------------------------------------

def run_bare(model, spec: EngineSpec, wl: Workload) -> tuple[dict, list[list[int]]]:
    """ModelRunner driven by the real Scheduler in this process: no Ray, no detokenizing,
    no pipelining (each step's ids are known before the next is planned)."""
    from scheduler.request import Request
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from workers.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(
        model=spec.model, device="cpu", dtype=spec.dtype, block_size=spec.block_size,
        num_kv_blocks=spec.num_kv_blocks, max_num_seqs=spec.batch_size,
        max_num_batched_tokens=spec.max_num_batched_tokens, seed=spec.seed, num_threads=spec.threads), model=model)
    compute_dtype = str(runner.model.dtype).removeprefix("torch.")
    try:
        runner.warmup()
        sched = Scheduler(SchedulerConfig(
            num_blocks=runner.num_kv_blocks, block_size=spec.block_size, max_num_seqs=spec.batch_size,
            max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=runner.max_model_len))
        reqs = [Request(f"bare-{i}", list(p), sp) for i, (p, sp) in enumerate(zip(wl.prompts, _sampling(wl)))]
        steps, decode_steps, worker_time = 0, 0, 0.0
        t0 = time.perf_counter()
        for r in reqs:
            r.arrival_time = time.monotonic()
            sched.add_request(r)
        while sched.has_unfinished():
            plan = sched.schedule()
            result = runner.execute(plan)
            worker_time += result.step_time
            steps += 1
            decode_steps += bool(plan.rows) and all(row.token is not None for row in plan.rows)
            sched.update(result)
        elapsed = time.perf_counter() - t0
    finally:
        runner.close()
    fig = _figures(wl, elapsed, sum(len(r.output_token_ids) for r in reqs), [r.ttft for r in reqs],
                   [r.tpot for r in reqs])
    fig.update(steps=steps, decode_steps=decode_steps, worker_time_s=worker_time, compute_dtype=compute_dtype)
    return fig, [r.output_token_ids for r in reqs]


def hf_model(model):
    """HF transformers' Qwen3ForCausalLM on the very same weight tensors as our `model`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = model.config
    config = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
                         rms_norm_eps=c.rms_norm_eps, attention_bias=c.attention_bias,
                         rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"})
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(config)
    state = dict(model.state_dict())
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, assign=True, strict=False)  # share the tensors: no second copy
    hf.model.rotary_emb.inv_freq = model.inv_freq.clone()
    hf.model.rotary_emb.original_inv_freq = model.inv_freq.clone()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.to(model.model.embed_tokens.weight.device).eval()  # buffers HF made itself follow the weights


def _gen_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos -1: HF's continuous batching reads it as "no EOS" (ignore_eos); plain generate gets None
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0)


def _cb_config(wl: Workload, spec: EngineSpec, output_lens: list[int]):
    """A cache that holds every request at once (no request waits for pages), as raylm's."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size  # HF's default page (256 tokens)
    pages = _blocks_needed(wl.prompts, output_lens, page) + 2
    return ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=spec.max_num_batched_tokens,
                                    max_requests_per_batch=spec.batch_size, allow_block_sharing=True)


def run_hf_cb(hf, wl: Workload, spec: EngineSpec) -> tuple[dict, list[list[int]]]:
    """The manager behind generate_batch, each request with its own max_new_tokens."""
    import torch

    with torch.inference_mode():
        mgr = hf.init_continuous_batching(generation_config=_gen_config(max(wl.output_lens)),
                                          continuous_batching_config=_cb_config(wl, spec, wl.output_lens))
        mgr.start()
        try:
            t0 = time.perf_counter()
            for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens)):
                mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1, record_timestamps=True)
            results = _hf_results(mgr, wl.num_requests)
            elapsed = time.perf_counter() - t0
        finally:
            mgr.stop(block=True)
            mgr.destroy()
    return _hf_figures(wl, results, t0, elapsed, cfg=str(mgr.continuous_batching_config))


def run_hf_generate_batch(hf, wl: Workload, spec: EngineSpec) -> tuple[dict, list[list[int]]]:
    """generate_batch itself: one max_new_tokens (the longest asked) for every request."""
    import torch

    longest = max(wl.output_lens)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate_batch(wl.prompts, generation_config=_gen_config(longest),
                                continuous_batching_config=_cb_config(wl, spec, [longest] * wl.num_requests),
                                record_timestamps=True, warmup=False)
        elapsed = time.perf_counter() - t0
    results = {f"r{i}": r for i, r in enumerate(out.values())}  # generate_batch returns them in input order
    return _hf_figures(wl, results, t0, elapsed)


def _hf_results(mgr, n: int) -> dict:
    results = {}
    while len(results) < n:
        r = mgr.get_result(timeout=1)
        if r is not None and r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"HF request {r.request_id} failed: {r.error}")
            results[r.request_id] = r
        elif r is None and not mgr.is_running():
            raise RuntimeError("HF's continuous batching loop stopped before every request finished")
    return results


def _hf_figures(wl: Workload, results: dict, t0: float, elapsed: float, **extra) -> tuple[dict, list[list[int]]]:
    outs, ttft, tpot, generated = [], [], [], 0
    for i, want in enumerate(wl.output_lens):
        r = results[f"r{i}"]
        generated += len(r.generated_tokens)
        if len(r.generated_tokens) < want:
            raise RuntimeError(f"HF request r{i} made {len(r.generated_tokens)} tokens, {want} were asked")
        outs.append(list(r.generated_tokens[:want]))
        ts = r.timestamps or []
        ttft.append(ts[0] - t0 if ts else None)
        tpot.append(_tpot(ts[0], ts[want - 1], want) if len(ts) >= want else None)
    fig = _figures(wl, elapsed, generated, ttft, tpot)
    fig.update(extra)
    return fig, outs


class _StepClock:
    """A generate() streamer that only notes when each step's tokens come out."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf_generate(hf, wl: Workload, spec: EngineSpec) -> tuple[dict, list[list[int]]]:
    """Plain batched generate: left-padded batches of `batch_size` requests, each run to
    its longest output."""
    import torch

    outs, ttft, tpot, generated = [], [], [], 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, wl.num_requests, spec.batch_size):
            prompts = wl.prompts[lo:lo + spec.batch_size]
            want = wl.output_lens[lo:lo + spec.batch_size]
            width = max(map(len, prompts))
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for k, p in enumerate(prompts):
                ids[k, width - len(p):] = torch.tensor(p)
                mask[k, width - len(p):] = 1
            clock = _StepClock()
            gc = _gen_config(max(want))
            gc.eos_token_id = None
            y = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gc, streamer=clock)
            new = y[:, width:]
            generated += new.numel()
            for k, o in enumerate(want):
                outs.append(new[k, :o].tolist())
                ttft.append(clock.times[0] - t0)
                tpot.append(_tpot(clock.times[0], clock.times[o - 1], o))
    elapsed = time.perf_counter() - t0
    fig = _figures(wl, elapsed, generated, ttft, tpot)
    fig["padded_prompt_tokens"] = sum(max(map(len, wl.prompts[lo:lo + spec.batch_size])) * len(
        wl.prompts[lo:lo + spec.batch_size]) for lo in range(0, wl.num_requests, spec.batch_size))
    return fig, outs


HF_RUNNERS = {"cb": run_hf_cb, "generate": run_hf_generate, "generate_batch": run_hf_generate_batch}


def agreement(outs: list[list[int]], ref: list[list[int]] | None) -> dict:
    if ref is None:
        return {}
    n = len(ref)
    return {"first_token_agreement": sum(bool(a) and bool(b) and a[0] == b[0] for a, b in zip(outs, ref)) / n,
            "sequence_agreement": sum(a == b for a, b in zip(outs, ref)) / n}
