"""Pipeline parallel on the CPU: PP=2 (two actors, one thread each, two steps in flight)
against TP=1 on one actor with two threads, through the engine.

    PYTHONPATH=. python benchmarks/bench_pp.py [--model random:qwen3-0.6b?layers=8]
        [--batch 32] [--prompt-len 32] [--new-tokens 64] [--repeats 3] [--partition 5,3 [--shallow]] [--dtype D]

Both use the same two cores (a local Ray with num_cpus=2), the same model and the same greedy
workload (`batch` prompts of random token ids, `new-tokens` tokens each, EOS ignored). Runs
alternate, each layout `repeats` times; it prints each layout's median output tokens/s and its
ratio to TP=1, and per PP layout: the bytes each step moved from stage 0 to stage 1 per row
computed (expected: hidden x dtype; the first stage sends nothing else), the bytes the last
stage sent back per sampled row (the ids, int64), the bytes the driver pulled per decode step
per decoded row (unchanged from PP=1: ids only), and how long the last stage waited for activations. `--partition`
adds a PP=2 layout with that many layers per stage (the last stage also computes the lm_head,
which on a small model costs as much as several layers); `--one-thread` adds TP=1 on one thread
(what one core does alone: the most each stage could contribute); `--shallow` the partition's layout with
P steps in flight instead of 2 x P. A script, not a test.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import ray

import cluster
from cluster import SamplingParams


def run(model: str, layout: dict, prompts: list[list[int]], new_tokens: int, dtype: str | None) -> dict:
    with cluster.launch(model, num_kv_blocks=4096, max_num_seqs=len(prompts), dtype=dtype, **layout) as llm:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        stats = llm.stats()
        workers = [ray.get(w.stats.remote()) for w in llm.engine.replicas[0].workers]
    fig = {"tok_s": sum(len(o.token_ids) for o in outs) / wall, "tokens": [o.token_ids for o in outs],
           "pulled_per_row": stats["bytes_pulled_per_decode_step"] / max(stats["rows_per_decode_step"], 1e-9)}
    if workers[0].get("pipeline"):
        first, last = workers[0], workers[-1]
        fig["stage_bytes_per_row"] = first["pipeline"]["bytes_sent"] / first["tokens"]
        fig["ids_bytes"] = last["pipeline"]["bytes_sent"]
        fig["last_wait_s"] = last["pipeline"]["recv_wait_s"]
        fig["first_wait_s"] = first["pipeline"]["ids_wait_s"]
        fig["busy"] = [(w["step_s"] - w["pipeline"]["recv_wait_s"] - w["pipeline"]["ids_wait_s"]) / wall
                       for w in workers]
        fig["layers"] = [w["layers"] for w in workers]
    return fig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b?layers=8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--partition", default=None, help="layers per stage of an extra PP=2 layout, e.g. 5,3")
    ap.add_argument("--one-thread", action="store_true", help="also TP=1 on one thread: what one core does alone")
    ap.add_argument("--shallow", action="store_true",
                    help="also the --partition layout with pipeline_depth 1: P steps in flight, not 2 x P (each "
                         "batch's next step then waits for the driver to see its last)")
    ap.add_argument("--dtype", default=None,
                    help="compute dtype (default: the engine's for the checkpoint on this CPU). float32 compares the "
                         "layouts' greedy outputs exactly where bf16 runs on AMX, whose rounding depends on a "
                         "batch's shape (PP's microbatches are half a step's rows)")
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 150000) for _ in range(a.prompt_len)] for _ in range(a.batch)]
    layouts = {"TP=1 x 2 threads": dict(threads_per_worker=2),
               "PP=2 x 1 thread": dict(threads_per_worker=1, pipeline_parallel_size=2)}
    if a.partition:
        layouts[f"PP=2 x 1 thread, layers {a.partition}"] = dict(threads_per_worker=1, pipeline_parallel_size=2,
                                                                pp_layer_partition=a.partition)
    if a.partition and a.shallow:
        layouts[f"PP=2 x 1 thread, layers {a.partition}, 2 in flight"] = dict(
            threads_per_worker=1, pipeline_parallel_size=2, pp_layer_partition=a.partition, pipeline_depth=1)
    if a.one_thread:
        layouts["TP=1 x 1 thread"] = dict(threads_per_worker=1)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    figs: dict[str, list[dict]] = {name: [] for name in layouts}
    for _ in range(a.repeats):
        for name, layout in layouts.items():
            figs[name].append(run(a.model, layout, prompts, a.new_tokens, a.dtype))
    ray.shutdown()
    base_name = next(iter(layouts))
    base = statistics.median(f["tok_s"] for f in figs[base_name])
    print(f"model {a.model} in {a.dtype or 'its default dtype'}, batch {a.batch}, prompt {a.prompt_len}, "
          f"new {a.new_tokens}, {a.repeats} runs each")
    for name, runs in figs.items():
        tok_s = statistics.median(f["tok_s"] for f in runs)
        same = all(f["tokens"] == figs[base_name][0]["tokens"] for f in runs)
        line = (f"{name:34s} {tok_s:8.1f} tok/s  x{tok_s / base:.2f}  greedy equal: {same}  "
                f"driver pulls {runs[-1]['pulled_per_row']:.1f} B/decoded row")
        if "stage_bytes_per_row" in runs[-1]:
            f = runs[-1]
            line += (f"\n{'':34s} layers {f['layers']}; stage 0 -> 1: {f['stage_bytes_per_row']:.0f} B/row; "
                     f"ids back: {f['ids_bytes']} B in all; last stage waited {f['last_wait_s']:.2f} s "
                     f"for activations, first stage {f['first_wait_s']:.2f} s for ids; each stage computing "
                     f"{', '.join(f'{b:.0%}' for b in f['busy'])} of the run")
        print(line)


if __name__ == "__main__":
    main()
