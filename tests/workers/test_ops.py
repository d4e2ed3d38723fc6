"""Every op table against the reference, and the reference's paged attention against dense
attention over each sequence's own keys: seeded random flat batches of decode rows and prefill
chunks with cached prefixes (shared prefix blocks, odd lengths, GQA, padded block tables)."""

from __future__ import annotations

import copy
import os
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from workers.kv_cache import KVCache
from workers.ops import get_op_table
from workers.ops.cpu_attention import KERNEL_CHUNK_TOKENS
from workers.ops.metadata import SequenceRows, build_decode_passes, build_metadata


def available_tables() -> list[str]:
    """The tables that compute on the CPU here (cuda/npu have their own tests, on emulations)."""
    names = []
    for name in ("reference", "cpu"):
        try:
            get_op_table("cpu", name)
        except ImportError:
            continue
        names.append(name)
    return names


TABLES = available_tables()
FAST = [n for n in TABLES if n != "reference"]
# the CPU table's attention backends, each forced (the table's default is one of them); the C++
# one needs a compiler (torch's extension builder calls $CXX, else c++), which these machines have
HAVE_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None
CPU_ATTENTION = ["paged", "paged-portable", "chunked", "gather"] if "cpu" in TABLES else []
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler: raylm's CPU kernel cannot be built")


