"""raylm's contenders in `raylm bench`, each running a Workload and returning its figures and
its output ids: raylm through the engine (offline, or with Poisson arrivals), and the bare
ModelRunner + Scheduler loop in this process. HF transformers' runs are in hf_runs.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass

from cluster.bench.figures import ms_stats, throughput_figures, time_per_output_token
from cluster.bench.profiler import PySpyProfiler
from cluster.bench.workload import Workload

log = logging.getLogger("raylm.bench")


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
    speculative_config: dict | None = None

    def launch(self):
        import cluster

        return cluster.launch(
            self.model, num_replicas=self.replicas, dtype=self.dtype, threads_per_worker=self.threads,
            device_outputs=self.device_outputs, max_num_seqs=self.batch_size, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, max_num_batched_tokens=self.max_num_batched_tokens, seed=self.seed,
            speculative_config=self.speculative_config)

    def params(self) -> dict:
        params = {"dtype": self.dtype or "auto", "replicas": self.replicas, "threads_per_worker": self.threads,
                  "device_outputs": self.device_outputs, "batch_size": self.batch_size}
        if self.speculative_config is not None:
            params["speculative_config"] = self.speculative_config
        return params


def greedy_params(wl: Workload) -> list:
    """Each request's SamplingParams: greedy, ignore_eos, exactly its output length."""
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
                                                   "num_preemptions", "prefix_hit_tokens", "spec_draft_tokens",
                                                   "spec_accepted_tokens", "spec_verify_rows")}
    return {
        "steps": d["steps_returned"], "decode_steps": d["decode_steps"], "worker_time_s": d["worker_time_s"],
        "bytes_pulled": d["bytes_pulled"],
        "bytes_per_decode_step": d["decode_bytes_pulled"] / d["decode_steps"] if d["decode_steps"] else None,
        "rows_per_decode_step": d["decode_rows"] / d["decode_steps"] if d["decode_steps"] else None,
        "preemptions": d["num_preemptions"], "prefix_hit_tokens": d["prefix_hit_tokens"],
        "spec_draft_tokens": d["spec_draft_tokens"], "spec_accepted_tokens": d["spec_accepted_tokens"],
        "spec_acceptance_rate": d["spec_accepted_tokens"] / d["spec_draft_tokens"] if d["spec_draft_tokens"] else None,
        "spec_mean_accepted_length": 1 + d["spec_accepted_tokens"] / d["spec_verify_rows"] if d["spec_verify_rows"]
        else None,
    }


def run_raylm(spec: EngineSpec, wl: Workload, vocab_size: int, profile_dir: str | None = None,
              tag: str = "raylm") -> tuple[dict, list[list[int]]]:
    t_launch = time.perf_counter()
    with spec.launch() as llm:
        launch_s = time.perf_counter() - t_launch
        worker_stats = llm.worker_stats()
        fingerprints = [w.get("weights_fingerprint") for w in worker_stats]
        pids = {f"worker{i}": w["pid"] for i, w in enumerate(worker_stats)}
        log.info("%s: engine up in %.1fs; worker pid(s) %s", tag, launch_s, list(pids.values()))
        _warm_up(llm, vocab_size)
        before = llm.stats()
        with PySpyProfiler(profile_dir, tag, {**pids, "driver": os.getpid()}):
            t0 = time.perf_counter()
            outs = llm.generate(wl.prompts, greedy_params(wl), use_tqdm=False)
            elapsed = time.perf_counter() - t0
        after = llm.stats()
    generated = sum(len(o.token_ids) for o in outs)
    fig = throughput_figures(wl, elapsed, generated, [o.metrics.ttft for o in outs], [o.metrics.tpot for o in outs])
    fig.update(_stat_delta(before, after))
    fig.update(launch_s=launch_s, weights_fingerprints=fingerprints, worker_pids=list(pids.values()),
               finish_reasons=sorted({o.finish_reason for o in outs}),
               compute_dtype=_compute_dtype(worker_stats), ops=(worker_stats[0].get("ops") if worker_stats else None),
               weight_bytes=(worker_stats[0].get("weight_bytes") if worker_stats else None))
    return fig, [o.token_ids for o in outs]


def _compute_dtype(worker_stats: list[dict]) -> str:
    return ",".join(sorted({str(w.get("dtype")) for w in worker_stats}))


def run_serve(spec: EngineSpec, workloads: list[tuple[float, Workload]], vocab_size: int, seed: int) -> list[dict]:
    """One engine; for each (rate, workload), Poisson arrivals at `rate` per second."""
    results = []
    with spec.launch() as llm:
        _warm_up(llm, vocab_size)
        dtype = _compute_dtype(llm.worker_stats())
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
    params = greedy_params(wl)
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
    tpot = [time_per_output_token(r[1][0], r[1][-1], r[2]) for r in rows]
    itl = [b - a for r in rows for a, b in zip(r[1], r[1][1:])]
    e2e = [r[3] - r[0] for r in rows]
    fig = throughput_figures(wl, end - start, sum(r[2] for r in rows), ttft, tpot)
    fig.update(ms_stats("itl", itl), **ms_stats("e2e", e2e), rate=rate,
               request_throughput=wl.num_requests / (end - start))
    return fig


# ---- in-process: the bare step loop ------------------------------------------------------

def run_bare(model, spec: EngineSpec, wl: Workload, around_steps=None) -> tuple[dict, list[list[int]]]:
    """ModelRunner driven by the real Scheduler in this process: no Ray, no detokenizing,
    no pipelining (each step's ids are known before the next is planned). `around_steps`, a
    context manager, is entered around the step loop alone (a profiler that must not see the start)."""
    from scheduler.request import Request
    from scheduler.scheduler import Scheduler
    from scheduler.scheduler_config import SchedulerConfig
    from workers.runner import ModelRunner
    from workers.runner_config import RunnerConfig

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
        reqs = [Request(f"bare-{i}", list(p), sp) for i, (p, sp) in enumerate(zip(wl.prompts, greedy_params(wl)))]
        steps, decode_steps, worker_time = 0, 0, 0.0
        with around_steps or contextlib.nullcontext():
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
    fig = throughput_figures(wl, elapsed, sum(len(r.output_token_ids) for r in reqs), [r.ttft for r in reqs],
                             [r.tpot for r in reqs])
    fig.update(steps=steps, decode_steps=decode_steps, worker_time_s=worker_time, compute_dtype=compute_dtype)
    return fig, [r.output_token_ids for r in reqs]
