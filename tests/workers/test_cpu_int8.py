"""The AVX2 int8 linear (workers/ops/csrc/int8_linear.cpp): exact int32 sums times the channel scales,
against int64 arithmetic, at the extremes of int8 operands; a weight it cannot take (an odd input
size) is left to another path by the CPU table, and forcing it there is a clear error."""

from __future__ import annotations

import pytest
import torch

from tests.workers.int8_cases import check_a_weight_it_cannot_take_runs_elsewhere
from workers.ops import cpu_kernels
from workers.ops.cpu_quant import has_avx2_int8

pytestmark = pytest.mark.skipif(not has_avx2_int8(), reason="raylm's CPU kernels were not built with AVX2 here")


def _exact(xq: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (xq.long() @ w.long().t()).float().mul_(scale)  # int64 sums: the arithmetic, not another kernel


@pytest.mark.parametrize("rows,k", [(8, 2), (13, 34), (40, 256), (257, 1030)])
@pytest.mark.parametrize("threads", [1, 2])
def test_sums_are_exact_at_every_batch_and_shape(rows, k, threads):
    kernels = cpu_kernels.load()
    gen = torch.Generator().manual_seed(rows * k)
    w = torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8)
    w[0] = 127
    w[-1] = -128  # the largest magnitudes, met by -128 and 127 activations below
    scale = torch.rand(rows, generator=gen) + 0.5
    packed = kernels.int8_linear_pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 3, 4, 5, 17, 70):
            xq = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
            xq[0] = -128
            xq[-1] = 127
            y = torch.full((m, rows + 3), 9.0)[:, :rows]  # rows by stride, inside a wider buffer
            kernels.int8_linear(y, xq, packed, scale)
            assert torch.equal(y, _exact(xq, w, scale)), (m, rows, k)
    finally:
        torch.set_num_threads(before)


def test_a_weight_of_odd_input_size_runs_elsewhere(monkeypatch):
    check_a_weight_it_cannot_take_runs_elsewhere(monkeypatch, "avx2-int8", 63, "its input size is odd")
