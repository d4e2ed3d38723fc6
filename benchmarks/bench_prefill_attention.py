"""Prefill attention on the CPU: SDPA with an explicit prefix+causal mask (what a chunk after a
cached prefix runs today when it is longer than KERNEL_CHUNK_TOKENS) against the same attention
split in two flash calls (the prefix without a mask, the chunk's own keys causal) merged by
their log-sum-exps, at Qwen3-0.6B's heads (16 query / 8 KV heads, head dim 128).

    PYTHONPATH=. python benchmarks/bench_prefill_attention.py [--threads 2] [--reps 5]

Prints ms and GF/s (the causal work only) per case and the largest difference between the two.
A script, not a test.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
CASES = [(862, 0), (500, 362), (300, 600), (1000, 1000), (100, 800)]  # (chunk tokens, cached tokens)


def best_ms(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def split_attention(q, k, v, cached: int, scale: float):
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    own, own_lse = flash(q, k[:, :, cached:], v[:, :, cached:], 0.0, True, scale=scale)
    if not cached:
        return own
    pre, pre_lse = flash(q, k[:, :, :cached], v[:, :, :cached], 0.0, False, scale=scale)
    m = torch.maximum(pre_lse, own_lse)
    w1, w2 = (pre_lse - m).exp_().unsqueeze(-1), (own_lse - m).exp_().unsqueeze(-1)
    return (pre * w1 + own * w2) / (w1 + w2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    scale = HEAD_DIM ** -0.5
    print(f"# torch {torch.__version__}, {a.threads} threads, fp32, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}")
    for n, cached in CASES:
        torch.manual_seed(n + cached)
        q = torch.randn(1, HEADS, n, HEAD_DIM)
        k, v = torch.randn(1, KV_HEADS, cached + n, HEAD_DIM), torch.randn(1, KV_HEADS, cached + n, HEAD_DIM)
        mask = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)

        masked = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, scale=scale,
                                   enable_gqa=True)
        split = functools.partial(split_attention, q, k, v, cached, scale)
        err = (masked() - split()).abs().max().item()
        flops = 4 * HEADS * HEAD_DIM * n * (cached + (n + 1) / 2)
        tm, ts = best_ms(masked, a.reps), best_ms(split, a.reps)
        print(f"chunk {n:5d} after {cached:5d} cached: masked SDPA {tm:7.1f} ms ({flops / tm / 1e6:5.1f} GF/s)   "
              f"split + merge {ts:7.1f} ms ({flops / ts / 1e6:5.1f} GF/s)   max diff {err:.1e}")


if __name__ == "__main__":
    main()
