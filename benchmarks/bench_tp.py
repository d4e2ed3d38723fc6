"""Tensor parallel on the CPU: TP=2 x 1 thread against TP=1 x 2 threads, through the engine.

    PYTHONPATH=. python benchmarks/bench_tp.py [--model random:qwen3-0.6b?layers=4]
        [--batches 1,8] [--prompt-len 32] [--new-tokens 32] [--repeats 2] [--enable-expert-parallel]

Both configurations use the same two cores (a local Ray with num_cpus=2), the same model
and the same greedy workload (`batch` prompts of random token ids, `new-tokens` tokens
each, EOS ignored). For each it prints decode throughput, the worker's mean step time,
the time rank 0 spends inside collectives per step (all-reduces after o_proj and
down_proj in every layer, the embedding's all-reduce, the logits gather, the ids
broadcast: on the CPU gloo's host time, waits for the other rank included), the bytes
those collectives move per step, and the bytes the driver pulls per decode step (the
StepResult of rank 0 only, so it must not change with TP), and the weight bytes rank 0 holds
against the checkpoint's. With --enable-expert-parallel an MoE model's TP=2 run splits the
experts between the two ranks instead of slicing each one. Then the same collectives
alone, with no model between them (two processes, gloo, one thread each), so their own
cost can be told apart from the wait for the other rank inside a real step. A script,
not a test.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import random
import statistics
import time
from pathlib import Path

import ray

import cluster
from cluster import SamplingParams
from cluster.ports import free_port
from workers.loader import is_random_spec, load_config, parse_random_spec, random_spec_config
from workers.parallel import ParallelConfig, TensorParallel, padded_vocab

CONFIGS = [(1, 2), (2, 1)]  # (tensor_parallel_size, threads per worker)


def collective_bytes(config, rows: int, sampled: int, tp: int) -> int:
    """Bytes one rank sends in one step's collectives (fp32 activations): 2 all-reduces of
    [rows, hidden] per layer and one for the embedding, its [sampled, vocab / tp] logits,
    and the broadcast int32 ids. A ring all-reduce sends 2 (tp - 1) / tp of its input."""
    if tp == 1:
        return 0
    ring = 2 * (tp - 1) / tp
    reduces = (2 * config.num_hidden_layers + 1) * rows * config.hidden_size * 4 * ring
    gather = sampled * padded_vocab(config.vocab_size, tp) // tp * 4
    return int(reduces + gather + sampled * 4)


def run(model: str, tp: int, threads: int, batch: int, prompt_len: int, new_tokens: int, repeats: int,
        expert_parallel: bool = False) -> dict:
    rng = random.Random(0)
    vocab = 1000  # ids below any Qwen3 vocab
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    blocks = batch * (-(-(prompt_len + new_tokens) // 16) + 1) + 8
    with cluster.launch(model=model, tensor_parallel_size=tp, threads_per_worker=threads, num_kv_blocks=blocks,
                        max_model_len=max(256, prompt_len + new_tokens + 1), max_num_seqs=max(batch, 8),
                        enable_expert_parallel=expert_parallel and tp > 1) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm
        best = None
        for _ in range(repeats):
            before, wb = llm.stats(), llm.worker_stats()[0]  # rank 0's runner
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            after, wa = llm.stats(), llm.worker_stats()[0]
            steps = wa["steps"] - wb["steps"]
            row = dict(
                tokens_per_s=sum(len(o.token_ids) for o in outs) / wall,
                step_ms=1e3 * (after["worker_time_s"] - before["worker_time_s"]) / steps,
                collective_ms=1e3 * (wa["collective_s"] - wb["collective_s"]) / steps,
                collectives_per_step=(wa["collectives"] - wb["collectives"]) / steps,
                bytes_per_decode_step=(after["decode_bytes_pulled"] - before["decode_bytes_pulled"])
                / max(1, after["decode_steps"] - before["decode_steps"]),
                outputs=[o.token_ids for o in outs],
                weight_bytes=wa["weight_bytes"],
            )
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                best = row
    return best


def _collectives_rank(rank: int, port: int, config, batch: int, iters: int, out) -> None:
    import torch

    torch.set_num_threads(1)
    tp = TensorParallel.join(ParallelConfig(rank, 2, "127.0.0.1", port), "cpu")
    hidden = torch.randn(batch, config.hidden_size)
    logits = torch.randn(batch, padded_vocab(config.vocab_size, 2) // 2)
    ids = torch.zeros(batch, dtype=torch.int32)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(2 * config.num_hidden_layers + 1):  # o_proj and down_proj per layer, the embedding
            tp.all_reduce(hidden)
        tp.gather_to_first(logits)
        tp.broadcast(ids)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(1e3 * statistics.median(times))
    tp.close()


def checkpoint_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def collectives_only_ms(config, batch: int, iters: int = 30) -> float:
    """Median ms of one decode step's collectives for `batch` rows, with nothing else running."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_collectives_rank, args=(r, port, config, batch, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    ms = out.get(timeout=600)
    for p in procs:
        p.join()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen3-0.6b?layers=4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="TP=2 splits an MoE model's experts between the ranks (vLLM's option of that name)")
    a = ap.parse_args()
    config = random_spec_config(parse_random_spec(a.model)) if is_random_spec(a.model) else load_config(a.model)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    print(f"model {a.model}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}"
          + (f", {config.num_experts} experts" if config.is_moe else "")
          + (f"; checkpoint {checkpoint_bytes(a.model) / 2**30:.2f} GiB" if not is_random_spec(a.model) else ""))
    print(f"{'batch':>5} {'config':>14} {'tok/s':>8} {'step ms':>8} {'coll ms':>8} {'coll/step':>9} "
          f"{'coll KiB/step':>13} {'pulled B/decode step':>20} {'rank 0 GiB':>10}")
    for batch in [int(b) for b in a.batches.split(",")]:
        results = {}
        for tp, threads in CONFIGS:
            r = results[tp] = run(a.model, tp, threads, batch, a.prompt_len, a.new_tokens, a.repeats,
                                  a.enable_expert_parallel)
            kib = collective_bytes(config, batch, batch, tp) / 1024  # a decode step: one row per request
            print(f"{batch:>5} {f'TP={tp} x {threads} thr':>14} {r['tokens_per_s']:>8.1f} {r['step_ms']:>8.2f} "
                  f"{r['collective_ms']:>8.2f} {r['collectives_per_step']:>9.1f} {kib:>13.1f} "
                  f"{r['bytes_per_decode_step']:>20.1f} {r['weight_bytes'] / 2**30:>10.2f}")
        one, two = results[1], results[2]
        print(f"{batch:>5} TP=2/TP=1 throughput {two['tokens_per_s'] / one['tokens_per_s']:.2f}x; "
              f"collectives {100 * two['collective_ms'] / two['step_ms']:.0f}% of a TP=2 step; "
              f"same outputs: {one['outputs'] == two['outputs']}")
    ray.shutdown()
    for batch in [int(b) for b in a.batches.split(",")]:
        print(f"{batch:>5} the step's collectives alone (2 processes, gloo): "
              f"{collectives_only_ms(config, batch):.2f} ms")


if __name__ == "__main__":
    main()
