"""Fused MoE through torch._grouped_mm, on any device (the CUDA table's path; on the CPU, a
candidate and the fallback where raylm's kernels cannot be built).

The (token, expert) pairs are sorted by this rank's expert index, the pairs of experts held
elsewhere last; one grouped GEMM runs gate/up over every local expert's rows, silu * up runs over
all pairs at once, a second grouped GEMM runs down, and the weighted rows are added into their
tokens (index_add_). No Python loop over experts and, for weights in x's dtype, no host sync of
its own: the shapes depend on T * top_k only (torch's fallback grouped GEMM, for the dtypes and
GPUs its fused kernels do not take, reads the offsets on the host and loops over the groups).
Rows past the last group (pairs held elsewhere) are left unwritten by the grouped GEMM, so may
hold anything, NaN included: they are masked out with a `where`, never multiplied.

Weights narrower than x (bf16 experts, fp32 compute) are widened per call, only the hit experts,
as the reference does: a transient copy, which the CPU table's own kernel avoids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.ops.base import Int8MoEWeights, MoEWeights, route_tokens

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_fits(x: torch.Tensor, experts: MoEWeights) -> bool:
    """Whether torch._grouped_mm takes this layer: it exists, takes x's dtype, and every operand's
    rows are a multiple of 16 bytes (hidden and intermediate sizes, in x's dtype); float experts
    only (int8 ones take their scales per product)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in GROUPED_DTYPES or isinstance(experts, Int8MoEWeights):
        return False
    per_16_bytes = 16 // x.element_size()
    return x.shape[-1] % per_16_bytes == 0 and experts.intermediate_size % per_16_bytes == 0


def grouped_mm_moe(x: torch.Tensor, router_logits: torch.Tensor, experts: MoEWeights, top_k: int,
                   renormalize: bool) -> torch.Tensor:
    """OpTable.fused_moe's contract through two torch._grouped_mm calls (grouped_mm_fits(x, experts)
    must hold). Every product is in x.dtype, as HF computes it."""
    weights, ids = route_tokens(router_logits, top_k, renormalize)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    num_local, inter = experts.num_local, experts.intermediate_size
    local = ids.reshape(-1) - experts.first_expert  # [T * k]
    held = (local >= 0) & (local < num_local)
    key = torch.where(held, local, num_local)  # pairs held elsewhere sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    w13, w2 = experts.w13, experts.w2
    if w13.dtype != x.dtype:
        hit = counts.nonzero().squeeze(1)  # a host sync: mixed dtypes are the slow path anyway
        w13, w2 = w13.index_select(0, hit).to(x.dtype), w2.index_select(0, hit).to(x.dtype)
        counts = counts.index_select(0, hit)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // top_k
    xs = x.index_select(0, token)  # [T * k, hidden], grouped by expert
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [T * k, 2I]
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)  # [T * k, hidden]
    y = torch.where(held[order, None], y * weights.reshape(-1)[order, None], 0).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)
