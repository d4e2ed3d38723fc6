"""raylm's kernels against vLLM's CPU build without Ray: raylm's bare step loop (ModelRunner +
Scheduler in this process, what each engine worker runs; the engine measured 0.92x of it) and
vLLM in its subprocess (cluster/bench/vllm_peer.py), on one checkpoint and the same requests,
taking turns. For a machine too loaded to start a local Ray; `raylm bench --compare vllm` is the
full-engine version.

    PYTHONPATH=. python benchmarks/bench_vllm_bare.py --checkpoint DIR [--num-requests 64]
        [--input-len 42:251] [--output-len 34:128] [--rounds 1] [--peers-venv .venv-peers]

A random spec is saved as DIR first when DIR has no config.json (--model, default
random:qwen3-0.6b?layers=8&seed=0). Prints each run's output tok/s, the ratio, and how many
greedy sequences are identical. A script, not a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from cluster.bench.command import parse_range
from cluster.bench.contenders import EngineSpec, run_bare
from cluster.bench.vllm_peer import VLLMPeer, peer_dtype, save_checkpoint
from cluster.bench.workload import kv_blocks_for, make_workload
from workers.loader import load_config, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--model", default="random:qwen3-0.6b?layers=8&seed=0")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=parse_range, default=(42, 251))
    ap.add_argument("--output-len", type=parse_range, default=(34, 128))
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--peers-venv", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    save_checkpoint(a.model, a.checkpoint)
    vocab = load_config(a.checkpoint).vocab_size
    wl = make_workload(a.num_requests, a.input_len, a.output_len, vocab, a.seed)
    dtype = peer_dtype()
    spec = EngineSpec(a.checkpoint, dtype, 1, a.threads, True, a.batch_size, 16, kv_blocks_for(wl, 16),
                      a.max_num_batched_tokens, a.seed)
    print(f"# {a.checkpoint}: {wl.describe()}; both compute {dtype}; load average {os.getloadavg()}", flush=True)
    t = time.perf_counter()
    peer = VLLMPeer(a.checkpoint, dtype=dtype, max_num_seqs=a.batch_size,
                    max_num_batched_tokens=a.max_num_batched_tokens, block_size=None, threads=a.threads,
                    venv=a.peers_venv, log_path=os.path.join(tempfile.gettempdir(), "vllm-peer-bare.log"))
    print(f"vLLM {peer.version} up in {time.perf_counter() - t:.0f}s", flush=True)
    model = load_model(a.checkpoint, dtype)
    try:
        for rnd in range(a.rounds):
            order = ("raylm", "vllm") if rnd % 2 == 0 else ("vllm", "raylm")
            figs, outs = {}, {}
            for name in order:
                if name == "raylm":
                    fig, out = run_bare(model, spec, wl)
                    figs[name], outs[name] = fig["output_tok_s"], out
                else:
                    elapsed, out = peer.run(wl.prompts, wl.output_lens)
                    figs[name], outs[name] = wl.output_tokens / elapsed, out
                print(f"round {rnd + 1} {name}: {figs[name]:.2f} output tok/s (load {os.getloadavg()[0]:.1f})",
                      flush=True)
            same = sum(x == y for x, y in zip(outs["raylm"], outs["vllm"]))
            print(f"round {rnd + 1}: raylm / vLLM = {figs['raylm'] / figs['vllm']:.2f}; "
                  f"{same}/{wl.num_requests} greedy sequences identical", flush=True)
    finally:
        peer.close()


if __name__ == "__main__":
    main()
