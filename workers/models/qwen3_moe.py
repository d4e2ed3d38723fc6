"""Qwen3-MoE's sparse block: a router and `num_experts` SwiGLU experts, of which each token
uses `num_experts_per_tok`.

Parameter names are those transformers 5 gives the block in memory (`mlp.gate.weight`, the
router; `mlp.experts.gate_up_proj` [E, 2I, hidden] and `mlp.experts.down_proj` [E, hidden, I]),
so one tensor holds a layer's experts; the loader fills them from Qwen's per-expert checkpoint
names (`mlp.experts.N.gate_proj.weight`, ...) or from this fused layout. Routing and the expert
products are one op of the table (`fused_moe`), which groups tokens by expert.

Under tensor parallelism the router is replicated. Each rank holds either a slice of every
expert's intermediate dim (plain TP), or whole experts, num_experts / world of them (expert
parallelism, `TensorParallel.expert_parallel`); either way its partial outputs are summed by
the all-reduce the dense MLP uses too.

A quantized checkpoint's experts (W8A8 with dynamic activations) are Qwen3MoeInt8Experts: int8
weights with per-channel scales, run by the table's int8 MoE (OpTable.prepare_quantized_moe).

The experts may be stored narrower than the model computes (a bf16 checkpoint computing in fp32
on a CPU keeps its experts bf16: exact, half the bytes a decode step reads); the table widens
them as it reads.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.ops.base import Int8MoEWeights, OpTable
from workers.parallel import SINGLE, ShardedShape, TensorParallel


class Qwen3MoeExperts(nn.Module):
    """This rank's experts: global ids [first_expert, first_expert + num_local)."""

    def __init__(self, config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        shape = ShardedShape.of(config, parallel)
        self.first_expert = shape.first_expert
        self.num_experts = config.num_experts
        inter, hidden = shape.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(shape.num_local_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(shape.num_local_experts, hidden, inter))


class Qwen3MoeInt8Experts(nn.Module):
    """This rank's experts quantized W8A8 (dynamic per-token activations): int8 weights in
    Qwen3MoeExperts' layout and one fp32 scale per output channel, stacked by the loader from the
    format's per-expert `weight` / `weight_scale` tensors (or made at load: quantization="int8")."""

    scheme = "w8a8-dynamic"

    def __init__(self, config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        shape = ShardedShape.of(config, parallel)
        self.first_expert = shape.first_expert
        self.num_experts = config.num_experts
        n, inter, hidden = shape.num_local_experts, shape.moe_intermediate_size, config.hidden_size
        for name, size, dtype in (("gate_up_proj", (n, 2 * inter, hidden), torch.int8),
                                  ("gate_up_proj_scale", (n, 2 * inter), torch.float32),
                                  ("down_proj", (n, hidden, inter), torch.int8),
                                  ("down_proj_scale", (n, hidden), torch.float32)):
            self.register_parameter(name, nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False))

    def weights(self) -> Int8MoEWeights:
        return Int8MoEWeights(self.gate_up_proj, self.down_proj, self.first_expert, self.num_experts,
                              self.gate_up_proj_scale, self.down_proj_scale)


class Qwen3SparseMoeBlock(nn.Module):
    def __init__(self, config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Qwen3MoeExperts(config, parallel)

    def prepare(self, ops: OpTable, dtype: torch.dtype | None = None) -> dict:
        e, dtype = self.experts, self.gate.weight.dtype  # the router computes in x's dtype
        experts = ops.prepare_quantized_moe(e.weights(), dtype) if isinstance(e, Qwen3MoeInt8Experts) else \
            ops.prepare_moe(e.gate_up_proj, e.down_proj, e.first_expert, e.num_experts, dtype=dtype)
        return {"router": ops.prepare_linear(self.gate.weight, None), "experts": experts}

    def forward(self, ops: OpTable, w: dict, x: torch.Tensor) -> torch.Tensor:
        router_logits = ops.linear(x, w["router"])  # [T, E], in x's dtype as HF computes it
        out = ops.fused_moe(x, router_logits, w["experts"], self.top_k, self.renormalize)  # [T, hidden]
        return self.parallel.all_reduce(out)  # summed over the ranks
