"""The AMX-INT8 linear (workers/ops/csrc/amx_int8_linear.cpp): exact int32 sums at the extremes of int8
operands, scaled per channel and per token, a bias added and rounded once to the output's dtype, as torch
computes that from int64 sums; a weight it cannot take (an input size not a multiple of 64) is left to
another path by the CPU table, and forcing it there is a clear error. Runs only where the CPU has AMX-INT8."""

from __future__ import annotations

import pytest
import torch

from tests.workers.int8_cases import check_a_weight_it_cannot_take_runs_elsewhere
from workers.ops import cpu_kernels
from workers.ops.cpu_quant import has_amx_int8

pytestmark = pytest.mark.skipif(not has_amx_int8(),
                                reason="this CPU has no AMX-INT8 (or raylm's kernels did not build)")


def _expected(xq, w, col_scale, row_scale, bias, dtype):
    """The epilogue's arithmetic in torch: int64 sums (exact), then fp32 in the kernel's order."""
    y = (xq.long() @ w.long().t()).float() * col_scale
    if row_scale is not None:
        y = y * row_scale[:, None]
    if bias is not None:
        y = y + bias
    return y.to(dtype)


@pytest.mark.parametrize("n,k", [(16, 64), (70, 256), (301, 1024)])
@pytest.mark.parametrize("threads", [1, 2])
def test_sums_scales_and_rounding_are_torchs(n, k, threads):
    kernels = cpu_kernels.load()
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    w[0] = 127
    w[-1] = -128  # the largest magnitudes, met by -128 and 127 activations below
    col_scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    packed = kernels.amx_int8_pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 5, 16, 17, 33, 64, 300):  # tiles part-filled, past a pair of row blocks
            xq = torch.randint(-128, 128, (m, k + 64), generator=gen, dtype=torch.int8)[:, :k]  # rows by stride
            xq[0] = -128
            xq[-1] = 127
            row_scale = torch.rand(m, generator=gen) + 0.5
            bias = torch.randn(n, generator=gen)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for rs, b in ((None, None), (row_scale, None), (None, bias), (row_scale, bias)):
                    y = torch.full((m, n + 5), 7.0, dtype=dtype)[:, :n]  # inside a wider buffer
                    kernels.amx_int8_linear(y, xq, packed, col_scale, rs, b)
                    assert torch.equal(y, _expected(xq, w, col_scale, rs, b, dtype)), (m, dtype, rs is None, b is None)
            y = torch.full((m, n + 5), 7.0)
            kernels.amx_int8_linear(y[:, :n], xq, packed, col_scale)
            assert (y[:, n:] == 7.0).all()  # nothing written past the columns asked for
    finally:
        torch.set_num_threads(before)


def test_operands_are_checked():
    kernels = cpu_kernels.load()
    w = torch.zeros(32, 128, dtype=torch.int8)
    packed = kernels.amx_int8_pack(w)
    with pytest.raises(RuntimeError, match="a width that is a multiple of 64, got 100"):
        kernels.amx_int8_pack(torch.zeros(8, 100, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="packed for xq's width"):
        kernels.amx_int8_linear(torch.empty(2, 32), torch.zeros(2, 64, dtype=torch.int8), packed, torch.ones(32))
    with pytest.raises(RuntimeError, match="packed by amx_int8_pack"):
        kernels.amx_int8_linear(torch.empty(2, 32), torch.zeros(2, 128, dtype=torch.int8), w, torch.ones(32))
    with pytest.raises(RuntimeError, match="row_scale must be a contiguous float32 vector of at least 2"):
        kernels.amx_int8_linear(torch.empty(2, 32), torch.zeros(2, 128, dtype=torch.int8), packed, torch.ones(32),
                                torch.ones(1))


def test_a_weight_of_other_input_size_runs_elsewhere(monkeypatch):
    check_a_weight_it_cannot_take_runs_elsewhere(monkeypatch, "amx-int8", 96, "its input size is not a multiple of 64")
