"""The NPU op table on the CPU, through the torch_npu emulation, against the reference.

Seeded mixed batches (decode rows + prefill chunks with cached prefixes, GQA) at several
block sizes; the elementwise ops against the contract's plain-torch definitions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.workers import npu_emulation
from tests.workers.attention_cases import MIXED_BATCHES as BATCHES
from tests.workers.attention_cases import clone_cache, make_case, reference_run
from workers.block_sizes import DEFAULT_NPU_BLOCK_SIZE, check_npu_block_size, default_block_size
from workers.ops.npu import NpuAttentionBackend, NpuOpTable

pytestmark = pytest.mark.npu_emulated


@pytest.fixture
def emu(monkeypatch):
    return npu_emulation.install(monkeypatch)


def _run_backend(backend, case):
    cache = clone_cache(case.cache)
    meta = backend.prepare(case.meta)
    backend.write_kv(cache, 0, case.k, case.v, meta)
    return backend.forward(case.q, case.k, case.v, cache, 0, meta), cache


CASES = [(b, bs, 4, 2) for b in range(len(BATCHES)) for bs in (16, 64, 128)]  # GQA groups of 2
CASES += [(0, 16, 8, 1), (3, 128, 8, 1), (0, 128, 2, 2), (2, 16, 2, 2)]  # one KV head; no grouping


@pytest.mark.parametrize("batch,block_size,heads,kv_heads", CASES)
def test_attention_matches_reference(emu, block_size, batch, heads, kv_heads):
    decode, chunks = BATCHES[batch]
    case = make_case(seed=batch * 31 + block_size, block_size=block_size, decode_lens=decode, chunks=chunks,
                     heads=heads, kv_heads=kv_heads)
    out, cache = _run_backend(NpuAttentionBackend(), case)
    want, want_cache = reference_run(case)
    assert out.shape == (case.meta.num_tokens, heads * 32)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(cache.data, want_cache.data)  # every token landed in its slot, nothing else moved
    assert emu.calls.count("npu_fused_infer_attention_score") == 1  # one call answers the whole mixed batch


def test_fp16_matches_reference(emu):
    case = make_case(seed=3, block_size=128, decode_lens=[9, 300], chunks=[(100, 50)], dtype=torch.float16)
    out, _ = _run_backend(NpuAttentionBackend(), case)
    torch.testing.assert_close(out.float(), reference_run(case)[0], atol=5e-3, rtol=5e-3)


def test_kv_write_falls_back_to_reshape_and_cache(monkeypatch):
    emu = npu_emulation.install(monkeypatch, without=("npu_scatter_pa_kv_cache",))
    case = make_case(seed=5, block_size=16, decode_lens=[4], chunks=[(3, 5)])
    out, cache = _run_backend(NpuAttentionBackend(), case)
    want, want_cache = reference_run(case)
    assert "_npu_reshape_and_cache" in emu.calls
    assert torch.equal(cache.data, want_cache.data)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_emulation_refuses_a_wrong_layout(emu):
    """The emulation is strict: per-sequence query lengths instead of cumulative ends fail."""
    case = make_case(seed=1, block_size=16, decode_lens=[], chunks=[(0, 3), (0, 4)])
    backend = NpuAttentionBackend()
    meta = backend.prepare(case.meta)
    meta.extra["npu_q_ends"] = list(meta.query_lens_host)  # [3, 4], not [3, 7]
    with pytest.raises(npu_emulation.EmulationError, match="cumulative"):
        backend.forward(case.q, case.k, case.v, clone_cache(case.cache), 0, meta)


@pytest.mark.parametrize("bad", [8, 24, 256, 0, 16.0])
def test_block_sizes_the_kernels_refuse(bad):
    with pytest.raises(ValueError, match="block_size"):
        check_npu_block_size(bad)


def test_the_npu_default_block_size_is_one_the_kernels_take():
    assert default_block_size("npu") == DEFAULT_NPU_BLOCK_SIZE == check_npu_block_size(DEFAULT_NPU_BLOCK_SIZE)
    assert default_block_size("cuda") == default_block_size("cpu") == 16


def test_float32_is_refused_with_a_clear_error(emu):
    case = make_case(seed=2, block_size=16, decode_lens=[3], chunks=[], dtype=torch.float32)
    backend = NpuAttentionBackend()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        backend.forward(case.q, case.k, case.v, case.cache, 0, backend.prepare(case.meta))


def test_the_table_needs_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # as where torch-npu is not installed
    with pytest.raises(ImportError):
        NpuOpTable()


def test_importing_the_module_does_not_import_torch_npu():
    code = "import sys, workers.ops.npu, workers.graphs; sys.exit('torch_npu' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2]).returncode == 0


def _elementwise_inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g).to(dtype)
    return g, x, torch.randn(7, 64, generator=g).to(dtype), (torch.rand(64, generator=g) + 0.5).to(dtype)


def test_rms_norms_match_the_definition(emu):
    _, x, r, w = _elementwise_inputs()
    table = NpuOpTable()
    h = x.float()
    want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
    torch.testing.assert_close(table.rms_norm(x, w, 1e-6), want, atol=2e-2, rtol=2e-2)
    y, s = table.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r)  # the residual sum in x.dtype, as HF adds
    torch.testing.assert_close(y, table.rms_norm(x + r, w, 1e-6), atol=0, rtol=0)
    assert {"npu_rms_norm", "npu_add_rms_norm"} <= set(emu.calls)


def test_rotary_and_swiglu_match_the_definition(emu):
    g, x, _, _ = _elementwise_inputs(torch.float16)
    table = NpuOpTable()
    q = torch.randn(5, 4, 32, generator=g).half()
    k = torch.randn(5, 2, 32, generator=g).half()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    cos, sin = table.rotary_cos_sin(torch.tensor([0, 3, 7, 8, 100]), inv_freq, torch.float16)

    def rope(t):  # rotate-half, as HF
        rot = torch.cat((-t[..., 16:], t[..., :16]), dim=-1)
        return (t.float() * cos[:, None].float() + rot.float() * sin[:, None].float()).half()

    rq, rk = table.apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(rq, rope(q), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(rk, rope(k), atol=2e-3, rtol=2e-3)
    want = torch.nn.functional.silu(x[:, :32].float()) * x[:, 32:].float()
    torch.testing.assert_close(table.silu_and_mul(x).float(), want, atol=2e-3, rtol=2e-3)
    assert emu.calls.count("npu_rotary_mul") == 2 and "npu_swiglu" in emu.calls
