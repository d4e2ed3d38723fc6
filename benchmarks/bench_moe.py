"""The CPU table's fused-MoE paths on one Qwen3-30B-A3B-shaped layer (128 experts, top-8, hidden
2048, intermediate 768, bf16 experts), at decode and prefill token counts.

    PYTHONPATH=. python benchmarks/bench_moe.py [--threads N] [--tokens 1,8,64,256] [--reps 8] [--layers 4]

Prints the CPU's flags and class, this machine's memory read bandwidth (a sum over a tensor far
larger than the caches, all threads), then per compute dtype (fp32 activations over the bf16
experts, and bf16 over bf16) and token count, each path's milliseconds per layer (median) and the
bytes of expert weights it had to read (hit experts only) per second, and which path the table's
own measurement picks (fp32 activations: the bf16 experts packed at prepare, "cpp-packed", the
only path the table then has; "cpp" is timed on the unpacked experts for comparison), and
"cpp-int8", the same layers quantized W8A8 (int8 experts, activations quantized per token; its
GB/s counts int8 bytes). Each rep
runs the next of `--layers` layers with fresh random routing (a trained router's is close to
random), as a model's steps do: one layer's experts alone can sit in a large last-level cache and
would report its bandwidth, not memory's. A script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers.ops import cpu_kernels, cpu_moe
from workers.ops.base import Int8MoEWeights, MoEWeights, route_tokens
from workers.ops.cpu_features import cpu_class, cpu_flags
from workers.ops.cpu_moe import CPUMoE
from workers.quant.weights import quantize_int8

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of a sum over `gib` GiB of fp32 with every thread (the best of `reps`)."""
    big = torch.ones(int(gib * 2**30) // 4)
    big.sum()
    best = min(_seconds(big.sum) for _ in range(reps))
    return big.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _path_seconds(moe: CPUMoE, path: str, batches, layers) -> list[float]:
    """Seconds of each batch's call of `path`, batch i on layer i mod len(layers)."""
    times = []
    for i, (x, logits) in enumerate(batches):
        t0 = time.perf_counter()
        moe.run(path, x, logits, layers[i % len(layers)], TOP_K, True)
        times.append(time.perf_counter() - t0)
    return times


def _int8(layer: MoEWeights) -> Int8MoEWeights:
    """A layer's experts quantized W8A8 (per output channel), as quantization="int8" does at load."""
    w13, w2 = quantize_int8(layer.w13), quantize_int8(layer.w2)
    return Int8MoEWeights(w13.qweight, w2.qweight, layer.first_expert, layer.num_experts, w13.scale, w2.scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--tokens", default="1,8,64,256", help="token counts, comma separated (1024 is slow on 2 cores)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4, help="layers rotated through (1.2 GB of experts each)")
    ap.add_argument("--paths", default="cpp-packed,cpp,aten-mm,grouped-mm,cpp-int8",
                    help="paths to time (reference: slow)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    flags = cpu_flags()
    print(f"# cpu class {cpu_class()}; flags: {' '.join(f for f in SHOWN_FLAGS if f in flags) or 'none'}")
    kernels = cpu_kernels.load()
    isa = kernels.fused_moe_isa() if kernels is not None else f"not built ({cpu_kernels.failure()})"
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; raylm kernel: {isa}")
    print(f"# memory read bandwidth: {read_bandwidth():.1f} GB/s (sum over 1 GiB, all threads)")
    gen = torch.Generator().manual_seed(0)
    moe = CPUMoE()
    layers = [moe.prepare((torch.randn(E, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5).bfloat16(),
                          (torch.randn(E, HIDDEN, INTER, generator=gen) * INTER ** -0.5).bfloat16(), 0, E)
              for _ in range(a.layers)]
    packed = [moe.prepare(layer.w13, layer.w2, 0, E, dtype=torch.float32) for layer in layers]  # cpp-packed's
    # cpp-int8's, as the table holds them
    int8 = [moe.prepare_int8(_int8(layer)) for layer in layers] if "cpp-int8" in a.paths else []
    bytes_per_expert = (layers[0].w13[0].numel() + layers[0].w2[0].numel()) * layers[0].w13.element_size()
    paths = a.paths.split(",")
    print(f"# layer: {E} experts, top-{TOP_K}, hidden {HIDDEN}, intermediate {INTER}, bf16 experts "
          f"({bytes_per_expert / 2**20:.1f} MiB each), {a.layers} layers rotated")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"\n## compute {str(dtype).removeprefix('torch.')}, experts bfloat16")
        print(f"{'T':>5} {'hit':>5} " + " ".join(f"{p + ' ms':>14} {'GB/s':>6}" for p in paths) + "  chosen")
        for t in (int(v) for v in a.tokens.split(",")):
            batches = [(torch.randn(t, HIDDEN, generator=gen).to(dtype), torch.randn(t, E, generator=gen).to(dtype))
                       for _ in range(a.reps + 1)]
            hits = [route_tokens(logits, TOP_K, True)[1].unique().numel() for _, logits in batches]
            cells = []
            with torch.inference_mode():
                for path in paths:
                    held = {"cpp-packed": packed, "cpp-int8": int8}.get(path, layers)
                    unfit = path not in moe.candidates(batches[0][0], held[0]) and path != "reference"
                    if unfit or (path == "cpp-packed" and dtype != torch.float32):
                        cells.append(f"{'-':>14} {'-':>6}")
                        continue
                    times = _path_seconds(moe, path, batches, held)[1:]  # the first: warm-up
                    width = held[0].w13.element_size() / layers[0].w13.element_size()
                    gbps = sum(hits[1:]) * bytes_per_expert * width / sum(times) / 1e9
                    cells.append(f"{statistics.median(times) * 1e3:14.2f} {gbps:6.1f}")
                cpu_moe._chosen.clear()
                chosen = moe.choose(*batches[0], (packed if dtype == torch.float32 else layers)[0], TOP_K, True)
            print(f"{t:>5} {statistics.mean(hits):5.1f} " + " ".join(cells) + f"  {chosen}")

if __name__ == "__main__":
    main()