def random_batch(seed: int, *, block_size: int, num_kv_heads: int = 2, group: int = 3, head_dim: int = 16,
                 num_blocks: int = 96, dtype=torch.float32):
    """A pool with random cached contexts; decode rows first, then chunks (some after a cached
    prefix, one sharing its prefix blocks with another sequence). Returns everything needed to
    run attention and to check it densely."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    num_decode, num_chunks = rng.randint(0, 5), rng.randint(0, 3)
    if num_decode + num_chunks == 0:
        num_decode = 1
    seqs, contexts = [], []  # contexts[i]: (K, V) of the cached tokens, [cached, KVH, D]
    shared = None  # (blocks, K, V) of a full-block prefix a later sequence reuses
    for i in range(num_decode + num_chunks):
        is_decode = i < num_decode
        n = 1 if is_decode else rng.choice([1, 2, block_size - 1, block_size + 1, 2 * block_size + 3])
        cached = rng.randint(1, 4 * block_size + 1) if is_decode else rng.choice([0, 0, block_size, 5, 3 * block_size])
        table = [free.pop() for _ in range((cached + n + block_size - 1) // block_size)]
        k_ctx = torch.randn(cached, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        v_ctx = torch.randn(cached, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        full = cached // block_size
        if shared is not None and full >= len(shared[0]) and i % 2:  # reuse the shared prefix blocks
            nb = len(shared[0])
            table[:nb] = shared[0]
            k_ctx[: nb * block_size], v_ctx[: nb * block_size] = shared[1], shared[2]
        elif shared is None and full:
            shared = (table[:full], k_ctx[: full * block_size], v_ctx[: full * block_size])
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(cached)],
                             dtype=torch.int64)
        for layer in range(2):
            cache.write(layer, k_ctx, v_ctx, slots)
        seqs.append(SequenceRows(cached, n, table))
        contexts.append((k_ctx, v_ctx))
    t = sum(s.num_tokens for s in seqs)
    h = num_kv_heads * group
    q = torch.randn(t, h, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    return cache, seqs, num_decode, contexts, q, k, v


def run_attention(table_name, cache, seqs, num_decode, q, k, v, layer=1, ops=None):
    ops = ops or get_op_table("cpu", table_name)
    meta = ops.attention.prepare(build_metadata(seqs, num_decode=num_decode, block_size=cache.block_size))
    ops.attention.write_kv(cache, layer, k, v, meta)
    return ops.attention.forward(q, k, v, cache, layer, meta)


def dense_attention(seqs, contexts, q, k, v):
    """Each sequence on its own: its cached keys then its new ones, offset-causal, no paging."""
    outs, row = [], 0
    for s, (k_ctx, v_ctx) in zip(seqs, contexts):
        n = s.num_tokens
        keys = torch.cat([k_ctx, k[row:row + n]])  # [cached + n, KVH, D]
        values = torch.cat([v_ctx, v[row:row + n]])
        mask = torch.arange(s.start + n)[None, :] <= torch.arange(s.start, s.start + n)[:, None]
        o = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1), keys.transpose(0, 1),
                                           values.transpose(0, 1), attn_mask=mask, enable_gqa=True)
        outs.append(o.transpose(0, 1).reshape(n, -1))
        row += n
    return torch.cat(outs)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_attention_equals_dense_attention_per_sequence(seed, block_size):
    cache, seqs, d, contexts, q, k, v = random_batch(seed, block_size=block_size)
    out = run_attention("reference", cache, seqs, d, q, k, v)
    torch.testing.assert_close(out, dense_attention(seqs, contexts, q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("block_size", [4, 16])
def test_attention_equals_the_reference(name, seed, block_size):
    cache, seqs, d, _, q, k, v = random_batch(seed, block_size=block_size)
    other = copy.copy(cache)
    other.data = cache.data.clone()
    expected = run_attention("reference", cache, seqs, d, q, k, v)
    out = run_attention(name, other, seqs, d, q, k, v)
    torch.testing.assert_close(other.data, cache.data)  # write_kv put this step's K/V where the reference did
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_paged_backends_write_is_the_pools_and_checks_its_slots(dtype):
    """K/V as the model's fused projection leaves them (views a row of q, k and v wide) and as a
    copy laid out otherwise, written where the pool's own index_copy_ puts them; a slot outside
    the pool is an error naming it, and nothing is written."""
    from workers.ops.cpu_attention import PagedAttention

    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(9, 4 + 2 + 2, 16, generator=gen).to(dtype)  # [T, q + k + v heads, D]
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.tensor([3, 40, 41, 0, 63, 17, 18, 19, 5])
    meta = build_metadata([SequenceRows(0, 9, [0, 1, 2, 3])], num_decode=0, block_size=16)
    meta.slot_mapping = slots
    for kk, vv in ((k, v), (k.transpose(1, 2).contiguous().transpose(1, 2), v)):  # the second: heads strided
        mine = KVCache(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=16, dtype=dtype)
        want = KVCache(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=16, dtype=dtype)
        PagedAttention().write_kv(mine, 1, kk, vv, meta)
        want.write(1, kk, vv, slots)
        assert torch.equal(mine.data, want.data)
    meta.slot_mapping = torch.tensor([3, 64, 0, 0, 0, 0, 0, 0, 0])
    cache = KVCache(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=16, dtype=dtype)
    with pytest.raises(RuntimeError, match="slot 64 of token 1 is outside the pool's 64 slots"):
        PagedAttention().write_kv(cache, 0, k, v, meta)
    assert not cache.data.any()


@pytest.mark.parametrize("backend", [pytest.param(b, marks=needs_cxx) if b.startswith("paged") else b
                                     for b in CPU_ATTENTION])
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("block_size", [4, 16])
def test_each_cpu_attention_backend_equals_the_reference(backend, seed, block_size, monkeypatch):
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", backend)
    ops = get_op_table("cpu", "cpu")
    assert ops.describe()["attention"] == {"paged": "paged-cpp", "paged-portable": "paged-cpp-portable",
                                           "chunked": "chunked-online-softmax", "gather": "gather-sdpa"}[backend]
    cache, seqs, d, _, q, k, v = random_batch(seed, block_size=block_size)
    other = copy.copy(cache)
    other.data = cache.data.clone()
    expected = run_attention("reference", cache, seqs, d, q, k, v)
    torch.testing.assert_close(run_attention(None, other, seqs, d, q, k, v, ops=ops), expected, atol=1e-5, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("backend", ["paged", "paged-portable"])
@pytest.mark.parametrize("seed", range(3))
def test_paged_cpu_attention_at_qwen3_head_shapes(seed, backend, monkeypatch):
    """Qwen3-0.6B's heads (8 KV heads of 128, 2 query heads each), contexts past several blocks."""
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", backend)
    cache, seqs, d, contexts, q, k, v = random_batch(seed, block_size=16, num_kv_heads=8, group=2, head_dim=128,
                                                     num_blocks=128)
    out = run_attention(None, cache, seqs, d, q, k, v, ops=get_op_table("cpu", "cpu"))
    torch.testing.assert_close(out, dense_attention(seqs, contexts, q, k, v), atol=1e-5, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("backend", ["paged", "paged-portable"])
@pytest.mark.parametrize(("head_dim", "group"), [(8, 1), (24, 2), (40, 3), (64, 4), (12, 2)])
def test_paged_cpu_attention_at_head_sizes_off_the_vector_width(head_dim, group, backend, monkeypatch):
    """Head sizes the vectorized path splits into 32-, 16- and 8-wide pieces (24, 40), a single
    query head per KV head (group 1, an odd one: 3), and one it leaves to the plain loops (12)."""
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", backend)
    cache, seqs, d, contexts, q, k, v = random_batch(7, block_size=16, num_kv_heads=2, group=group,
                                                     head_dim=head_dim)
    out = run_attention(None, cache, seqs, d, q, k, v, ops=get_op_table("cpu", "cpu"))
    torch.testing.assert_close(out, dense_attention(seqs, contexts, q, k, v), atol=1e-5, rtol=1e-5)


def test_without_a_compiler_the_cpu_table_gathers_and_says_why(monkeypatch):
    from workers.ops import cpu_kernels

    monkeypatch.delenv("RAYLM_CPU_ATTENTION", raising=False)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setattr(cpu_kernels, "failure", lambda: "OSError: no c++ here")
    ops = get_op_table("cpu", "cpu")
    assert ops.describe()["attention"] == "gather-sdpa"
    assert ops.describe()["kernels"] == "not built: OSError: no c++ here"
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", "paged")
    with pytest.raises(RuntimeError, match="RAYLM_CPU_ATTENTION=paged, but .* could not be built: OSError: no c"):
        get_op_table("cpu", "cpu")


@needs_cxx
@pytest.mark.parametrize("backend", ["paged", "paged-portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", [0, 1, 3])  # seeds whose batches have decode rows
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(8, 2, 128), (2, 3, 64)], ids=["qwen3", "odd-group"])
def test_paged_cpu_attention_reads_a_half_precision_pool_and_rounds_once(seed, num_kv_heads, group, head_dim, dtype,
                                                                          backend, monkeypatch):
    """A bf16 / fp16 model's pool is read at its width: the rows the kernel attends (decode rows and
    short chunks after a cached prefix) are the fp32 attention over the same half-precision keys
    and values, rounded once to the dtype (within one of its ulps); over all rows (fresh prompts go
    through SDPA in the dtype, as the reference's) no farther from it than the reference. Qwen3's
    heads and an odd group (a query head left over after the kernel's pairs)."""
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", backend)
    ops = get_op_table("cpu", "cpu")
    ops.prepare_linear(torch.zeros(8, 8, dtype=dtype))  # a half-precision model keeps the kernel
    assert ops.describe()["attention"] == {"paged": "paged-cpp", "paged-portable": "paged-cpp-portable"}[backend]
    cache, seqs, d, contexts, q, k, v = random_batch(seed, block_size=16, num_kv_heads=num_kv_heads, group=group,
                                                     head_dim=head_dim, num_blocks=128, dtype=dtype)
    other = copy.copy(cache)
    other.data = cache.data.clone()
    out = run_attention(None, cache, seqs, d, q, k, v, ops=ops)
    assert out.dtype == dtype
    exact = dense_attention(seqs, [(kc.float(), vc.float()) for kc, vc in contexts], q.float(), k.float(), v.float())
    ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
    err = (out.float() - exact).abs()
    by_kernel = torch.cat([torch.full((s.num_tokens,), s.start > 0 and s.num_tokens <= KERNEL_CHUNK_TOKENS)
                           for s in seqs])
    assert (err[by_kernel] <= ulp * exact[by_kernel].abs().clamp_min(2 ** -6)).all()
    reference_err = (run_attention("reference", other, seqs, d, q, k, v).float() - exact).abs()
    assert err.mean() <= reference_err.mean() * 1.05


