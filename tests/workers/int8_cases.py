"""A check the int8 kernels' tests share."""

from __future__ import annotations

import pytest
import torch

from workers.ops import get_op_table
from workers.quant import Int8Weight, reference_linear


def check_a_weight_it_cannot_take_runs_elsewhere(monkeypatch, path: str, in_features: int, why: str) -> None:
    """A (24, in_features) weight int8 path `path` cannot take: the CPU table measures the others and
    computes the format's numbers; forcing `path` is a ValueError naming the weight and `why`."""
    w = torch.randint(-128, 128, (24, in_features), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    weight = Int8Weight(w, torch.full((24,), 0.01))
    x = torch.randn(6, in_features)
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_quantized_linear(weight, None, dtype=torch.float32)
    assert path not in ops.describe()["quantized"]
    torch.testing.assert_close(ops.linear(x, handle), reference_linear(x, weight, None), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("RAYLM_CPU_INT8_GEMM", path)
    message = rf"RAYLM_CPU_INT8_GEMM={path} cannot run a \(24, {in_features}\) weight: {why}"
    with pytest.raises(ValueError, match=message):
        get_op_table("cpu", "cpu").prepare_quantized_linear(weight, None, dtype=torch.float32)
