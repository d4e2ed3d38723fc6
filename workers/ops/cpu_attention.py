"""Paged attention for the CPU op table, chosen by measurement (docs/benchmarks.md).

- "paged" (the default where it builds): raylm's C++ kernel (workers/ops/csrc/paged_attention.cpp,
  built once per machine by workers/ops/cpu_kernels.py) reads every decode row's keys and values
  where they lie in the pool, and a short prefill chunk's after a cached prefix; a chunk with nothing
  cached attends causally over its own new keys through SDPA (a GEMM-shaped problem, no pool
  read). fp32, bf16 or fp16: a half-precision pool is read at its width and widened in registers
  (scores, softmax and sums in fp32, the output rounded once). In bf16 on a CPU with AMX, every
  prefill chunk but the short ones after a prefix goes to raylm's tile kernel instead
  (csrc/prefill_attention.cpp: the chunk's queries against the pool in place, its prefix included,
  faster than SDPA where measured, docs/benchmarks.md); RAYLM_CPU_PREFILL_ATTENTION=sdpa keeps SDPA there.
  Where the build has AVX2 + FMA + F16C and head_dim % 8 == 0 it runs the kernel's vectorized path
  (eight key positions per score reduction, value accumulators in registers);
  "paged-portable" forces the plain loops every other CPU runs (tests hold both to the reference).
- "chunked": decode rows by a block-wise online softmax: a few block-table columns at a time
  (CHUNK_TOKENS keys per row), read from the pool, scored, and folded into running max / sum /
  output, so the working set stays a chunk, never the whole padded context of the batch.
  Prefill chunks: causal SDPA over their own keys when nothing is cached; after a cached prefix,
  the same online softmax over the prefix blocks, merged with causal SDPA-free scoring of the new
  keys.
- "gather": the reference's gather + SDPA (RAYLM_CPU_ATTENTION=gather), also what runs where the
  kernel cannot be built (the reason is in stats()["ops"]["kernels"]).
RAYLM_CPU_ATTENTION overrides the default; "paged" / "paged-portable" then fail loudly if the kernel cannot
be built.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from workers.ops import cpu_kernels
from workers.ops.base import AttentionBackend, AttentionMetadata
from workers.ops.reference import GatherSDPAAttention, gather_chunk

CHUNK_TOKENS = 128  # keys per row per online-softmax step
KERNEL_CHUNK_TOKENS = 16  # a chunk after a cached prefix up to this long goes through the C++ kernel
ENV = "RAYLM_CPU_ATTENTION"
PREFILL_ENV = "RAYLM_CPU_PREFILL_ATTENTION"  # "tiles" (the default where AMX runs) | "sdpa"


def make_cpu_attention() -> AttentionBackend:
    backends = {"paged": PagedAttention, "paged-portable": PortablePagedAttention, "chunked": ChunkedPagedAttention,
                "gather": GatherSDPAAttention}
    name = os.environ.get(ENV)
    if name is not None and name not in backends:
        raise ValueError(f"{ENV} must be one of {', '.join(backends)}, got {name!r}")
    if name is None:
        name = "paged" if cpu_kernels.load() is not None else "gather"
    elif name.startswith("paged") and cpu_kernels.load() is None:
        raise RuntimeError(f"{ENV}={name}, but raylm's CPU kernels could not be built: {cpu_kernels.failure()}")
    return backends[name]()


class PagedAttention(AttentionBackend):
    """torch.ops.raylm.paged_attention over the pool in place, for decode rows and short
    chunks after a cached prefix; a longer chunk after a cached prefix is a GEMM-shaped problem
    (every query against the whole context) that the kernel's per-token dot products run several
    times slower than the gather + SDPA the reference does (KERNEL_CHUNK_TOKENS, measured in
    docs/benchmarks.md), so it takes that path, or, with prefill_tiles (bf16 where AMX runs),
    torch.ops.raylm.prefill_attention with every chunk that would go to SDPA, in one call."""

    name = "paged-cpp"

    def __init__(self, prefill_tiles: bool | None = None) -> None:
        self.kernels = cpu_kernels.load()
        self._attend = self.kernels.paged_attention
        self.prefill_tiles = prefill_tiles_default(self.kernels) if prefill_tiles is None else prefill_tiles
        self.prefill_ran: set[str] = set()  # what prefill chunks went to: "amx-tiles", "sdpa" (stats)

    def describe_prefill(self) -> str:
        """What prefill chunks ran on ("amx-tiles", "sdpa" or both); before any, what they would."""
        if self.prefill_ran:
            return ",".join(sorted(self.prefill_ran))
        return "amx-tiles (bf16), else sdpa" if self.prefill_tiles else "sdpa"

    def write_kv(self, kv_cache, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """The pool's index_copy_ write, one copy a token (torch.ops.raylm.kv_write) where each token's
        heads are contiguous, as the model's projections leave them."""
        if all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v)):
            self.kernels.kv_write(kv_cache.key(layer), kv_cache.value(layer), k, v, meta.slot_mapping)
        else:
            super().write_kv(kv_cache, layer, k, v, meta)

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        d = meta.num_decode
        device = meta.slot_mapping.device
        if d:  # row i of the block table, all seq_lens[i] keys
            meta.extra["decode_rows"] = torch.arange(d, dtype=torch.int32, device=device)
        chunks, tiled = [], []
        for i, start, n, cached in meta.prefill_chunks():
            if self.prefill_tiles and (not cached or n > KERNEL_CHUNK_TOKENS):
                tiled.append((i, start, n, cached))
            else:
                chunks.append(_chunk(meta, i, start, n, cached))
        meta.extra["chunks"], meta.extra["tiled"] = chunks, tiled
        if tiled:  # columns: block table rows, first tokens, new tokens, cached tokens
            meta.extra["tiled_args"] = [torch.tensor(col, dtype=torch.int32, device=device) for col in zip(*tiled)]
        return meta

    def forward(self, q, k, v, kv_cache, layer, meta):
        num_heads, head_dim, scale, out, key, value = _outputs_and_pool(q, kv_cache, layer)
        q = q.contiguous()
        d = meta.num_decode
        if d:
            self._attend(out[:d], q[:d], key, value, meta.block_tables, meta.extra["decode_rows"], meta.seq_lens[:d],
                         scale)
        chunks = meta.extra["chunks"]
        if meta.extra["tiled"]:
            if q.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 128:
                self.kernels.prefill_attention(out, q, key, value, meta.block_tables, *meta.extra["tiled_args"], scale)
                self.prefill_ran.add("amx-tiles")
            else:  # a dtype or head size the tiles do not take: the chunks as without them
                if "untiled" not in meta.extra:
                    meta.extra["untiled"] = [_chunk(meta, *c) for c in meta.extra["tiled"]]
                chunks = chunks + meta.extra["untiled"]
        if any(how != "kernel" for how, *_ in chunks):
            self.prefill_ran.add("sdpa")
        for how, s, n, a, b in chunks:
            if how == "kernel":
                self._attend(out[s:s + n], q[s:s + n], key, value, meta.block_tables, a, b, scale)
                continue
            kc, vc = (k[s:s + n], v[s:s + n]) if how == "own" else kv_cache.gather(layer, a)  # [ctx, KVH, D]
            o = F.scaled_dot_product_attention(
                q[s:s + n].transpose(0, 1).unsqueeze(0), kc.transpose(0, 1).unsqueeze(0),
                vc.transpose(0, 1).unsqueeze(0), attn_mask=b, is_causal=how == "own", scale=scale, enable_gqa=True)
            out[s:s + n] = o[0].transpose(0, 1).reshape(n, num_heads * head_dim)
        return out


