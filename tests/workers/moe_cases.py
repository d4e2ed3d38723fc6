"""Seeded fused-MoE batches, and the reference answer every MoE backend is held to.

A case is a batch of tokens, their router logits and one layer's experts (`MoEWeights`), with
routing shaped by `pattern`: "random", "one_expert" (every token's choices include expert
`hot`), "few_experts" (only a few experts receive tokens: the rest are empty). A case may hold
only a slice of the experts (expert parallelism: first_expert > 0, num_local < num_experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.ops.base import MoEWeights, route_tokens
from workers.ops.reference import ReferenceOps

PATTERNS = ("random", "one_expert", "few_experts")


@dataclass
class MoECase:
    x: torch.Tensor  # [T, hidden]
    router_logits: torch.Tensor  # [T, E]
    w13: torch.Tensor  # [num_local, 2I, hidden]
    w2: torch.Tensor  # [num_local, hidden, I]
    first_expert: int
    num_experts: int
    top_k: int
    renormalize: bool

    def weights(self) -> MoEWeights:
        return MoEWeights(self.w13, self.w2, self.first_expert, self.num_experts)


def make_moe_case(*, seed: int, tokens: int, num_experts: int = 8, top_k: int = 2, hidden: int = 48,
                  intermediate: int = 40, dtype=torch.float32, weight_dtype=None, pattern: str = "random",
                  renormalize: bool = True, first_expert: int = 0, num_local: int | None = None,
                  hot: int = 3) -> MoECase:
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    gen = torch.Generator().manual_seed(seed)
    num_local = num_experts - first_expert if num_local is None else num_local
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    if pattern == "one_expert":
        logits[:, hot] += 20.0
    elif pattern == "few_experts":
        chosen = torch.randperm(num_experts, generator=gen)[: top_k + 1]
        logits[:, chosen] += 20.0
    w13 = torch.randn(num_local, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_local, hidden, intermediate, generator=gen) * intermediate ** -0.5
    weight_dtype = weight_dtype or dtype
    return MoECase(x, logits.to(dtype), w13.to(weight_dtype), w2.to(weight_dtype), first_expert, num_experts,
                   top_k, renormalize)


def reference_moe(case: MoECase) -> torch.Tensor:
    """The reference table's answer, computed in float64 from the same (rounded) inputs: what
    a backend's float32 / bfloat16 answer is compared with."""
    # routed in the case's own dtype (the choices any backend makes), then computed in float64
    weights, ids = route_tokens(case.router_logits, case.top_k, case.renormalize)
    x, w13, w2 = case.x.double(), case.w13.double(), case.w2.double()
    out = torch.zeros_like(x)
    local = ids - case.first_expert
    for e in range(w13.shape[0]):
        token, slot = torch.where(local == e)
        if token.numel():
            h = ReferenceOps().silu_and_mul(x[token] @ w13[e].t()) @ w2[e].t()
            out.index_add_(0, token, h * weights[token, slot, None].double())
    return out
