"""Run one ModelRunner per tensor-parallel (and pipeline) rank in spawned processes (gloo,
one thread each), without Ray: the sampling rank (tensor rank 0 of the last stage) drives a
PlanDriver and hands every plan's bytes to the other ranks, as a replica sends the same bytes
to each of its actors. Several jobs (a runner config and the prompts it generates for) run in
one set of processes, one after another."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod

from cluster.ports import free_port

TIMEOUT_S = 240


def job(runner_kw: dict, prompts, max_new: int, samplings=None, chunk=None, scheduler=None) -> tuple:
    """One generation: a runner of `runner_kw`, `max_new` tokens for each prompt. With `scheduler`
    (SchedulerConfig fields beyond the runner's) the real Scheduler plans the steps, greedily."""
    return runner_kw, prompts, samplings or [None] * len(prompts), max_new, chunk, scheduler


def run_ranks(world: int, jobs: list[tuple], expert_parallel: bool = False, pipeline: int = 1,
              partition=None) -> list[tuple[list[list[int]], dict]]:
    """For each job, the sampling rank's (outputs, runner stats). `world` ranks in all, in
    `pipeline` stages (layers per stage: `partition`). MoE models split their experts across the
    ranks with expert_parallel, else each expert's intermediate dim."""
    if world == 1:
        import torch

        from workers.parallel import SINGLE

        threads = torch.get_num_threads()
        try:
            return [_run_job(0, SINGLE, [], *j) for j in jobs]
        finally:
            torch.set_num_threads(threads)  # the runner set one thread, as each rank has
    ctx = mp.get_context("spawn")
    plans = [ctx.Queue() for _ in range(world)]  # the driving rank's stays unused
    out = ctx.Queue()
    port = free_port()
    layout = dict(expert_parallel=expert_parallel, pipeline_parallel_size=pipeline,
                  pp_layer_partition=None if partition is None else tuple(partition))
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, jobs, plans, out, layout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    status, results = "error", "no rank answered in time"
    try:
        for _ in range(TIMEOUT_S):
            try:
                status, results = out.get(timeout=1)
                break
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    status, results = "error", f"a rank exited: {[p.exitcode for p in procs]}"
                    break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise AssertionError(results)
    return results


def _rank_main(rank, world, port, jobs, plans, out, layout):
    import torch

    from workers.parallel import ParallelConfig, TensorParallel

    torch.set_num_threads(1)
    try:
        parallel = TensorParallel.join(ParallelConfig(rank, world, "127.0.0.1", port, timeout_s=TIMEOUT_S,
                                                         **layout), "cpu")
        results = [_run_job(rank, parallel, plans, *j) for j in jobs]
        if parallel.samples:
            out.put(("ok", results))
        parallel.close()
    except BaseException as e:  # report, so the test fails with the rank's error
        out.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise


def _run_job(rank, parallel, plans, runner_kw, prompts, samplings, max_new, chunk, scheduler):
    from scheduler.protocol import StepPlan
    from tests.plans import PlanDriver
    from workers.runner import ModelRunner
    from workers.runner_config import RunnerConfig

    runner = ModelRunner(RunnerConfig(device="cpu", num_threads=1, **runner_kw), parallel=parallel)
    runner.warmup()
    if not parallel.samples:  # follow the sampling rank's plans until it says stop
        while (data := plans[rank].get(timeout=TIMEOUT_S)) is not None:
            if runner.execute(StepPlan.from_bytes(data)).token_ids:
                raise AssertionError(f"rank {rank} returned sampled ids; only the sampling rank should")
        return None
    execute = runner.execute
    others = [q for r, q in enumerate(plans) if r != rank]

    def send_and_execute(plan):
        data = plan.to_bytes()  # serialized once: the same bytes for every rank
        for q in others:
            q.put(data)
        return execute(StepPlan.from_bytes(data))

    runner.execute = send_and_execute
    if scheduler is not None:
        outputs = _schedule(runner, prompts, max_new, scheduler)
        for q in others:
            q.put(None)
        return outputs, runner.stats()
    driver = PlanDriver(runner, chunk_size=chunk)
    for prompt, sampling in zip(prompts, samplings):
        driver.add(prompt, sampling)
    outputs = driver.generate(max_new)
    for q in others:
        q.put(None)
    return outputs, runner.stats()


def _schedule(runner, prompts, max_new: int, extra: dict) -> list[list[int]]:
    from scheduler.request import Request, SamplingParams
    from scheduler.scheduler import Scheduler
    from scheduler.scheduler_config import SchedulerConfig
    from tests.factories import drive

    cfg = runner.config
    sched = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=cfg.block_size,
                                      max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                      max_model_len=runner.max_model_len, **extra))
    reqs = [Request(f"r{i}", list(p), SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, runner)
    return [r.output_token_ids for r in reqs]
