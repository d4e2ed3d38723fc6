"""The CUDA table's quantized linears against the formats' reference arithmetic
(workers/quant/weights.py: reference_linear): the W8A8 path (torch._int_mm, which runs on CPU
tensors too) here, with the rows padded as for cuBLAS; W4A16's scales_and_zeros convention
through torch's CPU int4 kernel (the same convention as its CUDA one); the GPU kernels themselves
where a GPU is present (marked `cuda`).

Tolerance: the largest difference at most two units in the last place of the output dtype x the
largest |reference output| (the sums are exact; only the fp32 scaling and the output's rounding
differ from the reference's float64, and the bias is added to the rounded output, then rounded
again, where the reference rounds once)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from tests.workers.test_npu_quant import dynamic_weight, int4_weight, static_weight
from workers.ops.cuda import CudaOpTable, tinygemm_scales_and_zeros
from workers.quant.weights import fuse, reference_linear

ULP = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9, torch.float32: 2 ** -19}  # two units in the last place
ROWS = (1, 3, 16, 17, 64)  # below, at and past _int_mm's 16-row limit
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.float() - want.float()).abs().max().item()
    limit = ULP[want.dtype] * want.float().abs().max().item()
    assert diff <= limit, f"max |cuda table - reference| = {diff:.3g} > {limit:.3g}"


def _on(weight, device: str):
    """The weight with its tensors on `device`."""
    return replace(weight, **{f.name: getattr(weight, f.name).to(device) for f in fields(weight)
                              if isinstance(getattr(weight, f.name), torch.Tensor)})


def _run(weight, rows: int, dtype: torch.dtype, bias: bool, device: str = "cpu"):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, weight.in_features, generator=g).to(dtype)
    b = (torch.randn(weight.out_features, generator=g) * 0.1).to(dtype) if bias else None
    want = reference_linear(x, weight, b)
    table = CudaOpTable()
    handle = table.prepare_quantized_linear(_on(weight, device), None if b is None else b.to(device), dtype=dtype)
    got = table.linear(x.to(device), handle).cpu()
    return table, got, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_int_mm_matches_reference(dtype, rows, bias):
    for w in (dynamic_weight(96, 128, seed=rows),
              static_weight(96, 128, seed=rows, input_scale=0.0231, input_offset=-7),
              fuse([dynamic_weight(n, 64, seed=n) for n in (64, 32, 32)])):
        table, got, want = _run(w, rows, dtype, bias)
        _close(got, want)
        assert table.describe()["quantized"] == f"{w.scheme}:int-mm"


def test_w8a8_shapes_cublas_refuses_run_the_reference():
    w = dynamic_weight(12, 64, seed=0)  # 12 outputs: _int_mm wants multiples of 8
    table, got, want = _run(w, 5, torch.bfloat16, True)
    assert torch.equal(got, want) and table.describe()["quantized"] == "w8a8-dynamic:reference"


def test_w4a16_off_the_gpu_runs_the_reference():
    w = int4_weight(32, 128, 64, seed=0)
    table, got, want = _run(w, 5, torch.bfloat16, False)
    assert torch.equal(got, want) and table.describe()["quantized"] == "w4a16:reference"


@pytest.mark.parametrize("group", [32, 64, 128])
def test_tinygemm_scales_and_zeros_reproduce_awq(group):
    """torch's int4 kernels read scales_and_zeros as w = (q - 8) * scale + zero, on the CPU as on CUDA."""
    w = int4_weight(32, 256, group, seed=group)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(group)).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.qweight.to(torch.int32), 2)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, tinygemm_scales_and_zeros(w, torch.bfloat16))
    want = reference_linear(x, w)
    assert (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()  # bf16 zeros: one rounding


@pytest.mark.cuda
@GPU
@pytest.mark.parametrize("rows", ROWS)
def test_int_mm_on_the_gpu_matches_reference(rows):
    for w in (dynamic_weight(256, 512, seed=rows),
              static_weight(256, 512, seed=rows, input_scale=0.02, input_offset=5)):
        table, got, want = _run(w, rows, torch.bfloat16, True, device="cuda")
        _close(got, want)
        assert table.describe()["quantized"] == f"{w.scheme}:int-mm"


@pytest.mark.cuda
@GPU
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 128])
def test_tinygemm_on_the_gpu_matches_reference(rows, group):
    table, got, want = _run(int4_weight(256, 512, group, seed=rows), rows, torch.bfloat16, True, device="cuda")
    assert table.describe()["quantized"] == "w4a16:tinygemm-int4"
    assert (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()  # bf16 zeros
