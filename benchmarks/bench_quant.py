"""W8A8 against full precision, raylm against vLLM's CPU build, on the kernels workload: one
float checkpoint and its compressed-tensors W8A8 copy (`raylm quantize`, written beside it once),
the same requests to every contender, greedy, taking turns in one run.

    PYTHONPATH=. python benchmarks/bench_quant.py --checkpoint DIR [--num-requests 64]
        [--input-len 42:251] [--output-len 34:128] [--dtypes float32,bfloat16] [--no-vllm] [--rounds 1]

Contenders: raylm's bare step loop (ModelRunner + Scheduler in this process, what a worker runs)
on the float checkpoint in float32, and on the W8A8 copy in each of --dtypes (the compute dtype of
everything but the int8 GEMMs); vLLM (cluster/bench/vllm_peer.py, its venv by --peers-venv) on the
W8A8 copy in the dtype it computes in on this CPU, and on the float checkpoint in float32. With
--rounds N raylm fp32 and the W8A8 contenders take turns N times (the order reversed every other round, vLLM's
engine kept up between its runs) and their medians are the figures: on a host whose speed drifts
from minute to minute, one run each compares two different moments. Prints
each figure and the issue's ratios, how many greedy sequences and tokens raylm's W8A8 shares with
vLLM's, the weight bytes each raylm run holds against the float checkpoint's parameters in fp32,
and the int8 multiply-adds per second the decoder GEMMs reached. A random spec is saved as DIR
first when DIR has no config.json (--model, default random:qwen3-0.6b?layers=8&seed=0).
A script, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from cluster.bench.command import add_kernels_workload_args
from cluster.bench.contenders import EngineSpec, run_bare
from cluster.bench.vllm_peer import VLLMPeer, peer_dtype, save_checkpoint
from cluster.bench.workload import kv_blocks_for, make_workload
from workers.loader import load_config, load_model
from workers.ops.cpu_features import cpu_class
from workers.quant.export import export_w8a8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_kernels_workload_args(ap)
    ap.add_argument("--dtypes", default=None,
                    help="raylm's compute dtypes on the W8A8 copy (default: float32, and bfloat16 where the CPU "
                         "has bf16 matmuls)")
    ap.add_argument("--w8a8", default=None, help="where the W8A8 copy is (written once; default DIR-w8a8)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="turns of raylm fp32 and the W8A8 contenders (medians are the figures)")
    a = ap.parse_args()
    save_checkpoint(a.model, a.checkpoint)
    w8a8 = a.w8a8 or a.checkpoint.rstrip("/") + "-w8a8"
    if not os.path.exists(os.path.join(w8a8, "config.json")):
        export_w8a8(a.checkpoint, w8a8)
    config = load_config(a.checkpoint)
    wl = make_workload(a.num_requests, a.input_len, a.output_len, config.vocab_size, a.seed)
    vllm_dtype = peer_dtype()
    dtypes = a.dtypes.split(",") if a.dtypes else sorted({"float32", vllm_dtype})
    print(f"# {a.checkpoint} and {w8a8}: {wl.describe()}; CPU class {cpu_class()}; "
          f"load average {os.getloadavg()}", flush=True)

    def spec(path, dtype):
        return EngineSpec(path, dtype, 1, a.threads, True, a.batch_size, 16, kv_blocks_for(wl, 16),
                          a.max_num_batched_tokens, a.seed)

    figs, outs, held = {}, {}, {}

    def raylm(name, path, dtype):
        fig, outs[name] = run_bare(load_model(path, dtype), spec(path, dtype), wl)
        print(f"{name}: {fig['output_tok_s']:.2f} output tok/s", flush=True)
        return fig["output_tok_s"]

    held["raylm fp32"] = weight_bytes(a.checkpoint, "float32")
    quant = {"raylm fp32": lambda: raylm("raylm fp32", a.checkpoint, "float32")}  # in the turns: its ratio's other term
    quant.update({f"raylm w8a8 {d}": (lambda n=f"raylm w8a8 {d}", d=d: raylm(n, w8a8, d)) for d in dtypes})
    for d in dtypes:
        held[f"raylm w8a8 {d}"] = weight_bytes(w8a8, d)
    peer = None if a.no_vllm else start_vllm(a, w8a8, vllm_dtype)
    try:
        if peer is not None:
            peer_name = f"vLLM w8a8 {vllm_dtype}"

            def vllm_w8a8():
                elapsed, outs[peer_name] = peer.run(wl.prompts, wl.output_lens)
                print(f"{peer_name}: {wl.output_tokens / elapsed:.2f} output tok/s", flush=True)
                return wl.output_tokens / elapsed

            quant[peer_name] = vllm_w8a8
        rounds = {name: [] for name in quant}
        for r in range(a.rounds):
            for name in (list(quant) if r % 2 == 0 else list(quant)[::-1]):
                rounds[name].append(quant[name]())
    finally:
        if peer is not None:
            peer.close()
    for name, values in rounds.items():
        figs[name] = statistics.median(values)
        if a.rounds > 1:
            print(f"{name}: median {figs[name]:.2f} output tok/s of {', '.join(f'{v:.1f}' for v in values)}")
    if not a.no_vllm:
        figs["vLLM fp32"], outs["vLLM fp32"] = run_vllm(a, a.checkpoint, "float32", wl)
        print(f"vLLM fp32: {figs['vLLM fp32']:.2f} output tok/s", flush=True)
    for name in held:
        print(f"{name}: {held[name] / 1e6:.1f} MB of weights held")

    fp32_bytes = 4 * sum(p.numel() for p in load_model(a.checkpoint, "float32").parameters())
    print(f"\nweights in fp32 (the checkpoint's parameters at 4 bytes): {fp32_bytes / 1e6:.1f} MB")
    for name in held:
        print(f"  {name}: {held[name] / 1e6:.1f} MB held = {held[name] / fp32_bytes:.2f} of fp32's")
    for d in dtypes:
        ours = f"raylm w8a8 {d}"
        print(f"{ours} / raylm fp32 = {figs[ours] / figs['raylm fp32']:.2f}")
        for peer in [k for k in figs if k.startswith("vLLM")]:
            print(f"{ours} / {peer} = {figs[ours] / figs[peer]:.2f}")
        peer = f"vLLM w8a8 {vllm_dtype}"
        if peer in outs:
            seqs = sum(x == y for x, y in zip(outs[ours], outs[peer]))
            toks = sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(outs[ours], outs[peer]))
            prefix = sum(_common_prefix(x, y) for x, y in zip(outs[ours], outs[peer]))
            first = sum(x[:1] == y[:1] for x, y in zip(outs[ours], outs[peer]))
            print(f"  greedy vs {peer}: {seqs}/{wl.num_requests} sequences identical, {first}/{wl.num_requests} "
                  f"first tokens equal, {toks}/{wl.output_tokens} tokens equal at their position, "
                  f"{prefix}/{wl.output_tokens} before the first difference")
    macs = decoder_macs(config, wl)
    for d in dtypes:
        print(f"decoder-linear int8 multiply-adds: {macs / 1e9:.0f} G per run; at raylm w8a8 {d}'s wall "
              f"{wl.output_tokens / figs[f'raylm w8a8 {d}']:.1f} s that is "
              f"{macs / (wl.output_tokens / figs[f'raylm w8a8 {d}']) / 1e9:.0f} G int8 MAC/s (whole-run average, "
              "all ops' time included)")


def weight_bytes(path: str, dtype: str) -> int:
    """The weight bytes a worker serving `path` in `dtype` holds (stats()["weight_bytes"]: what it
    loaded and prepared, each storage once)."""
    from workers.runner import ModelRunner
    from workers.runner_config import RunnerConfig

    runner = ModelRunner(RunnerConfig(model=path, device="cpu", dtype=dtype, num_kv_blocks=16, max_num_seqs=4,
                                      max_num_batched_tokens=256))
    try:
        return runner.stats()["weight_bytes"]
    finally:
        runner.close()


def _common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    for p, q in zip(x, y):
        if p != q:
            break
        n += 1
    return n


def decoder_macs(config, wl) -> int:
    """Multiply-adds of the decoder's quantized linears (q/k/v, o, gate/up, down; a MoE layer's top-k
    experts) over every token the run computes: each prompt token once, each output token but the last
    once."""
    h, i = config.hidden_size, config.intermediate_size
    if getattr(config, "num_experts", 0):  # every layer sparse (Qwen3-MoE's published models)
        i = config.num_experts_per_tok * config.moe_intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_token = h * (q + 2 * kv) + q * h + h * 2 * i + i * h
    tokens = sum(len(p) for p in wl.prompts) + sum(n - 1 for n in wl.output_lens)
    return per_token * config.num_hidden_layers * tokens


def start_vllm(a, path: str, dtype: str) -> VLLMPeer:
    t = time.perf_counter()
    peer = VLLMPeer(path, dtype=dtype, max_num_seqs=a.batch_size, max_num_batched_tokens=a.max_num_batched_tokens,
                    block_size=None, threads=a.threads, venv=a.peers_venv,
                    log_path=os.path.join(tempfile.gettempdir(), "vllm-peer-quant.log"))
    print(f"vLLM {peer.version} up in {time.perf_counter() - t:.0f}s on {os.path.basename(path)}", flush=True)
    return peer


def run_vllm(a, path: str, dtype: str, wl) -> tuple[float, list[list[int]]]:
    peer = start_vllm(a, path, dtype)
    try:
        elapsed, out = peer.run(wl.prompts, wl.output_lens)
    finally:
        peer.close()
    return wl.output_tokens / elapsed, out


if __name__ == "__main__":
    main()