def prefill_tiles_default(kernels) -> bool:
    """Whether prefill chunks go to the AMX tile kernel: where it runs, unless RAYLM_CPU_PREFILL_ATTENTION=sdpa."""
    want = os.environ.get(PREFILL_ENV, "tiles")
    if want not in ("tiles", "sdpa"):
        raise ValueError(f"{PREFILL_ENV} must be tiles or sdpa, got {want!r}")
    return want == "tiles" and kernels is not None and bool(kernels.prefill_attention_available())


def _chunk(meta, i, start, n, cached):
    """How a prefill chunk runs without the tiles: SDPA over its own keys ("own"), the decode kernel
    when short after a prefix ("kernel"), else SDPA over the gathered context ("gather")."""
    device = meta.slot_mapping.device
    if not cached:
        return ("own", start, n, None, None)
    if n <= KERNEL_CHUNK_TOKENS:  # query j sits at position cached + j: it sees cached + j + 1 keys
        return ("kernel", start, n, torch.full((n,), i, dtype=torch.int32, device=device),
                torch.arange(cached + 1, cached + n + 1, dtype=torch.int32, device=device))
    return ("gather", start, n, *gather_chunk(meta, i, n, cached))


class PortablePagedAttention(PagedAttention):
    """PagedAttention through the kernel's plain loops only (RAYLM_CPU_ATTENTION=paged-portable)."""

    name = "paged-cpp-portable"

    def __init__(self) -> None:
        super().__init__(prefill_tiles=False)
        self._attend = self.kernels.paged_attention_portable


