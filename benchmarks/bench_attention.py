"""Paged attention backends side by side on Qwen3-0.6B's attention shape (16 query heads, 8 KV
heads, head_dim 128, block 16) or the bundled tiny model's (--shape tiny), in fp32 or a half
dtype (--dtype bfloat16: the pool, q and the output in it, as a bf16 model computes): a decode
batch and a mixed batch with prefill chunks.

    PYTHONPATH=. python benchmarks/bench_attention.py [--threads 2] [--rows 64] [--ctx 40:380] [--reps 5]
        [--block-size 16] [--shape qwen3-0.6b|tiny] [--dtype float32|bfloat16|float16]

Backends take turns in every repetition (so machine load hits them alike); prints the median
milliseconds per layer call (prepare excluded: it runs once per step for all layers) and the
largest difference from the reference, and for decode the pool's keys and values read per
second (what bounds it where the kernel keeps up with memory). A script, not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from workers.kv_cache import KVCache
from workers.ops import cpu_kernels
from workers.ops.cpu_attention import ChunkedPagedAttention, PagedAttention, PortablePagedAttention
from workers.ops.metadata import SequenceRows, build_metadata
from workers.ops.reference import GatherSDPAAttention

SHAPES = {"qwen3-0.6b": (8, 16, 128), "tiny": (2, 4, 32)}  # KV heads, query heads, head_dim


def batch(rng, rows, ctx, prefills, bs, num_blocks):
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for _ in range(rows):
        n = rng.randint(*ctx)
        seqs.append(SequenceRows(n - 1, 1, [free.pop() for _ in range(-(-n // bs))]))
    for cached, n in prefills:
        seqs.append(SequenceRows(cached, n, [free.pop() for _ in range(-(-(cached + n) // bs))]))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", default="40:380")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (raylm's default: 16)")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b",
                    help="attention shape: Qwen3-0.6B's or the bundled tiny model's (4 query heads, 2 KV, head_dim 32)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    ctx = tuple(int(x) for x in a.ctx.split(":"))
    bs, (kvh, h, d) = a.block_size, SHAPES[a.shape]
    rng = random.Random(0)
    backends = {"gather-sdpa (reference)": GatherSDPAAttention(), "chunked-online-softmax": ChunkedPagedAttention()}
    if cpu_kernels.load() is not None:  # raylm's C++ kernel, where it builds
        backends["paged-cpp"] = PagedAttention()  # vectorized where the build has AVX2 + FMA
        backends["paged-cpp-portable"] = PortablePagedAttention()
    cases = {"decode": (a.rows, []), "mixed": (a.rows // 2, [(0, 300), (160, 200)])}
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    for case, (rows, prefills) in cases.items():
        seqs = batch(rng, rows, ctx, prefills, bs, 65536 // bs)
        cache = KVCache(num_layers=1, num_blocks=65536 // bs, block_size=bs, num_kv_heads=kvh, head_dim=d,
                        dtype=dtype)
        cache.data.normal_()
        t = sum(s.num_tokens for s in seqs)
        q, k, v = (torch.randn(t, n, d).to(dtype) for n in (h, kvh, kvh))
        metas = {name: b.prepare(build_metadata(seqs, num_decode=rows, block_size=bs)) for name, b in backends.items()}
        for name, b in backends.items():  # this step's K/V in the pool, as the model writes it first
            b.write_kv(cache, 0, k, v, metas[name])
        times = {name: [] for name in backends}
        outs = {}
        with torch.inference_mode():
            for _ in range(a.reps + 1):
                for name, b in backends.items():
                    t0 = time.perf_counter()
                    outs[name] = b.forward(q, k, v, cache, 0, metas[name])
                    times[name].append(time.perf_counter() - t0)
        ref = outs["gather-sdpa (reference)"]
        ctx_tokens = sum(s.start + s.num_tokens for s in seqs)
        pool_bytes = ctx_tokens * 2 * kvh * d * cache.data.element_size()
        print(f"{case}: {rows} decode rows + {len(prefills)} chunks, {t} query tokens, {ctx_tokens} keys, {a.dtype}")
        for name in backends:
            ms = statistics.median(times[name][1:]) * 1e3
            rate = f"  {pool_bytes / ms / 1e6:5.1f} GB/s of K/V" if case == "decode" else ""
            diff = float((outs[name].float() - ref.float()).abs().max())
            print(f"  {name:>26}: {ms:8.2f} ms  max|diff| {diff:.2e}{rate}")


if __name__ == "__main__":
    main()
