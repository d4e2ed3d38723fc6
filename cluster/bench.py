"""`raylm bench`: throughput and latency on seeded random requests, side by side with peers.

    raylm bench [--layers 4] [--num-requests 64] [--input-len 32:256] [--output-len 32:128]
                [--compare hf,bare] [--ab device-outputs] [--replicas 1,2] [--repeat 2]
                [--serve --rate 0.5,1,inf] [--json out.json] [--plot out.png]

Offline runs (vLLM's and nano-vllm's throughput benchmarks): every request arrives at
once; prompts are random token ids, their lengths and the output lengths uniform in the
given ranges, `ignore_eos`, greedy. Output tokens/s counts the tokens the requests asked
for; total tokens/s adds their prompts. Every raylm run launches a fresh engine (so no
run hits another's prefix cache); the contenders take turns, reversed on every other
round of `--repeat`, and the figures printed are the medians over rounds.

- `--compare hf`: the same requests through HF transformers on the same weights:
  `hf-cb`, the continuous-batching manager behind `generate_batch` (explicit cache
  config, each request's own max_new_tokens); `hf-generate`, plain `generate` on one
  left-padded batch (per `--batch-size` requests) run to the batch's longest output;
  `hf-generate_batch` (opt-in, `--hf-modes`): `generate_batch` itself, every request run
  to the longest output. Only the tokens each request asked for count.
- `--compare bare`: the same requests through ModelRunner driven directly by the real
  Scheduler in this process (no Ray, no detokenizing, no pipelining).
- `--ab device-outputs`: device outputs (ids back) against host logits (logits back,
  sampled on the driver).
- `--replicas 1,2`: each replica count with cores // replicas threads per worker (or
  `--threads-per-worker`), plus one replica at the smallest of those thread counts.
- `--serve --rate R[,R...]`: requests arrive as a Poisson process at R per second
  ("inf": all at once); TTFT, TPOT, ITL and end-to-end latency as vLLM's serving
  benchmark reports them.

The default model is `random:qwen3-0.6b` (Qwen3-0.6B's shape, random bf16 weights,
built in memory by each worker and by this process for the peers; their fingerprints are
checked equal). `--layers N` cuts its depth; `--model PATH` takes a checkpoint instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("raylm.bench")

DEFAULT_MODEL = "random:qwen3-0.6b"
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


def _kv_blocks(wl: Workload, block_size: int) -> int:
    """Enough KV blocks for every request at once (no preemption), plus the warm-up."""
    return sum(-(-(len(p) + o) // block_size) for p, o in zip(wl.prompts, wl.output_lens)) + 8


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
        return {"replicas": self.replicas, "threads_per_worker": self.threads,
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
        import signal

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
        fingerprints = [r.worker_stats().get("weights_fingerprint") for r in engine.replicas]
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
               finish_reasons=sorted({o.finish_reason for o in outs}))
    return fig, [o.token_ids for o in outs]


def run_serve(spec: EngineSpec, workloads: list[tuple[float, Workload]], vocab_size: int, seed: int) -> list[dict]:
    """One engine; for each (rate, workload), Poisson arrivals at `rate` per second."""
    results = []
    with spec.launch() as llm:
        _warm_up(llm, vocab_size)
        for rate, wl in workloads:
            before = llm.stats()
            fig = asyncio.run(_serve_once(llm, wl, rate, seed))
            fig.update(_stat_delta(before, llm.stats()))
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
    fig.update(steps=steps, decode_steps=decode_steps, worker_time_s=worker_time)
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
    return hf.eval()


def _gen_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos -1: HF's continuous batching reads it as "no EOS" (ignore_eos); plain generate gets None
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0)


def _cb_config(wl: Workload, spec: EngineSpec):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size  # HF's default page (256 tokens)
    pages = sum(-(-(len(p) + o) // page) for p, o in zip(wl.prompts, wl.output_lens)) + 2
    return ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=spec.max_num_batched_tokens,
                                    max_requests_per_batch=spec.batch_size, allow_block_sharing=True)


def run_hf_cb(hf, wl: Workload, spec: EngineSpec) -> tuple[dict, list[list[int]]]:
    """The manager behind generate_batch, each request with its own max_new_tokens."""
    import torch

    with torch.inference_mode():
        mgr = hf.init_continuous_batching(generation_config=_gen_config(max(wl.output_lens)),
                                          continuous_batching_config=_cb_config(wl, spec))
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

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate_batch(wl.prompts, generation_config=_gen_config(max(wl.output_lens)),
                                continuous_batching_config=_cb_config(wl, spec), record_timestamps=True,
                                warmup=False)
        elapsed = time.perf_counter() - t0
    results = {k: v for k, v in out.items()}
    results = {f"r{i}": results[k] for i, k in enumerate(out)}  # input order
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


def _agreement(outs: list[list[int]], ref: list[list[int]] | None) -> dict:
    if ref is None:
        return {}
    n = len(ref)
    return {"first_token_agreement": sum(bool(a) and bool(b) and a[0] == b[0] for a, b in zip(outs, ref)) / n,
            "sequence_agreement": sum(a == b for a, b in zip(outs, ref)) / n}


# ---- the plan, the report ----------------------------------------------------------------

@dataclass
class Run:
    name: str
    kind: str  # raylm | bare | hf-cb | hf-generate | hf-generate_batch | serve
    spec: EngineSpec
    rounds: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """Per figure, the median over rounds (numbers only)."""
        keys = [k for k, v in self.rounds[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out = {}
        for k in keys:
            vals = [r[k] for r in self.rounds if r.get(k) is not None]
            out[k] = statistics.median(vals) if vals else None
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "params": self.spec.params(), "summary": self.summary(),
                "rounds": self.rounds}


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (or N), got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (req/s, or inf), got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return values


def _names(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(allowed)}, got {text!r}")
        return values
    return parse


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark raylm (and peers) on seeded random requests",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a checkpoint directory or a random model spec (default {DEFAULT_MODEL})")
    b.add_argument("--layers", type=int, default=None, help="cut the random model to N layers")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--seed", type=int, default=0, help="seeds the weights (random model) and the workload")
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--input-len", type=_range, default=(32, 256), help="prompt lengths LO:HI (uniform)")
    b.add_argument("--output-len", type=_range, default=(32, 128), help="output lengths LO:HI (uniform)")
    b.add_argument("--batch-size", type=_int_list, default=[64],
                   help="max sequences per step (raylm max_num_seqs, HF's batch); a list sweeps")
    b.add_argument("--max-num-batched-tokens", type=int, default=2048)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--compare", type=_names(("hf", "bare"), "--compare"), default=[],
                   help="hf: the same requests through HF transformers; bare: through ModelRunner + Scheduler "
                        "in this process")
    b.add_argument("--hf-modes", type=_names(HF_MODES, "--hf-modes"), default=["cb", "generate"],
                   help="HF contenders (default cb,generate; generate_batch runs every request to the longest)")
    b.add_argument("--ab", choices=["device-outputs"], default=None,
                   help="device-outputs: sampled ids back (on) against full logits back (off)")
    b.add_argument("--replicas", type=_int_list, default=[1], help="replica counts to run (scaling)")
    b.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads per worker (default: cores // replicas)")
    b.add_argument("--serve", action="store_true", help="serving load: Poisson arrivals at --rate")
    b.add_argument("--rate", type=_rates, default=[1.0], help="requests per second (list; inf: all at once)")
    b.add_argument("--repeat", type=int, default=1, help="rounds of the offline runs (order reversed every other)")
    b.add_argument("--address", default=None, help="Ray address to join (default: this process's or a local one)")
    b.add_argument("--json", default=None, metavar="PATH", help="write every figure here (updated after each run)")
    b.add_argument("--plot", default=None, metavar="PATH", help="PNG of throughput against batch size or rate")
    b.add_argument("--profile", default=None, metavar="DIR",
                   help="py-spy record (raw stacks) the workers and the driver during raylm runs")
    b.set_defaults(func=run)


def _model_spec(a) -> str:
    from workers.loader import is_random_spec, parse_random_spec

    if is_random_spec(a.model):
        s = parse_random_spec(a.model)
        layers = a.layers if a.layers is not None else s.layers
        return str(type(s)(s.name, layers, s.seed if "seed=" in a.model else a.seed))
    if a.layers is not None:
        raise ValueError("--layers applies to a random model, not to a checkpoint directory")
    return os.path.expanduser(a.model)


def _driver_model(model_spec: str, dtype: str):
    from workers.loader import is_random_spec, load_model, random_model

    return random_model(model_spec, dtype) if is_random_spec(model_spec) else load_model(model_spec, dtype)


def _vocab_size(model_spec: str) -> int:
    from workers.loader import is_random_spec, load_config, load_tokenizer, parse_random_spec
    from workers.models.qwen3 import Qwen3Config

    if is_random_spec(model_spec):
        parse_random_spec(model_spec)
        return Qwen3Config().vocab_size
    return min(load_config(model_spec).vocab_size, len(load_tokenizer(model_spec)))


def _machine() -> dict:
    import ray
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ray_cpus": ray.cluster_resources().get("CPU"),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "ray": ray.__version__, "platform": platform.platform(), "load_avg_at_start": os.getloadavg()}


class Bench:
    def __init__(self, a, model_spec: str, wl: Workload, vocab_size: int, cores: int):
        self.a, self.model_spec, self.wl, self.vocab_size, self.cores = a, model_spec, wl, vocab_size, cores
        self.runs: list[Run] = []
        self.serve_runs: list[Run] = []
        self.report: dict = {}

    def spec(self, *, replicas: int, threads: int, device_outputs: bool = True, batch_size: int) -> EngineSpec:
        a = self.a
        return EngineSpec(self.model_spec, a.dtype, replicas, threads, device_outputs, batch_size, a.block_size,
                          _kv_blocks(self.wl, a.block_size), a.max_num_batched_tokens, a.seed)

    def replica_configs(self) -> list[tuple[int, int]]:
        t = self.a.threads_per_worker
        cfgs = [(r, t or max(1, self.cores // r)) for r in self.a.replicas]
        if t is None and len(cfgs) > 1:
            least = min(th for _, th in cfgs)
            if (1, least) not in cfgs:
                cfgs.append((1, least))  # one replica with the threads each replica gets when split
        return cfgs

    def plan(self) -> None:
        a = self.a
        (r0, t0), *others = self.replica_configs()
        for bsz in a.batch_size:
            sfx = f" b={bsz}" if len(a.batch_size) > 1 else ""
            self.runs.append(Run("raylm" + sfx, "raylm", self.spec(replicas=r0, threads=t0, batch_size=bsz)))
            if a.ab:
                self.runs.append(Run("raylm host-logits" + sfx, "raylm",
                                     self.spec(replicas=r0, threads=t0, device_outputs=False, batch_size=bsz)))
            in_process = self.spec(replicas=1, threads=t0, batch_size=bsz)
            if "bare" in a.compare:
                self.runs.append(Run("bare" + sfx, "bare", in_process))
            if "hf" in a.compare:
                for m in a.hf_modes:
                    self.runs.append(Run(f"hf-{m}" + sfx, f"hf-{m}", in_process))
        for r, t in others:
            self.runs.append(Run(f"raylm {r}x{t}t", "raylm", self.spec(replicas=r, threads=t, batch_size=a.batch_size[0])))

    # ---- running ----
    def execute(self) -> None:
        from workers.device import set_cpu_threads

        a = self.a
        model = None
        if any(r.kind != "raylm" for r in self.runs):
            t = time.perf_counter()
            model = _driver_model(self.model_spec, a.dtype)
            log.info("driver copy of the model built in %.1fs", time.perf_counter() - t)
        hf = hf_model(model) if any(r.kind.startswith("hf-") for r in self.runs) else None
        for rnd in range(a.repeat):
            order = self.runs if rnd % 2 == 0 else self.runs[::-1]
            for run in order:
                log.info("round %d/%d: %s ...", rnd + 1, a.repeat, run.name)
                if run.kind == "raylm":
                    tag = f"{run.name.replace(' ', '_')}-r{rnd}"
                    fig, outs = run_raylm(run.spec, self.wl, self.vocab_size, a.profile, tag)
                else:
                    set_cpu_threads(run.spec.threads)
                    if run.kind == "bare":
                        fig, outs = run_bare(model, run.spec, self.wl)
                    else:
                        fig, outs = HF_RUNNERS[run.kind[3:]](hf, self.wl, run.spec)
                fig["round"] = rnd
                fig["lengths_ok"] = [len(o) for o in outs] == self.wl.output_lens
                if run.kind == "raylm" and model is not None:
                    from workers.loader import weights_fingerprint

                    if self.model_spec.startswith("random:"):
                        mine = weights_fingerprint(model)
                        fig["weights_match_driver"] = all(
                            f is not None and math.isclose(f, mine, rel_tol=1e-9) for f in fig["weights_fingerprints"])
                fig.update(_agreement(outs, self._reference_outputs(run)))
                if run.kind == "raylm" and run.spec.device_outputs and run.spec.replicas == 1 and rnd == 0:
                    self._ref_outs = getattr(self, "_ref_outs", {})
                    self._ref_outs.setdefault(run.spec.batch_size, outs)
                run.rounds.append(fig)
                log.info("%s: %.2f output tok/s (%.1fs)", run.name, fig["output_tok_s"], fig["elapsed_s"])
                self.write_json()

    def _reference_outputs(self, run: Run):
        refs = getattr(self, "_ref_outs", {})
        return refs.get(run.spec.batch_size) if not (run.kind == "raylm" and run.spec.device_outputs
                                                     and run.spec.replicas == 1) else None

    def execute_serve(self) -> None:
        a = self.a
        r0, t0 = self.replica_configs()[0]
        spec = self.spec(replicas=r0, threads=t0, batch_size=a.batch_size[0])
        workloads = []
        for i, rate in enumerate(a.rate):  # fresh prompts per rate: no prefix-cache hits across rates
            wl = self.wl if i == 0 else make_workload(a.num_requests, a.input_len, a.output_len, self.vocab_size,
                                                      a.seed + i)
            workloads.append((rate, wl))
        spec.num_kv_blocks = max(_kv_blocks(wl, a.block_size) for _, wl in workloads)
        for (rate, _), fig in zip(workloads, run_serve(spec, workloads, self.vocab_size, a.seed)):
            run = Run(f"serve rate={rate:g}", "serve", spec, [fig])
            self.serve_runs.append(run)
        self.write_json()

    # ---- reporting ----
    def ratios(self) -> dict:
        by = {r.name: r.summary() for r in self.runs if r.rounds}
        out, targets = {}, {}

        def tok(name):
            return by.get(name, {}).get("output_tok_s")

        for bsz in self.a.batch_size:
            sfx = f" b={bsz}" if len(self.a.batch_size) > 1 else ""
            ray_tok = tok("raylm" + sfx)
            if ray_tok is None:
                continue
            hf = {m: tok(f"hf-{m}" + sfx) for m in self.a.hf_modes if tok(f"hf-{m}" + sfx)}
            for m, v in hf.items():
                out[f"raylm / hf-{m}{sfx}"] = ray_tok / v
            if hf:
                best = max(hf, key=hf.get)
                out[f"raylm / best hf (hf-{best}){sfx}"] = ray_tok / hf[best]
                targets[f"raylm >= 2x best HF{sfx}"] = (ray_tok / hf[best], 2.0)
            if tok("raylm host-logits" + sfx):
                v = ray_tok / tok("raylm host-logits" + sfx)
                out[f"device outputs / host logits{sfx}"] = v
                targets[f"device outputs >= 1.15x host logits{sfx}"] = (v, 1.15)
            if tok("bare" + sfx):
                v = ray_tok / tok("bare" + sfx)
                out[f"engine / bare step loop{sfx}"] = v
                targets[f"engine >= 0.9x bare step loop{sfx}"] = (v, 0.9)
        cfgs = self.replica_configs()
        if len(cfgs) > 1:
            (r0, t0), base = cfgs[0], tok("raylm")
            b0 = self.a.batch_size[0]
            base = tok("raylm" + (f" b={b0}" if len(self.a.batch_size) > 1 else ""))
            for r, t in cfgs[1:]:
                v = tok(f"raylm {r}x{t}t")
                if v is None or base is None:
                    continue
                out[f"{r} replica{'s' if r > 1 else ''} x {t} threads / {r0} replica x {t0} threads"] = v / base
                if r > 1:
                    targets[f"{r} replicas >= 1.6x {r0} replica (same cores)"] = (v / base, 1.6)
                    same = tok(f"raylm 1x{t}t")
                    if same:
                        out[f"{r} replicas x {t} threads / 1 replica x {t} threads"] = v / same
        self.report["ratios"] = out
        self.report["targets"] = {k: {"value": v, "target": t, "met": v >= t} for k, (v, t) in targets.items()}
        return out

    def write_json(self) -> None:
        if not self.a.json:
            return
        self.ratios()
        doc = {"command": ["raylm", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else sys.argv,
               "model": self.model_spec, "dtype": self.a.dtype, "workload": self.wl.describe(),
               "config": {k: v for k, v in vars(self.a).items() if k != "func"},
               "machine": self.report.get("machine"), "runs": [r.to_dict() for r in self.runs if r.rounds],
               "serve": [r.to_dict() for r in self.serve_runs], "ratios": self.report["ratios"],
               "targets": self.report["targets"]}
        tmp = self.a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.a.json)

    def print_report(self, out=sys.stdout) -> None:
        def ms(s, k):
            p50, p99 = s.get(f"{k}_p50_ms"), s.get(f"{k}_p99_ms")
            return "-" if p50 is None else f"{p50:.0f}/{p99:.0f}"

        wl = self.wl.describe()
        print(f"\n# raylm bench: {self.model_spec}, {self.a.dtype}; {wl['num_requests']} requests, prompts "
              f"{wl['prompt_len_min']}-{wl['prompt_len_max']} ({wl['prompt_tokens']} tokens), outputs "
              f"{wl['output_len_min']}-{wl['output_len_max']} ({wl['output_tokens']} tokens); "
              f"{self.a.repeat} round(s), medians", file=out)
        rows = self.runs + self.serve_runs
        head = (f"{'run':<22} {'batch':>5} {'repl x thr':>10} {'out tok/s':>10} {'total tok/s':>11} {'elapsed s':>9} "
                f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'B/decode step':>13}")
        print(head, file=out)
        for r in rows:
            if not r.rounds:
                continue
            s = r.summary()
            bps = s.get("bytes_per_decode_step")
            rep = f"{r.spec.replicas}x{r.spec.threads}" if r.kind in ("raylm", "serve") else f"-x{r.spec.threads}"
            print(f"{r.name:<22} {r.spec.batch_size:>5} {rep:>10} {s['output_tok_s']:>10.2f} {s['total_tok_s']:>11.2f} "
                  f"{s['elapsed_s']:>9.1f} {ms(s, 'ttft'):>16} {ms(s, 'tpot'):>16} {ms(s, 'itl'):>15} "
                  f"{'-' if bps is None else f'{bps:.0f}':>13}", file=out)
        ratios = self.ratios()
        if ratios:
            print("\n# ratios (output tokens/s)", file=out)
            for k, v in ratios.items():
                print(f"{k:<58} {v:6.2f}", file=out)
        for k, t in self.report["targets"].items():
            print(f"target {k}: {t['value']:.2f} ({'met' if t['met'] else 'MISSED'})", file=out)
        bad = [r.name for r in rows for f in r.rounds if not f.get("lengths_ok", True)
               or f.get("weights_match_driver") is False]
        if bad:
            print(f"WARNING: lengths or weights did not check out in: {sorted(set(bad))}", file=out)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        title = f"{self.model_spec}, {self.a.dtype}, {self.wl.num_requests} requests"
        if self.serve_runs:
            fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
            rates = [r.rounds[0]["rate"] for r in self.serve_runs]
            finite = [x for x in rates if math.isfinite(x)]
            inf_x = 2 * max(finite) if finite else 1.0
            xs = [x if math.isfinite(x) else inf_x for x in rates]
            ax.plot(xs, [r.rounds[0]["output_tok_s"] for r in self.serve_runs], "o-", label="raylm")
            for k, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("tpot_p50_ms", "s-"), ("itl_p99_ms", "s--")):
                ax2.plot(xs, [r.rounds[0][k] for r in self.serve_runs], style, label=k.replace("_ms", " (ms)"))
            for a_ in (ax, ax2):
                a_.set_xticks(xs, [f"{x:g}" for x in rates])
                a_.set_xlabel("request rate (req/s)")
            ax.set_ylabel("output tokens/s")
            ax2.set_ylabel("ms")
            ax2.set_yscale("log")
            ax2.legend(fontsize=7)
        else:
            fig, ax = plt.subplots(figsize=(7, 4))
            groups: dict[str, list] = {}
            for r in self.runs:
                if r.rounds:
                    base = r.name.split(" b=")[0]
                    groups.setdefault(base, []).append((r.spec.batch_size, r.summary()["output_tok_s"]))
            if len(self.a.batch_size) > 1:
                for name, pts in groups.items():
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("batch size (max sequences per step)")
                ax.legend(fontsize=8)
            else:
                names = list(groups)
                bars = ax.bar(names, [groups[n][0][1] for n in names])
                ax.bar_label(bars, fmt="%.1f", fontsize=8)
                ax.set_xlabel(f"batch size {self.a.batch_size[0]}")
                ax.tick_params(axis="x", labelrotation=20, labelsize=8)
            ax.set_ylabel("output tokens/s (tokens asked for)")
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)


def run(a: argparse.Namespace) -> int:
    import cluster

    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'raylm[plot]'") from None
    if a.serve and (a.compare or a.ab or len(a.replicas) > 1 or a.repeat != 1):
        raise ValueError("--serve runs alone: drop --compare, --ab, --repeat and multiple --replicas")
    for name in ("num_requests", "repeat", "max_num_batched_tokens", "block_size"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.threads_per_worker is not None and a.threads_per_worker < 1:
        raise ValueError(f"--threads-per-worker must be >= 1, got {a.threads_per_worker}")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # HF's per-run INFO chatter
    model_spec = _model_spec(a)
    vocab = _vocab_size(model_spec)
    wl = make_workload(a.num_requests, a.input_len, a.output_len, vocab, a.seed)
    owns_ray = cluster.ensure_ray(a.address)
    try:
        import ray

        cores = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        bench = Bench(a, model_spec, wl, vocab, cores)
        bench.report["machine"] = _machine()
        if a.serve:
            bench.execute_serve()
        else:
            bench.plan()
            bench.execute()
        bench.print_report()
        bench.write_json()
        if a.plot:
            bench.plot(a.plot)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`raylm bench ...` in this process (joins an initialized Ray)."""
    from cluster.cli import main as cli_main

    return cli_main(["bench", *(argv or [])])