def test_a_drafters_passes_built_at_once_equal_each_built_alone():
    """build_decode_passes: each pass's metadata as build_metadata makes it, its positions in order;
    a pass of fewer rows (rows near their max_tokens) and a pass crossing a block boundary included."""
    tables = [[3, 9, 4], [7, 1]]
    passes = [[SequenceRows(15, 1, tables[0]), SequenceRows(6, 1, tables[1])],
              [SequenceRows(16, 1, tables[0]), SequenceRows(7, 1, tables[1])],
              [SequenceRows(17, 1, tables[0])]]
    positions, metas = build_decode_passes(passes, block_size=8)
    assert positions.tolist() == [15, 6, 16, 7, 17]
    assert len(metas) == len(passes)
    for seqs, got in zip(passes, metas):
        want = build_metadata(seqs, num_decode=len(seqs), block_size=8)
        assert (got.num_tokens, got.num_decode, got.query_lens_host, got.seq_lens_host) == \
            (want.num_tokens, want.num_decode, want.query_lens_host, want.seq_lens_host)
        for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
    with pytest.raises(ValueError, match="pass 1"):
        build_decode_passes([passes[0], [SequenceRows(3, 2, tables[1])]], block_size=8)


def test_an_unknown_cpu_attention_backend_is_refused(monkeypatch):
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", "flash")
    with pytest.raises(ValueError,
                       match="RAYLM_CPU_ATTENTION must be one of paged, paged-portable, chunked, gather, got 'flash'"):
        get_op_table("cpu", "cpu")


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_elementwise_ops_and_linear_equal_the_reference(name, rows):
    gen = torch.Generator().manual_seed(rows)
    ref, ops = get_op_table("cpu", "reference"), get_op_table("cpu", name)
    x, res = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    w = torch.rand(96, generator=gen) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    for got, want in zip(ops.add_rms_norm(x, res, w, 1e-6), ref.add_rms_norm(x, res, w, 1e-6)):
        torch.testing.assert_close(got, want)
    q, k = torch.randn(rows, 6, 32, generator=gen), torch.randn(rows, 2, 32, generator=gen)
    positions = torch.randint(0, 5000, (rows,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
    cos, sin = ref.rotary_cos_sin(positions, inv_freq, torch.float32)
    for got, want in zip(ops.rotary_cos_sin(positions, inv_freq, torch.float32), (cos, sin)):
        torch.testing.assert_close(got, want)
    for got, want in zip(ops.apply_rotary(q, k, cos, sin), ref.apply_rotary(q, k, cos, sin)):
        torch.testing.assert_close(got, want)
    gu = torch.randn(rows, 2 * 80, generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(gu), ref.silu_and_mul(gu))
    weight, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    for b in (None, bias):
        torch.testing.assert_close(ops.linear(x, ops.prepare_linear(weight, b)),
                                   ref.linear(x, ref.prepare_linear(weight, b)), atol=1e-4, rtol=1e-4)
    out = torch.empty(rows, 150)
    ops.linear_into(x, ops.prepare_linear(weight), out)
    torch.testing.assert_close(out, x @ weight[:150].t(), atol=1e-4, rtol=1e-4)


@needs_cxx
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_fused_cpu_elementwise_kernels_equal_the_reference_on_the_models_views(rows, monkeypatch):
    """The fused kernels read what the model hands them: q and k as strided views of the qkv
    projection, the residual sum, gate/up halves of one tensor; rows past one thread's share."""
    monkeypatch.setenv("RAYLM_CPU_ELEMENTWISE", "fused")
    ops, ref = get_op_table("cpu", "cpu"), get_op_table("cpu", "reference")
    assert ops.describe()["elementwise"] == "fused-cpp"
    gen = torch.Generator().manual_seed(rows)
    h, kvh, d = 4, 2, 64
    qkv = 3 * torch.randn(rows, (h + 2 * kvh) * d, generator=gen)
    q, k = qkv[:, :h * d].reshape(rows, h, d), qkv[:, h * d:(h + kvh) * d].reshape(rows, kvh, d)
    qw, kw = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    cos, sin = ref.rotary_cos_sin(torch.randint(0, 30000, (rows,), generator=gen), inv_freq, torch.float32)
    fused, eager = ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), ref.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    for got, want in zip(fused, eager):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want)
    for got, want in zip(ops.apply_rotary(q, k, cos, sin), ref.apply_rotary(q, k, cos, sin)):  # no norm
        assert got.is_contiguous()
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(ops.rms_norm(q, qw, 1e-6), ref.rms_norm(q, qw, 1e-6))  # [T, H, D] view
    x, res = torch.randn(rows, 256, generator=gen), torch.randn(rows, 256, generator=gen)
    w = torch.rand(256, generator=gen) + 0.5
    for got, want in zip(ops.add_rms_norm(x, res, w, 1e-6), ref.add_rms_norm(x, res, w, 1e-6)):
        torch.testing.assert_close(got, want)
    gu = 20 * torch.randn(rows, 2 * 96, generator=gen)
    gu[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # exp's clamps: silu(-x) -> -0, silu(x) -> x
    torch.testing.assert_close(ops.silu_and_mul(gu), ref.silu_and_mul(gu), atol=1e-30, rtol=1e-6)
    bf, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)  # bf16: the fused kernel, within bf16 rounding
    torch.testing.assert_close(ops.rms_norm(bf, wb, 1e-6), ref.rms_norm(bf, wb, 1e-6))