class ChunkedPagedAttention(AttentionBackend):
    name = "chunked-online-softmax"

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        bs, d = meta.block_size, meta.num_decode
        device = meta.slot_mapping.device
        if d:
            meta.extra["decode_tables"] = meta.decode_block_tables()
            meta.extra["decode_lens"] = meta.seq_lens[:d].to(torch.int64)
        meta.extra["chunks"] = [(start, n, cached, meta.block_tables[i:i + 1, :-(-cached // bs)] if cached else None)
                                for i, start, n, cached in meta.prefill_chunks()]
        meta.extra["key_positions"] = torch.arange(max(CHUNK_TOKENS, bs), device=device)
        return meta

    def forward(self, q, k, v, kv_cache, layer, meta):
        num_heads, head_dim, scale, out, key, value = _outputs_and_pool(q, kv_cache, layer)
        d = meta.num_decode
        if d:
            o, _, _ = _online_softmax(q[:d].unsqueeze(1), key, value, meta.extra["decode_tables"],
                                      meta.extra["decode_lens"], meta.extra["key_positions"], scale)
            out[:d] = o.reshape(d, num_heads * head_dim)
        for s, n, cached, table in meta.extra["chunks"]:
            qc = q[s:s + n]  # [n, H, D]
            if not cached:
                o = F.scaled_dot_product_attention(
                    qc.transpose(0, 1).unsqueeze(0), k[s:s + n].transpose(0, 1).unsqueeze(0),
                    v[s:s + n].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)
                out[s:s + n] = o[0].transpose(0, 1).reshape(n, num_heads * head_dim)
                continue
            # the cached prefix (every query sees all of it), then the chunk's own keys (causal)
            lens = torch.full((1,), cached, dtype=torch.int64, device=q.device)
            o1, m1, l1 = _online_softmax(qc.unsqueeze(0), key, value, table, lens,
                                         meta.extra["key_positions"], scale)  # [1, n, H, D], [1, KVH, n*g, 1]
            o2, m2, l2 = _causal_scores(qc, k[s:s + n], v[s:s + n], scale)
            m = torch.maximum(m1, m2)
            a1, a2 = (m1 - m).exp_() * l1, (m2 - m).exp_() * l2
            o = (_heads_last(o1, a1) + _heads_last(o2, a2)) / _heads_last(None, a1 + a2, o1)
            out[s:s + n] = o.reshape(n, num_heads * head_dim)
        return out


def _outputs_and_pool(q, kv_cache, layer):
    """q [T, H, D] -> (H, D, the softmax scale, an empty output [T, H * D], the layer's pool
    key and value [N, bs, KVH, D])."""
    t, num_heads, head_dim = q.shape
    out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
    return num_heads, head_dim, head_dim ** -0.5, out, kv_cache.key(layer), kv_cache.value(layer)


def _online_softmax(q, key, value, tables, lens, positions, scale):
    """q [R, n, H, D] (R rows, each n queries that see all of the row's keys); tables [R, nb]
    blocks of the pool key/value [N, bs, KVH, D]; lens [R] keys per row ->
    (out [R, n, H, D], running max [R, KVH, g * n, 1], running sum [R, KVH, g * n, 1])."""
    r, n, num_heads, head_dim = q.shape
    _, bs, num_kv_heads, _ = key.shape
    g = num_heads // num_kv_heads
    # [R, KVH, g * n, D]: a KV group's query heads and the row's queries share one matmul
    qg = (q * scale).view(r, n, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(r, num_kv_heads,
                                                                                          g * n, head_dim)
    m = torch.full((r, num_kv_heads, g * n, 1), float("-inf"), dtype=q.dtype, device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(r, num_kv_heads, g * n, head_dim, dtype=q.dtype, device=q.device)
    nb = tables.shape[1]
    step = max(1, CHUNK_TOKENS // bs)
    for c0 in range(0, nb, step):
        ids = tables[:, c0:c0 + step]
        c = ids.shape[1] * bs
        kc = key.index_select(0, ids.reshape(-1)).view(r, c, num_kv_heads, head_dim)
        vc = value.index_select(0, ids.reshape(-1)).view(r, c, num_kv_heads, head_dim)
        s = torch.matmul(qg, kc.permute(0, 2, 3, 1))  # [R, KVH, g*n, c]
        if c0 * bs + c > 0:
            hidden = (positions[:c] + c0 * bs)[None, :] >= lens[:, None]  # [R, c]
            s.masked_fill_(hidden[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = (s - m_new).exp_()
        corr = (m - m_new).exp_()
        denom = denom * corr + p.sum(-1, keepdim=True)
        acc = acc * corr + torch.matmul(p, vc.transpose(1, 2))  # [R, KVH, g*n, D]
        m = m_new
    o = (acc / denom).view(r, num_kv_heads, g, n, head_dim).permute(0, 3, 1, 2, 4).reshape(r, n, num_heads, head_dim)
    return o, m, denom


def _causal_scores(q, k, v, scale):
    """q [n, H, D] against its own k/v [n, KVH, D], causal -> as _online_softmax for R = 1."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    g = num_heads // num_kv_heads
    qg = (q * scale).view(n, num_kv_heads, g, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, g * n, head_dim)
    s = torch.matmul(qg, k.permute(1, 2, 0).unsqueeze(0))  # [1, KVH, g*n, n]
    qpos = torch.arange(n, device=q.device).repeat(g)  # row g_i * n + j is query j
    s.masked_fill_(torch.arange(n, device=q.device)[None, :] > qpos[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = (s - m).exp_()
    denom = p.sum(-1, keepdim=True)
    acc = torch.matmul(p, v.permute(1, 0, 2).unsqueeze(0))  # [1, KVH, g*n, D]
    o = (acc / denom).view(1, num_kv_heads, g, n, head_dim).permute(0, 3, 1, 2, 4).reshape(1, n, num_heads, head_dim)
    return o, m, denom


def _heads_last(o, w, like=None):
    """Weights w [1, KVH, g*n, 1] laid out like an output [1, n, H, D] (times o when given)."""
    ref = o if o is not None else like
    _, n, num_heads, head_dim = ref.shape
    num_kv_heads = w.shape[1]
    g = num_heads // num_kv_heads
    wl = w.view(1, num_kv_heads, g, n, 1).permute(0, 3, 1, 2, 4).reshape(1, n, num_heads, 1)
    return wl * o if o is not None else wl
