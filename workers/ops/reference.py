"""The reference op table: plain eager torch. It defines correct; every other table is tested
against it (and it against HF transformers through the model).

Attention gathers each sequence's blocks through its block table and calls SDPA:
- the decode rows together, one call, their padded block tables gathered at once and a key
  mask hiding each row's padding;
- a prefill chunk that starts at position 0 attends causally within its own new keys (no gather);
- one that starts after cached tokens gathers its blocks and uses an offset-causal mask (SDPA's
  is_causal aligns top-left, which is wrong when q_len < kv_len).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.ops.base import AttentionBackend, AttentionMetadata, Int8MoEWeights, MoEWeights, OpTable, route_tokens
from workers.quant.weights import reference_linear


def _blocks_for(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


def gather_chunk(meta: AttentionMetadata, row: int, n: int, cached: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of n new tokens after `cached` ones: the block ids covering its context, and the
    offset-causal mask [n, blocks * block_size] (query j at position cached + j sees keys <= it)."""
    bs = meta.block_size
    nb = _blocks_for(cached + n, bs)
    keys = torch.arange(nb * bs, device=meta.slot_mapping.device)
    queries = torch.arange(cached, cached + n, device=meta.slot_mapping.device)
    return meta.block_tables[row, :nb], keys[None, :] <= queries[:, None]


class GatherSDPAAttention(AttentionBackend):
    name = "gather-sdpa"

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        bs, d = meta.block_size, meta.num_decode
        device = meta.slot_mapping.device
        if d:
            tables = meta.extra["decode_tables"] = meta.decode_block_tables()  # [D, nb]
            width = tables.shape[1] * bs
            mask = None
            if any(n != width for n in meta.seq_lens_host[:d]):
                keys = torch.arange(width, device=device)
                mask = (keys[None, :] < meta.seq_lens[:d, None])[:, None, None, :]  # [D, 1, 1, nb * bs]
            meta.extra["decode_mask"] = mask
        chunks = []
        for i, start, n, cached in meta.prefill_chunks():
            ids, mask = gather_chunk(meta, i, n, cached) if cached else (None, None)
            chunks.append((start, n, cached, ids, mask))
        meta.extra["chunks"] = chunks
        return meta

    def forward(self, q, k, v, kv_cache, layer, meta):
        t, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        scale = head_dim ** -0.5
        outs = []
        d = meta.num_decode
        if d:
            keys, values = kv_cache.gather(layer, meta.extra["decode_tables"])  # [D, n, KVH, D]
            # one query per row: fold a KV group's query heads into the query-length axis
            qd = q[:d].view(d, num_kv_heads, group, head_dim)  # [D, KVH, group, D]
            o = F.scaled_dot_product_attention(qd, keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=meta.extra["decode_mask"], scale=scale)
            outs.append(o.reshape(d, num_heads * head_dim))
        for s, n, cached, ids, mask in meta.extra["chunks"]:
            qc = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if cached == 0:
                kc, vc = k[s:s + n], v[s:s + n]  # [n, KVH, D]
            else:
                kc, vc = kv_cache.gather(layer, ids)  # [ctx, KVH, D]
            o = F.scaled_dot_product_attention(
                qc, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=cached == 0, scale=scale, enable_gqa=True,
            )  # [1, H, n, D]
            outs.append(o[0].transpose(0, 1).reshape(n, num_heads * head_dim))
        if len(outs) == 1:
            return outs[0]
        return torch.cat(outs)


class ReferenceOps(OpTable):
    """Eager torch, HF's exact op order (so fp32 greedy equals HF token for token)."""

    name = "reference"

    def __init__(self) -> None:
        self.attention = GatherSDPAAttention()

    def linear_into(self, x, handle, out):
        if not isinstance(handle, tuple):
            return super().linear_into(x, handle, out)
        weight, bias = handle
        if bias is None and out.dtype == x.dtype:
            return torch.mm(x, weight[: out.shape[1]].t(), out=out)
        return super().linear_into(x, handle, out)

    def rms_norm(self, x, weight, eps):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def apply_rotary(self, q, k, cos, sin):
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x):
        i = x.shape[-1] // 2
        return F.silu(x[:, :i]) * x[:, i:]

    def fused_moe(self, x, router_logits, experts: MoEWeights, top_k, renormalize):
        """HF's expert loop: each hit expert in ascending order adds its tokens' weighted outputs
        into a zero sum (index_add_), widening a narrower expert's weights as it reads them; int8
        experts (Int8MoEWeights) compute their format's arithmetic (reference_linear)."""
        weights, ids = route_tokens(router_logits, top_k, renormalize)  # [T, k] each
        out = torch.zeros_like(x)
        local = ids - experts.first_expert  # [T, k]: this rank's index of each chosen expert
        held = (local >= 0) & (local < experts.num_local)
        quantized = isinstance(experts, Int8MoEWeights)
        for e in torch.unique(local[held]).tolist():
            token, slot = torch.where(local == e)
            if quantized:  # the W8A8 linears' arithmetic, each expert's activations quantized per token
                h = reference_linear(self.silu_and_mul(reference_linear(x[token], experts.gate_up(e))),
                                     experts.down(e))
            else:
                h = self.linear(x[token], (experts.w13[e].to(x.dtype), None))  # [n, 2I]
                h = self.linear(self.silu_and_mul(h), (experts.w2[e].to(x.dtype), None))  # [n, hidden]
            out.index_add_(0, token, h * weights[token, slot, None])
        return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
