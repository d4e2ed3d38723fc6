"""Attention over the paged KV cache for a flat batch of decode rows and prefill chunks.

The flat batch puts all decode rows first (one token each), then each prefill chunk's
tokens. AttentionMetadata is built once per step and shared by every layer:
- decode rows are answered by one SDPA call: their blocks are gathered through a padded
  [D, max_blocks] block table and a key mask hides each row's padding;
- a prefill chunk that starts at position 0 attends causally within itself (no gather);
  one that starts after cached tokens gathers its blocks and uses an offset-causal mask
  (SDPA's is_causal aligns top-left, which is wrong when q_len < kv_len).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workers.kv_cache import KVCache


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    num_tokens: int
    num_cached: int  # tokens of the request already in the cache before this chunk
    block_ids: torch.Tensor | None = None  # [n] blocks covering num_cached + num_tokens; None if num_cached == 0
    mask: torch.Tensor | None = None  # [num_tokens, n * block_size] bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64, padded with block 0
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool; None: no padding
    prefills: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def build(cls, *, slot_mapping: torch.Tensor, block_size: int,
              decode_block_tables: torch.Tensor | None = None, decode_context_lens: torch.Tensor | None = None,
              decode_padded: bool = True, prefills: list[PrefillChunk] = ()) -> AttentionMetadata:
        """decode_context_lens [D]: keys each decode row sees (its position + 1).

        decode_padded False promises that every row's context fills its block table
        exactly, so no mask is needed."""
        meta = cls(slot_mapping=slot_mapping, prefills=list(prefills))
        if decode_block_tables is not None and decode_block_tables.shape[0]:
            meta.num_decode = decode_block_tables.shape[0]
            meta.decode_block_tables = decode_block_tables
            if decode_padded:
                n = decode_block_tables.shape[1] * block_size
                keys = torch.arange(n, device=slot_mapping.device)
                meta.decode_mask = (keys[None, :] < decode_context_lens[:, None])[:, None, None, :]
        for chunk in meta.prefills:
            if chunk.num_cached and chunk.mask is None and chunk.block_ids is not None:
                n = chunk.block_ids.shape[0] * block_size
                keys = torch.arange(n, device=slot_mapping.device)
                queries = torch.arange(chunk.num_cached, chunk.num_cached + chunk.num_tokens,
                                       device=slot_mapping.device)
                chunk.mask = keys[None, :] <= queries[:, None]
        return meta


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                    attn: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D], this step's k/v [T, KVH, D] (already written to the cache) -> [T, H * D]."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5
    outs = []
    d = attn.num_decode
    if d:
        keys, values = kv_cache.gather(layer, attn.decode_block_tables)  # [D, n, KVH, D]
        # one query per row: fold the query heads of a KV group into the query-length axis
        qd = q[:d].view(d, num_kv_heads, group, head_dim)  # [D, KVH, group, D]
        o = F.scaled_dot_product_attention(qd, keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=attn.decode_mask, scale=scale)  # [D, KVH, group, D]
        outs.append(o.reshape(d, num_heads * head_dim))
    for chunk in attn.prefills:
        s, n = chunk.start, chunk.num_tokens
        qc = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.num_cached == 0:
            kc, vc = k[s:s + n], v[s:s + n]  # [n, KVH, D]
        else:
            kc, vc = kv_cache.gather(layer, chunk.block_ids)  # [ctx, KVH, D]
        o = F.scaled_dot_product_attention(
            qc, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.num_cached == 0, scale=scale, enable_gqa=True,
        )  # [1, H, n, D]
        outs.append(o[0].transpose(0, 1).reshape(n, num_heads * head_dim))
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs)
