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

With --profile both engines run under torch.profiler (vLLM with its engine core in-process) and
the script prints where each spent its time: GEMMs of the layers and of the lm_head, attention,
norms/RoPE/SwiGLU, sampling, copies, and the time between ops (cluster/bench/op_profile.py);
--top N adds each engine's N costliest ops. Throughput under the profiler is not a figure.

With --plain, after the rounds, the same requests go to benchmarks/vllm_plain.py (vLLM as a user
would time it: a fresh process, one `LLM.generate` of everything) and its figure is printed beside
the harness's: the check that the harness measures vLLM at its best.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

from torch.profiler import ProfilerActivity, profile

from cluster.bench.command import add_kernels_workload_args
from cluster.bench.contenders import EngineSpec, run_bare
from cluster.bench.op_profile import summarize, top_ops
from cluster.bench.vllm_peer import VLLMPeer, op_rows, peer_dtype, peers_python, save_checkpoint
from cluster.bench.workload import kv_blocks_for, make_workload
from workers.loader import load_config, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_kernels_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="where each engine's time goes, by op category")
    ap.add_argument("--top", type=int, default=0, help="with --profile: each engine's N costliest ops")
    ap.add_argument("--plain", action="store_true", help="also time vLLM by benchmarks/vllm_plain.py")
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
                    venv=a.peers_venv, log_path=os.path.join(tempfile.gettempdir(), "vllm-peer-bare.log"),
                    profile=a.profile)
    print(f"vLLM {peer.version} up in {time.perf_counter() - t:.0f}s", flush=True)
    model = load_model(a.checkpoint, dtype)
    try:
        for rnd in range(a.rounds):
            order = ("raylm", "vllm") if rnd % 2 == 0 else ("vllm", "raylm")
            figs, outs, profiles = {}, {}, {}
            for name in order:
                if name == "raylm":
                    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True) if a.profile else None
                    fig, out = run_bare(model, spec, wl, around_steps=prof)
                    figs[name], outs[name] = fig["output_tok_s"], out
                    if a.profile:
                        profiles[name] = (op_rows(prof), wl.output_tokens / fig["output_tok_s"])
                else:
                    elapsed, out = peer.run(wl.prompts, wl.output_lens)
                    figs[name], outs[name] = wl.output_tokens / elapsed, out
                    if a.profile:
                        profiles[name] = (peer.last_profile, elapsed)
                print(f"round {rnd + 1} {name}: {figs[name]:.2f} output tok/s (load {os.getloadavg()[0]:.1f})",
                      flush=True)
            same = sum(x == y for x, y in zip(outs["raylm"], outs["vllm"]))
            print(f"round {rnd + 1}: raylm / vLLM = {figs['raylm'] / figs['vllm']:.2f}; "
                  f"{same}/{wl.num_requests} greedy sequences identical", flush=True)
            if a.profile:
                print_profiles(profiles, vocab, a.top)
    finally:
        peer.close()
    if a.plain:
        plain = run_plain(a, wl, dtype)
        same = sum(x == y for x, y in zip(outs["raylm"], plain["outputs"]))
        print(f"vLLM by a plain LLM.generate script: {plain['output_tok_s']:.2f} output tok/s against the harness's "
              f"{figs['vllm']:.2f} (last round); raylm / plain vLLM = {figs['raylm'] / plain['output_tok_s']:.2f}; "
              f"{same}/{wl.num_requests} greedy sequences identical to raylm's", flush=True)


def run_plain(a, wl, dtype: str) -> dict:
    """benchmarks/vllm_plain.py on the workload, in the peers venv, with both cores (PEERS.md's env)."""
    work = tempfile.mkdtemp()
    workload, result = os.path.join(work, "workload.json"), os.path.join(work, "result.json")
    with open(workload, "w") as f:
        json.dump({"prompts": wl.prompts, "output_lens": wl.output_lens}, f)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{a.threads - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(a.threads))
    env.pop("PYTHONPATH", None)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_plain.py")
    try:
        subprocess.run([peers_python(a.peers_venv), script, "--checkpoint", a.checkpoint, "--workload", workload,
                        "--out", result, "--dtype", dtype, "--max-num-seqs", str(a.batch_size),
                        "--max-num-batched-tokens", str(a.max_num_batched_tokens)],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        with open(result) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_profiles(profiles: dict, vocab_size: int, top: int) -> None:
    """Seconds and shares per category for both engines, side by side; then each one's top ops."""
    sums = {name: summarize(rows, wall, vocab_size) for name, (rows, wall) in profiles.items()}
    keys = sorted({k for s in sums.values() for k in s}, key=lambda k: -sums["vllm"].get(k, 0.0))
    print(f"\n{'where the time goes (profiled run)':<42} {'raylm s':>8} {'%':>5} {'vLLM s':>8} {'%':>5}")
    for k in keys:
        r, v = sums["raylm"].get(k, 0.0), sums["vllm"].get(k, 0.0)
        print(f"{k:<42} {r:>8.2f} {100 * r / profiles['raylm'][1]:>5.1f} "
              f"{v:>8.2f} {100 * v / profiles['vllm'][1]:>5.1f}")
    print(f"{'wall':<42} {profiles['raylm'][1]:>8.2f} {'':>5} {profiles['vllm'][1]:>8.2f}")
    for name, (rows, _) in profiles.items():
        if top:
            print(f"\n{name}: top {top} ops by self time")
            for r in top_ops(rows, top):
                print(f"  {r['self_us'] / 1e6:>8.2f}s {r['calls']:>7} {r['op'][:40]:<40} {r['shapes'][:70]}")


if __name__ == "__main__":
    main()
