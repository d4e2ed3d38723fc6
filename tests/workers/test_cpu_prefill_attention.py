"""raylm's prefill attention on AMX tiles (workers/ops/csrc/prefill_attention.cpp, through the CPU table's
paged backend) against the reference's fp32 attention over the same bf16 pool: fresh prompts and chunks
after a cached prefix, in one step with decode rows, at Qwen3's heads and at other head sizes and groups.
Where the tiles cannot run (no AMX-BF16) only the fallbacks are tested."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.workers.attention_cases import MIXED_BATCHES, clone_cache, make_case, reference_run
from workers.ops import cpu_kernels, get_op_table

KERNELS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="raylm's CPU kernels did not build here")
needs_tiles = pytest.mark.skipif(KERNELS is None or not KERNELS.prefill_attention_available(),
                                 reason="needs AMX-BF16 (a Xeon since Sapphire Rapids)")

# (decode row contexts, prefill chunks as (cached, new)): MIXED_BATCHES, then long prompts and chunks
# after long prefixes beside decode rows, and chunks at the edges of a 16-query tile
BATCHES = MIXED_BATCHES + [([300, 41], [(0, 700), (400, 300), (96, 17)]),
                           ([], [(0, 1), (0, 16), (5, 17), (31, 33)])]
# (query heads, KV heads, head_dim): Qwen3-0.6B's, the tiny model's, a group of 3, no grouping at 96
SHAPES = [(16, 8, 128), (4, 2, 32), (6, 2, 64), (4, 4, 96)]


def attend(backend, case):
    """backend's output for the case's step (K/V written first, as the model does) and the cache after."""
    cache = clone_cache(case.cache)
    meta = backend.prepare(dataclasses.replace(case.meta, extra={}))
    backend.write_kv(cache, 0, case.k, case.v, meta)
    return backend.forward(case.q, case.k, case.v, cache, 0, meta), cache


def backend(tiles: bool):
    from workers.ops.cpu_attention import PagedAttention

    return PagedAttention(prefill_tiles=tiles)


@needs_tiles
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("batch", range(len(BATCHES)))
def test_tiles_equal_the_reference_in_bf16(batch, block_size, shape):
    heads, kv_heads, head_dim = shape
    decode, chunks = BATCHES[batch]
    case = make_case(seed=batch * 31 + block_size, block_size=block_size, decode_lens=decode, chunks=chunks,
                     heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    out, cache = attend(backend(True), case)
    want, want_cache = reference_run(case)
    assert torch.equal(cache.data, want_cache.data)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)  # P and the output rounded to bf16
    if chunks:  # and on the prompt rows, on average no farther from fp32's answer than SDPA in bf16 is
        prompt = slice(len(decode), None)
        sdpa, _ = attend(backend(False), case)
        tiles_err = (out[prompt].float() - want[prompt]).abs().mean()
        assert tiles_err <= (sdpa[prompt].float() - want[prompt]).abs().mean() * 1.1


@needs_tiles
def test_tiles_take_a_prefill_only_step_of_many_chunks_in_one_call():
    """Chunks of every length up to two tiles, each after a different prefix, no decode rows."""
    chunks = [(c, n) for n, c in zip(range(1, 40, 3), range(0, 400, 29))]
    case = make_case(seed=5, block_size=16, decode_lens=[], chunks=chunks, heads=16, kv_heads=8, head_dim=128)
    paged = backend(True)
    assert paged.describe_prefill() == "amx-tiles (bf16), else sdpa"  # nothing has run yet
    out, _ = attend(paged, case)
    torch.testing.assert_close(out.float(), reference_run(case)[0], atol=2e-2, rtol=2e-2)
    assert paged.describe_prefill() == "amx-tiles"


@needs_kernels
@pytest.mark.parametrize("batch", [0, 3, 4])
def test_a_dtype_the_tiles_do_not_take_runs_without_them(batch):
    """fp32 (a model the tiles do not compute) goes the way it would without them, on any CPU."""
    decode, chunks = BATCHES[batch]
    case = make_case(seed=batch, block_size=16, decode_lens=decode, chunks=chunks, dtype=torch.float32)
    paged = backend(True)
    out, cache = attend(paged, case)
    want, want_cache = reference_run(case)
    assert torch.equal(cache.data, want_cache.data)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert paged.describe_prefill() == "sdpa"  # what ran, whatever the tiles would have taken


@needs_tiles
def test_the_op_names_what_it_does_not_take():
    case = make_case(seed=0, block_size=16, decode_lens=[], chunks=[(0, 20)], dtype=torch.float32)
    meta = case.meta
    i32 = lambda *xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    out = torch.empty(20, 4 * 32)
    k, v = case.cache.key(0), case.cache.value(0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNELS.prefill_attention(out, case.q, k, v, meta.block_tables, i32(0), i32(0), i32(20), i32(0), 0.1)
    bf = make_case(seed=0, block_size=16, decode_lens=[], chunks=[(0, 20)], head_dim=16)
    with pytest.raises(RuntimeError, match="head_dim 32, 64, 96 or 128, got 16"):
        KERNELS.prefill_attention(torch.empty(20, 64, dtype=torch.bfloat16), bf.q, bf.cache.key(0), bf.cache.value(0),
                                  bf.meta.block_tables, i32(0), i32(0), i32(20), i32(0), 0.1)
    with pytest.raises(RuntimeError, match="chunk 0 lies outside q or its block table"):
        KERNELS.prefill_attention(torch.empty(20, 128, dtype=torch.bfloat16), case.q.bfloat16(), k.bfloat16(),
                                  v.bfloat16(), meta.block_tables, i32(0), i32(0), i32(21), i32(0), 0.1)


@needs_kernels
def test_the_table_says_which_prefill_attention_runs_and_the_env_chooses(monkeypatch):
    monkeypatch.setenv("RAYLM_CPU_ATTENTION", "paged")
    monkeypatch.setenv("RAYLM_CPU_PREFILL_ATTENTION", "sdpa")
    assert get_op_table("cpu", "cpu").describe()["prefill_attention"] == "sdpa"
    monkeypatch.setenv("RAYLM_CPU_PREFILL_ATTENTION", "tiles")
    tiles = KERNELS.prefill_attention_available()
    assert get_op_table("cpu", "cpu").describe()["prefill_attention"] == ("amx-tiles (bf16), else sdpa" if tiles
                                                                          else "sdpa")
    monkeypatch.setenv("RAYLM_CPU_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="RAYLM_CPU_PREFILL_ATTENTION must be tiles or sdpa, got 'flash'"):
        get_op_table("cpu", "cpu")
