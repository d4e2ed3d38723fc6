"""`raylm bench --driver-capacity`: what one engine process can drive, measured with fake workers.

Workers are fake (EngineConfig.fake_step_s, workers/fake_runner.py): they load no model and answer
each step's ids, through the real step channel, after a fixed time standing in for a device's step.
Everything else is the real engine: scheduler, plan encoding, result decoding, detokenizer,
streams. Two sweeps, each run a fresh engine given three times the requests its replicas hold,
all at once (ignore_eos, --output-len tokens each), measured over the run's steady middle:

- rows: one replica whose steps take no time, at each of --rows running rows: steps a second, and
  the engine's CPU per replica-step: the CPU time of this process's threads (step loops,
  detokenizing, delivery, Ray's own) but the caller's, which reads the outputs as a user's code
  would, divided by the steps all replicas ran; and the same with the caller's thread counted.
- replicas: each of --replicas replicas at --rows' largest-but-one count (64 by default) whose steps
  take --fake-step-ms (a device's decode step): steps a second against the R / step_time the
  workers alone would allow. Where that share falls, the engine limits, not the workers.

- engines (--engines, e.g. 1,2): the Ray Serve application (cluster/serve/) of N engines, each
  one fake replica of --rows' largest-but-one count whose steps take no time, driven from this
  process through Serve's handle (connect_app): steps a second of all engines together, against
  one engine's. Each engine is a process of its own, so past one engine the limit is cores, not
  one GIL.

Prompts are --input-len tokens of the bundled tiny model's prose as its tokenizer encodes it (the
tokenizer detokenizes the outputs too); the model's weights are never loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time

STEPS_PER_REQUEST = 200  # each request's output tokens when --output-len is left as is
WAVES = 3  # the requests of a run: at least this many times what its replicas hold at once
ZERO_STEP_TOKENS = 40_000  # and, where steps take no time, this many tokens a row, up to 16 rows (a few seconds)
SAMPLE_S = 0.25  # how often the run's counters are read


def _cpu_seconds(exclude: set[int]) -> tuple[float, float]:
    """(CPU seconds of this process's threads but those in `exclude` (native ids), of all of them):
    Linux's per-thread counters; elsewhere the process's for both."""
    total = time.process_time()
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return total, total
    theirs = 0.0
    for tid in exclude:
        try:
            with open(f"{tasks}/{tid}/schedstat") as f:  # nanoseconds on a CPU, first
                theirs += int(f.read().split()[0]) / 1e9
        except OSError:  # the thread ended meanwhile, or no scheduler statistics: count it in
            continue
    return total - theirs, total


def text_prompts(rng: random.Random, n: int, prompt_len: int) -> list[list[int]]:
    """n prompts of exactly prompt_len tokens, each the start of the bundled tiny model's prose (English
    and Chinese) as its tokenizer encodes it, cut where the cut leaves whole characters: as a text prompt
    arrives, and so detokenized on the path such a prompt takes (random ids often end inside a character,
    whose requests fall to the slower Python windows)."""
    from workers.loader import bundled_model_path, load_tokenizer
    from workers.tiny_model.corpus import prose

    tokenizer = load_tokenizer(bundled_model_path())
    prompts: list[list[int]] = []
    while len(prompts) < n:
        text = ""
        while len(ids := tokenizer.encode(text, add_special_tokens=False)) < prompt_len:
            text += prose(rng) + " "
        ids = ids[:prompt_len]
        if "\ufffd" not in tokenizer.decode(ids[-4:]):
            prompts.append(ids)
    return prompts


def _run_once(*, replicas: int, rows: int, step_s: float, prompt_len: int, output_len: int, seed: int) -> dict:
    """One engine of `replicas` fake replicas of `rows` slots, given WAVES times the requests they
    hold at once (more where steps take no time); the figures are taken over the steady middle of
    the run (from 20% to 80% of its tokens), where every replica is full: neither the first
    prefill nor the last stragglers."""
    import cluster
    from cluster import SamplingParams

    rng = random.Random(seed)
    waves = WAVES if step_s else max(WAVES, -(-ZERO_STEP_TOKENS * min(rows, 16) // (replicas * rows * output_len)))
    requests = waves * replicas * rows
    prompts = text_prompts(rng, requests, prompt_len)
    blocks = 2 * -(-(prompt_len + output_len) // 16) * rows + 16
    h = cluster.launch(fake_step_s=step_s, num_replicas=replicas, max_num_seqs=rows, num_kv_blocks=blocks,
                       max_num_batched_tokens=max(2048, rows * prompt_len), max_waiting_requests=requests)
    try:
        h.generate([prompts[0]], SamplingParams(max_tokens=2, ignore_eos=True))  # every stream and channel open
        done: dict = {}

        def generate() -> None:
            try:
                done["outs"] = h.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
            except BaseException as e:  # noqa: BLE001 - raised on the bench's thread below
                done["error"] = e

        gen = threading.Thread(target=generate)
        samples = []  # (wall, the engine's threads' CPU, this process's, generated tokens, steps)
        gen.start()
        callers = {threading.main_thread().native_id, gen.native_id}  # the bench's threads, not the engine's
        while gen.is_alive():
            st = h.stats()
            samples.append((time.perf_counter(), *_cpu_seconds(callers), st["generated_tokens"], st["steps"]))
            gen.join(SAMPLE_S)
    finally:
        h.shutdown()
    if "error" in done:
        raise done["error"]
    tokens = sum(len(o.outputs[0].token_ids) for o in done["outs"])
    if tokens != requests * output_len:
        raise RuntimeError(f"fake workers returned {tokens} tokens, {requests * output_len} were asked for")
    first_tokens = samples[0][3]
    lo = next(s for s in samples if s[3] - first_tokens >= 0.2 * tokens)
    hi = [s for s in samples if s[3] - first_tokens <= 0.8 * tokens][-1]
    if hi[0] - lo[0] < 3 * SAMPLE_S:
        raise RuntimeError("the run was too short to measure: raise --output-len")
    wall, cpu, process_cpu, gen_tokens, steps = (b - a for a, b in zip(lo, hi))
    return {"replicas": replicas, "rows": rows, "step_ms": step_s * 1e3, "steps": steps, "wall_s": wall,
            "engine_cpu_s": cpu, "process_cpu_s": process_cpu, "steps_per_s": steps / wall,
            "out_tok_per_s": gen_tokens / wall, "cpu_ms_per_replica_step": cpu * 1e3 / steps,
            "process_cpu_ms_per_replica_step": process_cpu * 1e3 / steps, "engine_cores": cpu / wall,
            "of_ideal": (steps / wall) / (replicas / step_s) if step_s else None}


ENGINE_TOKENS = 2_000  # a request's tokens in the engines sweep: waves of a second or more, not Serve's overhead
# the engines sweep reads whole outputs: its streams' deltas are batched by the second, so that this
# process (the caller, on the same cores) costs little next to the engines it measures
ENGINE_STREAM_INTERVAL_MS = 1000.0


def _run_engines(*, engines: int, rows: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """N engines of one fake replica each under Ray Serve, WAVES times the requests they hold at
    once, sent as a closed loop of two batches' worth per engine (a request goes when one ends, so
    none waits in Serve's own queue, whose retries would cost this process CPU); steps a second over
    the whole run (output tokens / rows)."""
    import asyncio

    from ray import serve

    from cluster import SamplingParams
    from cluster.serve import build_openai_app, connect_app

    rng = random.Random(seed)
    requests = WAVES * engines * rows
    prompts = text_prompts(rng, requests, prompt_len)
    blocks = 2 * -(-(prompt_len + output_len) // 16) * rows + 16
    config = dict(fake_step_s=0.0, max_num_seqs=rows, num_kv_blocks=blocks,
                  max_num_batched_tokens=max(2048, rows * prompt_len), max_waiting_requests=requests)
    name = "raylm-driver-capacity"
    serve.start(proxy_location="Disabled")
    serve.run(build_openai_app(config, num_engines=engines, stream_interval_ms=ENGINE_STREAM_INTERVAL_MS),
              name=name, route_prefix=None)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    try:
        h = connect_app(name)

        async def closed_loop() -> tuple[list, float]:
            await asyncio.gather(*[h.agenerate(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
                                   for _ in range(2 * engines)])
            gate = asyncio.Semaphore(2 * rows * engines)

            async def one(p):
                async with gate:
                    return await h.agenerate(p, params)

            t0 = time.perf_counter()
            outs = await asyncio.gather(*[one(p) for p in prompts])
            return outs, time.perf_counter() - t0

        outs, wall = asyncio.run(closed_loop())
    finally:
        serve.delete(name)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != requests * output_len:
        raise RuntimeError(f"fake workers returned {tokens} tokens, {requests * output_len} were asked for")
    return {"engines": engines, "rows": rows, "wall_s": wall, "out_tok_per_s": tokens / wall,
            "steps_per_s": tokens / rows / wall}


def run(a: argparse.Namespace) -> int:
    import cluster

    output_len = a.output_len[1] if a.output_len[0] == a.output_len[1] else STEPS_PER_REQUEST
    prompt_len = a.input_len[0]
    owns_ray = cluster.ensure_ray(a.address)
    results: dict = {"rows": [], "replicas": [], "output_len": output_len, "prompt_len": prompt_len}
    try:
        if a.engines:
            run_engines(a, a.rows[-2] if len(a.rows) > 1 else a.rows[0], prompt_len, results)
            return 0
        print(f"# raylm bench --driver-capacity: fake workers, {prompt_len}-token prompts, {output_len} tokens "
              f"each; {os.cpu_count()} CPUs; engine CPU: this process's threads but the caller's (with caller: all)")
        print(f"{'replicas':>8} {'rows':>5} {'step ms':>8} {'steps/s':>9} {'out tok/s':>10} "
              f"{'CPU ms / replica-step':>22} {'(with caller)':>14} {'engine cores':>13} {'of workers-only':>16}")

        def show(r: dict) -> None:
            share = "-" if r["of_ideal"] is None else f"{r['of_ideal']:.2f}"
            print(f"{r['replicas']:>8} {r['rows']:>5} {r['step_ms']:>8.1f} {r['steps_per_s']:>9.1f} "
                  f"{r['out_tok_per_s']:>10.0f} {r['cpu_ms_per_replica_step']:>22.3f} "
                  f"{r['process_cpu_ms_per_replica_step']:>14.3f} {r['engine_cores']:>13.2f} "
                  f"{share:>16}", flush=True)

        for rows in a.rows:
            r = _run_once(replicas=1, rows=rows, step_s=0.0, prompt_len=prompt_len, output_len=output_len,
                          seed=a.seed)
            results["rows"].append(r)
            show(r)
        rows = a.rows[-2] if len(a.rows) > 1 else a.rows[0]
        for replicas in a.replicas:
            r = _run_once(replicas=replicas, rows=rows, step_s=a.fake_step_ms / 1e3, prompt_len=prompt_len,
                          output_len=output_len, seed=a.seed)
            results["replicas"].append(r)
            show(r)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


def run_engines(a: argparse.Namespace, rows: int, prompt_len: int, results: dict) -> None:
    """The engines sweep: steps a second of N engines against one's."""
    output_len = max(a.output_len[1], ENGINE_TOKENS)
    results["engines"] = []
    print(f"# engines under Ray Serve, one fake replica of {rows} rows each, steps take no time, {output_len} "
          f"tokens a request")
    print(f"{'engines':>8} {'steps/s':>9} {'out tok/s':>10} {'vs the first':>13}")
    for n in a.engines:
        r = _run_engines(engines=n, rows=rows, prompt_len=prompt_len, output_len=output_len, seed=a.seed)
        r["vs_first"] = r["steps_per_s"] / (results["engines"][0] if results["engines"] else r)["steps_per_s"]
        results["engines"].append(r)
        print(f"{n:>8} {r['steps_per_s']:>9.1f} {r['out_tok_per_s']:>10.0f} {r['vs_first']:>12.2f}x",
              flush=True)

