"""The CUDA op table: FlashInfer's wrappers through their emulation on the CPU, the SDPA
fallback (no FlashInfer, or float32) on the CPU, and the real thing where a GPU is present
(marked `cuda`). Every path against the reference on the same seeded mixed batches."""

from __future__ import annotations

import pytest
import torch

from tests.workers import flashinfer_emulation
from tests.workers.attention_cases import MIXED_BATCHES, clone_cache, make_case, reference_run
from workers.ops.cuda import CudaAttentionBackend, flashinfer

CASES = [(0, 16), (1, 128), (2, 16), (3, 128), (0, 1), (3, 5)]  # (batch, block size): FlashInfer takes any


def _check(backend, case, tol=2e-2):
    cache = clone_cache(case.cache)
    meta = backend.prepare(case.meta)
    backend.write_kv(cache, 0, case.k, case.v, meta)
    out = backend.forward(case.q, case.k, case.v, cache, 0, meta)
    want, want_cache = reference_run(case)
    assert torch.equal(cache.data, want_cache.data)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    return meta


@pytest.mark.parametrize("batch,block_size", CASES)
def test_flashinfer_path_matches_reference(monkeypatch, batch, block_size):
    flashinfer_emulation.install(monkeypatch)
    decode, chunks = MIXED_BATCHES[batch]
    case = make_case(seed=batch + block_size, block_size=block_size, decode_lens=decode, chunks=chunks)
    meta = _check(CudaAttentionBackend(), case)
    kind = "BatchDecode" if not chunks else "BatchPrefill"
    assert type(meta.extra["fi_wrapper"]).__name__.startswith(kind)  # decode-only steps take the decode kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,block_size", CASES[::3])
def test_sdpa_fallback_matches_reference(monkeypatch, batch, block_size, dtype):
    flashinfer_emulation.uninstall(monkeypatch)
    decode, chunks = MIXED_BATCHES[batch]
    case = make_case(seed=batch * 7 + block_size, block_size=block_size, decode_lens=decode, chunks=chunks,
                     heads=8, kv_heads=2, dtype=dtype)
    backend = CudaAttentionBackend()
    assert not backend.supports_graphs
    _check(backend, case, tol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_float32_falls_back_even_with_flashinfer(monkeypatch):
    flashinfer_emulation.install(monkeypatch)  # the emulation refuses float32, as FlashInfer does
    case = make_case(seed=11, block_size=16, decode_lens=[3, 20], chunks=[(5, 6)], dtype=torch.float32)
    meta = _check(CudaAttentionBackend(), case, tol=1e-5)
    assert "fi_wrapper" not in meta.extra


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or flashinfer() is None, reason="needs a CUDA GPU and FlashInfer")
@pytest.mark.parametrize("batch,block_size", CASES)
def test_real_flashinfer_matches_reference(batch, block_size):
    import dataclasses

    decode, chunks = MIXED_BATCHES[batch]
    case = make_case(seed=batch, block_size=block_size, decode_lens=decode, chunks=chunks, head_dim=128)
    want, want_cache = reference_run(case)
    cache = clone_cache(case.cache)
    cache.data = cache.data.cuda()
    meta = dataclasses.replace(case.meta, extra={}, **{f: getattr(case.meta, f).cuda() for f in (
        "slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    backend = CudaAttentionBackend()
    q, k, v = case.q.cuda(), case.k.cuda(), case.v.cuda()
    meta = backend.prepare(meta)
    backend.write_kv(cache, 0, k, v, meta)
    out = backend.forward(q, k, v, cache, 0, meta)
    assert torch.equal(cache.data.cpu(), want_cache.data)
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
