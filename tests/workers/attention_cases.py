"""Seeded mixed attention batches over a paged KV cache, and the reference answer.

A case is `num_decode` decode rows followed by prefill chunks, each chunk with a cached
prefix (possibly empty); every sequence gets distinct, shuffled blocks. `reference_run`
answers a case with the reference table (itself tested against dense attention in
tests/test_ops.py), in float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from workers.kv_cache import KVCache
from workers.ops.base import AttentionMetadata
from workers.ops.reference import ReferenceOps

# (decode row context lengths, prefill chunks as (cached, new))
MIXED_BATCHES = [
    ([5, 1, 40], [(0, 7), (13, 9), (32, 1)]),  # decode + fresh prompt + cached-prefix chunks
    ([], [(0, 33)]),  # one fresh prompt
    ([129, 3, 64, 200], []),  # decode only, contexts across block boundaries
    ([17], [(127, 2), (0, 130), (256, 40)]),  # chunks straddling blocks of 128
]


@dataclass
class Case:
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    cache: KVCache  # cached prefixes filled in, this step's tokens not yet written


def make_case(*, seed: int, block_size: int, decode_lens: list[int], chunks: list[tuple[int, int]],
              heads: int = 4, kv_heads: int = 2, head_dim: int = 32, dtype=torch.bfloat16,
              spare_blocks: int = 3) -> Case:
    """decode_lens: keys each decode row sees (cached + itself); chunks: (cached, new) tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(n - 1, 1) for n in decode_lens] + list(chunks)  # (cached, new) per sequence
    need = [(c + n + block_size - 1) // block_size for c, n in seqs]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = KVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype=dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(dtype))  # cached prefixes and junk elsewhere
    max_blocks = max(need)
    tables, slots, used = [], [], 0
    for (cached, new), n in zip(seqs, need):
        row = order[used:used + n]
        used += n
        tables.append(row + [0] * (max_blocks - n))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    q_lens = [new for _, new in seqs]
    kv_lens = [c + n for c, n in seqs]
    t = sum(q_lens)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        num_tokens=t, num_decode=len(decode_lens), block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_host=q_lens, seq_lens_host=kv_lens)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return Case(meta=meta, q=rand(t, heads, head_dim), k=rand(t, kv_heads, head_dim), v=rand(t, kv_heads, head_dim),
                cache=cache)


def clone_cache(cache: KVCache, dtype: torch.dtype | None = None) -> KVCache:
    c = KVCache(num_layers=cache.num_layers, num_blocks=cache.num_blocks, block_size=cache.block_size,
                num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, dtype=dtype or cache.data.dtype,
                device=cache.data.device)
    c.data.copy_(cache.data)
    return c


def reference_run(case: Case) -> tuple[torch.Tensor, KVCache]:
    """The reference table's attention (workers/ops/reference.py) on copies: K/V written in the
    case's dtype (the cache to compare with), attention computed in float32 -> [T, H * D]."""
    ref = ReferenceOps().attention
    cache = clone_cache(case.cache)
    ref.write_kv(cache, 0, case.k, case.v, dataclasses.replace(case.meta, extra={}))
    meta = ref.prepare(dataclasses.replace(case.meta, extra={}))
    out = ref.forward(case.q.float(), case.k.float(), case.v.float(), clone_cache(cache, torch.float32), 0, meta)
    return out, cache