def test_the_cpu_elementwise_path_is_chosen_by_env_and_refused_when_unknown(monkeypatch):
    from workers.ops import cpu_kernels

    monkeypatch.setenv("RAYLM_CPU_ELEMENTWISE", "eager")
    assert get_op_table("cpu", "cpu").describe()["elementwise"] == "eager"
    monkeypatch.setenv("RAYLM_CPU_ELEMENTWISE", "compiled")
    with pytest.raises(ValueError, match="RAYLM_CPU_ELEMENTWISE must be eager or fused, got 'compiled'"):
        get_op_table("cpu", "cpu")
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setattr(cpu_kernels, "failure", lambda: "OSError: no c++ here")
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", "gather")
    monkeypatch.setenv("RAYLM_CPU_ELEMENTWISE", "fused")
    with pytest.raises(RuntimeError, match="RAYLM_CPU_ELEMENTWISE=fused, but .* could not be built: OSError"):
        get_op_table("cpu", "cpu")
    monkeypatch.delenv("RAYLM_CPU_ELEMENTWISE")
    assert get_op_table("cpu", "cpu").describe()["elementwise"] == "eager"  # no kernels: eager, said


def test_an_unknown_table_name_is_refused():
    with pytest.raises(ValueError, match="ops must be one of .*got 'fast'"):
        get_op_table("cpu", "fast")


def test_the_cpu_gets_the_cpu_table_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("RAYLM_OPS", raising=False)
    assert get_op_table("cpu").name == "cpu"
    monkeypatch.setenv("RAYLM_OPS", "reference")
    assert get_op_table("cpu").name == "reference"
