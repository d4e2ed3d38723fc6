"""The op table: the contract between the Qwen3 model and a device's kernels.

The model is written once against `OpTable`; each device fills one in (`reference` is
plain torch and defines correct; `cpu`, `cuda` and `npu` are the fast ones). A table is
chosen per runner by `workers.ops.get_op_table` and every table is tested against the
reference.

The flat batch of a step is `num_decode` decode rows (one token each) followed by the
prefill chunks, in that order. `AttentionMetadata` describes it once per step in the
layout the fused paged-attention kernels of vLLM / vllm-ascend / FlashInfer all use
(cumulative query starts, per-sequence KV lengths, a padded int32 block table); a backend
adds what it needs in `prepare` (masks, kernel plans), once per step, shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workers.quant.weights import Int8Weight, reference_linear


@dataclass
class AttentionMetadata:
    num_tokens: int  # T: rows of the flat batch
    num_decode: int  # D: the first D sequences are decode rows, one query token each
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written (block * block_size + offset)
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query starts; sequence i owns rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: keys sequence i attends to after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    # the same numbers on the host (kernels and graph buckets that need Python ints)
    query_lens_host: list[int] = field(default_factory=list)  # [B]
    seq_lens_host: list[int] = field(default_factory=list)  # [B]
    extra: dict = field(default_factory=dict)  # the backend's own per-step state (masks, plans)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def decode_block_tables(self) -> torch.Tensor:
        """[num_decode, blocks of the longest decode row's context]: the decode rows' tables."""
        longest = max(self.seq_lens_host[: self.num_decode])
        return self.block_tables[: self.num_decode, : -(-longest // self.block_size)]

    def prefill_chunks(self):
        """(row, first token row, new tokens, cached tokens) of each prefill chunk: the rows
        after the decode rows, whose new tokens follow the decode rows' in the flat batch."""
        start = sum(self.query_lens_host[: self.num_decode])
        for i in range(self.num_decode, self.num_seqs):
            n = self.query_lens_host[i]
            yield i, start, n, self.seq_lens_host[i] - n
            start += n


class AttentionBackend:
    """Paged attention over a KVCache (workers/kv_cache.py: per layer K and V of
    [num_blocks, block_size, kv_heads, head_dim], contiguous)."""

    name = "base"

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Once per step, before the first layer: fill meta.extra. Default: nothing."""
        return meta

    def write_kv(self, kv_cache, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """k, v [T, KVH, D] -> the cache at meta.slot_mapping (by default the pool's own
        index_copy write; a backend with a fused write overrides it)."""
        kv_cache.write(layer, k, v, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, layer: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], this step's k/v [T, KVH, D] (already written) -> [T, H * D].

        Causal within each sequence, with its cached keys before its new ones (a chunk's
        query i sits at position seq_len - query_len + i)."""
        raise NotImplementedError


@dataclass
class MoEWeights:
    """One MoE layer's experts as this rank holds them: global experts
    [first_expert, first_expert + num_local) of `num_experts` (the router's width).

    w13 [num_local, 2 * I, hidden]: each expert's gate rows, then its up rows (HF's gate_up_proj);
    w2 [num_local, hidden, I]: its down projection. Under tensor parallelism without expert
    parallelism I is this rank's slice of moe_intermediate_size. The weights may be narrower than
    the activations (bf16 experts, fp32 compute): a table widens them as it reads them, never
    keeping a wide copy. A table's prepare_moe may return a subclass carrying its own layout."""

    w13: torch.Tensor
    w2: torch.Tensor
    first_expert: int
    num_experts: int

    @property
    def num_local(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


@dataclass
class Int8MoEWeights(MoEWeights):
    """One MoE layer's experts quantized W8A8 with dynamic activations (compressed-tensors'
    int-quantized, msmodelslim's W8A8_DYNAMIC, quantization="int8"): w13 / w2 int8 in MoEWeights'
    layout, w13_scale fp32 [num_local, 2I] and w2_scale fp32 [num_local, hidden], one per output
    channel. Each expert's two products are W8A8 linears (workers/quant/weights.py): x quantized
    per token before gate/up, silu(gate) * up (in x's dtype) quantized per token before down."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor

    def gate_up(self, e: int) -> Int8Weight:
        return Int8Weight(self.w13[e], self.w13_scale[e])

    def down(self, e: int) -> Int8Weight:
        return Int8Weight(self.w2[e], self.w2_scale[e])


def route_tokens(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router after its linear: softmax over every expert in fp32, the top_k, divided
    by their sum when `renormalize` (norm_topk_prob), cast to the logits' dtype.
    router_logits [T, E] -> (weights [T, top_k] in router_logits.dtype, expert ids [T, top_k] int64)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class QuantLinear:
    """A prepared quantized linear (workers/quant): the weight, the tensors `run` made of it
    (`held`: a kernel's packed layout; counted in weight_bytes), and `path`, the name of how it
    runs (stats()["ops"]["quantized"])."""

    def __init__(self, path: str, run, weight, bias: torch.Tensor | None, held: list | None = None) -> None:
        self.path, self.run, self.weight, self.bias, self.held = path, run, weight, bias, held or []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x.dtype, the bias added."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = self.run(x2)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


class OpTable:
    """Everything the model computes with besides plain tensor views."""

    name = "base"
    attention: AttentionBackend
    quant_paths: frozenset = frozenset()  # how the quantized linears prepared so far run

    @staticmethod
    def agree(value: int) -> int:
        """A choice this table measured while preparing weights (a kernel, a row crossover) -> the
        one to take. The runner of a tensor-parallel rank sets it to rank 0's value, so every rank
        computes a replicated weight (a MoE router, a draft model, an EAGLE-3 head) with the same
        kernel and gets the same bits: measurements differ between processes, and so do the
        roundings of two kernels, and a router's near tie must not route differently on two ranks."""
        return value

    @staticmethod
    def agree_all(flag: bool) -> bool:
        """Whether a path this rank qualifies for by its weight's values (a bf16 copy of an fp32
        weight whose values are all bf16's) is one every rank qualifies for: a tensor-parallel
        rank's runner sets it, so the ranks' shards take one path and measure it together."""
        return flag

    def describe(self) -> dict:
        """Which paths this table runs (reported in the runner's stats())."""
        quantized = {"quantized": ",".join(sorted(self.quant_paths))} if self.quant_paths else {}
        return {"table": self.name, "attention": self.attention.name, **quantized}

    # -- linear layers: weights prepared once at load (packed, reordered, fused) --
    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight [out, in] -> a handle `linear` takes (default: the weight itself)."""
        return (weight, bias)

    def linear(self, x: torch.Tensor, handle) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if isinstance(handle, QuantLinear):
            return handle(x)
        weight, bias = handle
        return torch.nn.functional.linear(x, weight, bias)

    def prepare_quantized_linear(self, weight, bias: torch.Tensor | None = None,
                                 dtype: torch.dtype | None = None) -> QuantLinear:
        """A quantized weight (workers/quant: Int8Weight, Int4Weight) whose activations will be
        `dtype` -> the handle `linear` takes. Default: the format's arithmetic in plain torch
        (workers/quant/weights.py), which defines correct."""
        return self._quantized("reference", lambda x: reference_linear(x, weight), weight, bias)

    def _quantized(self, path: str, run, weight, bias, held: list | None = None) -> QuantLinear:
        """A QuantLinear handle, its path recorded for describe()."""
        path = f"{weight.scheme}:{path}"
        self.quant_paths = self.quant_paths | {path}
        return QuantLinear(path, run, weight, bias, held)

    def linear_argmax(self, x: torch.Tensor, handle, n: int) -> torch.Tensor:
        """argmax over the first n outputs of linear(x) per row, int64 [T], ties to the lowest
        index (greedy ids straight from the lm_head). Default: the logits, then their argmax; a
        table with a fused kernel never writes the [T, n] logits."""
        return self.linear(x, handle)[:, :n].argmax(dim=-1)

    def linear_rows(self, handle, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """Rows `ids` of a prepared linear's weight, widened into out [T, in] (a tied embedding's
        lookups served by the lm_head's handle); None where the handle cannot give them back."""
        if isinstance(handle, tuple):  # quantized handles cannot: the model keeps a tied embedding then
            weight = handle[0]
            return out.copy_(weight.index_select(0, ids)) if weight.dtype != out.dtype else \
                torch.index_select(weight, 0, ids, out=out)
        return None

    def linear_into(self, x: torch.Tensor, handle, out: torch.Tensor) -> torch.Tensor:
        """linear(x) written into out [T, out'] (out' <= out features: only the first out' of them;
        the lm_head into the resident logits buffer). Default: compute, then copy."""
        y = self.linear(x, handle)
        return out.copy_(y[:, : out.shape[1]])

    # -- elementwise and norms --
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Qwen3RMSNorm: normalize in fp32, cast back to x.dtype, then scale."""
        raise NotImplementedError

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); the sum is in x.dtype, as HF adds."""
        s = x + residual
        return self.rms_norm(s, weight, eps), s

    def rotary_cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                       attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] (fp32 math, scaled by attention_factor as HF's
        YaRN does, cast to dtype), once per step."""
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        return cos.to(dtype), sin.to(dtype)

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half (neox) RoPE: q [T, H, D], k [T, KVH, D], cos/sin [T, D]."""
        raise NotImplementedError

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head q/k RMSNorm, then RoPE: q [T, H, D], k [T, KVH, D] (views into the
        qkv projection's output) -> rotated q, k. A table may fuse the two (CPU does)."""
        return self.apply_rotary(self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps), cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] (gate then up) -> silu(x[:, :I]) * x[:, I:]  [T, I]."""
        raise NotImplementedError

    # -- mixture of experts --
    def prepare_moe(self, w13: torch.Tensor, w2: torch.Tensor, first_expert: int, num_experts: int,
                    dtype: torch.dtype | None = None) -> MoEWeights:
        """One layer's experts (MoEWeights' layout) -> the handle fused_moe takes, once at load;
        dtype: the activations' (None: the experts'), where a table lays out narrower experts apart."""
        return MoEWeights(w13, w2, first_expert, num_experts)

    def prepare_quantized_moe(self, experts: Int8MoEWeights, dtype: torch.dtype | None = None) -> MoEWeights:
        """One layer's int8 experts -> the handle fused_moe takes, once at load; dtype: the
        activations'. Default: as they are (the reference's expert loop of W8A8 linears)."""
        self.quant_paths = self.quant_paths | {"moe-w8a8-dynamic:reference"}
        return experts

    def fused_moe(self, x: torch.Tensor, router_logits: torch.Tensor, experts: MoEWeights, top_k: int,
                  renormalize: bool) -> torch.Tensor:
        """Qwen3's sparse MoE block after the router's linear: x [T, hidden], router_logits [T, E]
        -> [T, hidden] in x.dtype. Each token is routed as `route_tokens` says; its output is the
        sum, over its chosen experts that this rank holds, of weight * down(silu(gate(x)) * up(x)),
        each expert's product in x.dtype as HF computes it. Experts held elsewhere add nothing
        (the caller all-reduces)."""
        raise NotImplementedError
