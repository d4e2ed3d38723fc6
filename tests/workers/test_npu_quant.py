"""The NPU table's quantized linears (workers/quant) on the CPU, through the torch_npu emulation,
against the formats' reference arithmetic (workers/quant/weights.py: reference_linear).

Seeded weights of each scheme (W8A8 dynamic, W8A8 static as msmodelslim writes it, W4A16 AWQ),
alone and fused as q/k/v are, at 1, 3, 17 and 64 rows, bfloat16 and float16, with and without a
bias. Tolerance: the largest difference at most `eps` x the largest |reference output|, eps two
units in the last place of the output dtype (2^-6 bfloat16, 2^-9 float16) where the NPU does the
reference's arithmetic up to the output's rounding (the output rounded, then the bias added and
rounded again, where the reference rounds once; and the order of fp32 sums); a static weight
with an arbitrary calibrated input_scale gets 2^-5, as the NPU takes 1/input_scale rounded to the
activations' dtype (as vllm-ascend does), which moves some activation codes by one step."""

from __future__ import annotations

import pytest
import torch

from tests.workers import npu_emulation
from workers.ops.npu import NpuOpTable, torch_npu
from workers.quant.weights import Int4Weight, Int8Weight, fuse, quantize_int8, reference_linear

pytestmark = pytest.mark.npu_emulated

ULP = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}  # two units in the last place
ROWS = (1, 3, 17, 64)
DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture
def emu(monkeypatch):
    return npu_emulation.install(monkeypatch)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dynamic_weight(out: int, inp: int, seed: int) -> Int8Weight:
    return quantize_int8(torch.randn(out, inp, generator=_gen(seed)) * 0.05)


def static_weight(out: int, inp: int, seed: int, input_scale: float, input_offset: int) -> Int8Weight:
    """msmodelslim's W8A8: per-channel int8 weights, the activations' asymmetric per-tensor scale and
    offset, quant_bias = -offset * sum(q) per channel, deq_scale = input_scale * weight scale."""
    g = _gen(seed)
    w = quantize_int8(torch.randn(out, inp, generator=g) * 0.05)
    scale = w.scale.half().float()  # 10-bit mantissas: deq_scale survives npu_trans_quant_param exactly
    quant_bias = (-input_offset * w.qweight.to(torch.int32).sum(dim=1)).to(torch.int32)
    return Int8Weight(w.qweight, scale, dynamic=False, input_scale=input_scale, input_offset=input_offset,
                      quant_bias=quant_bias, deq_scale=(scale * input_scale).float())


def int4_weight(out: int, inp: int, group: int, seed: int) -> Int4Weight:
    g = _gen(seed)
    q = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (out, inp // group), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, inp // group, generator=g) * 0.02 + 0.005).half().float()  # AWQ's are fp16
    return Int4Weight(q, scales, zeros, group)


def _inputs(rows: int, inp: int, dtype: torch.dtype, seed: int, bias_out: int | None):
    g = _gen(seed + 1000)
    x = torch.randn(rows, inp, generator=g).to(dtype)
    bias = None if bias_out is None else (torch.randn(bias_out, generator=g) * 0.1).to(dtype)
    return x, bias


def _check(weight, rows: int, dtype: torch.dtype, bias: bool, seed: int, eps: float | None = None):
    x, b = _inputs(rows, weight.in_features, dtype, seed, weight.out_features if bias else None)
    want = reference_linear(x, weight, b)  # before the table lays the weight out: it must not change it
    table = NpuOpTable()
    handle = table.prepare_quantized_linear(weight, b, dtype=dtype)
    got = table.linear(x, handle)
    assert got.shape == want.shape and got.dtype == dtype
    limit = (eps or ULP[dtype]) * want.float().abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= limit, f"max |npu - reference| = {diff:.3g} > {limit:.3g}"
    return table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_dynamic_matches_reference(emu, dtype, rows, bias):
    _check(dynamic_weight(96, 128, seed=rows), rows, dtype, bias, seed=rows)
    assert emu.calls == ["npu_dynamic_quant", "npu_quant_matmul"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_static_matches_reference(emu, dtype, rows, bias):
    """A power-of-two input_scale: 1/input_scale is exact in either dtype, so the codes are the reference's."""
    _check(static_weight(96, 128, seed=rows, input_scale=2 ** -5, input_offset=3), rows, dtype, bias, seed=rows)
    calls = ["npu_quantize", "npu_quant_matmul"]
    assert emu.calls == (["npu_trans_quant_param"] if dtype == torch.float16 else []) + calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 17, 64))
def test_w8a8_static_with_a_calibrated_scale(emu, dtype, rows):
    lo, hi = -3.1, 2.7  # a calibrated input range, msmodelslim's asymmetric scale and offset
    scale = (hi - lo) / 255
    _check(static_weight(64, 256, seed=rows + 5, input_scale=scale, input_offset=round(-128 - lo / scale)),
           rows, dtype, True, seed=rows, eps=2 ** -5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 64, 128, 256])  # 256 of 256 inputs: one group, the per-channel case
@pytest.mark.parametrize("bias", [False, True])
def test_w4a16_matches_reference(emu, dtype, rows, group, bias):
    table = _check(int4_weight(48, 256, group, seed=group + rows), rows, dtype, bias, seed=rows)
    assert table.describe()["quantized"] == "w4a16:npu_weight_quant_batchmatmul"
    assert emu.calls == ["npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul"]


def test_w4a16_groups_the_op_refuses_run_the_reference(emu):
    w = int4_weight(16, 64, 16, seed=1)  # groups of 16: npu_weight_quant_batchmatmul takes multiples of 32
    x, _ = _inputs(5, 64, torch.bfloat16, 1, None)
    table = NpuOpTable()
    got = table.linear(x, table.prepare_quantized_linear(w, None, dtype=torch.bfloat16))
    assert torch.equal(got, reference_linear(x, w)) and not emu.calls
    assert table.describe()["quantized"] == "w4a16:reference"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 17))
def test_fused_linears_match_reference(emu, dtype, rows):
    """q/k/v and gate/up are fused along out before the table sees them."""
    _check(fuse([dynamic_weight(n, 128, seed=n) for n in (64, 32, 32)]), rows, dtype, True, seed=rows)
    _check(fuse([static_weight(n, 128, seed=n, input_scale=2 ** -4, input_offset=-2) for n in (64, 64)]),
           rows, dtype, False, seed=rows)
    _check(fuse([int4_weight(n, 128, 64, seed=n) for n in (64, 16, 16)]), rows, dtype, True, seed=rows)


def test_describe_names_each_path(emu):
    table = NpuOpTable()
    assert "quantized" not in table.describe()
    table.prepare_quantized_linear(dynamic_weight(32, 64, seed=0), dtype=torch.bfloat16)
    table.prepare_quantized_linear(static_weight(32, 64, seed=0, input_scale=0.1, input_offset=0),
                                   dtype=torch.bfloat16)
    table.prepare_quantized_linear(int4_weight(32, 64, 32, seed=0), dtype=torch.bfloat16)
    assert table.describe()["quantized"] == ("w4a16:npu_weight_quant_batchmatmul,w8a8-dynamic:npu_quant_matmul,"
                                             "w8a8-static:npu_quant_matmul")


def test_the_int8_weight_is_held_once_and_unchanged(emu):
    w = dynamic_weight(32, 64, seed=3)
    before = w.qweight.clone()
    table = NpuOpTable()
    table.prepare_quantized_linear(w, dtype=torch.bfloat16)
    ptr = w.qweight.data_ptr()
    table.prepare_quantized_linear(w, dtype=torch.bfloat16)  # a second table or call copies nothing more
    assert torch.equal(w.qweight, before) and w.qweight.data_ptr() == ptr


def test_another_activation_dtype_than_prepared_still_matches(emu):
    """Scales kept in the activations' dtype are made once more for a dtype a call brings."""
    w = static_weight(32, 64, seed=4, input_scale=2 ** -5, input_offset=1)
    table = NpuOpTable()
    handle = table.prepare_quantized_linear(w, dtype=torch.bfloat16)
    x, _ = _inputs(4, 64, torch.float16, 4, None)
    want = reference_linear(x, w)
    assert (table.linear(x, handle).float() - want.float()).abs().max() <= ULP[torch.float16] * want.abs().max()


def test_float32_activations_are_refused(emu):
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        NpuOpTable().prepare_quantized_linear(dynamic_weight(8, 32, seed=0), dtype=torch.float32)
    table = NpuOpTable()
    handle = table.prepare_quantized_linear(int4_weight(8, 64, 32, seed=0))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        table.linear(torch.randn(2, 64), handle)


def test_the_emulated_ops_follow_their_documented_layouts(emu):
    npu = torch_npu()
    packed = npu.npu_convert_weight_to_int4pack(torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8]], dtype=torch.int32))
    assert packed.tolist() == [[0x87654321 - 2 ** 32]]  # element j in bits 4j..4j+3
    assert npu.npu_trans_quant_param(torch.tensor([1.0, 1.0 + 2 ** -20])).tolist() == [0x3F800000 | 1 << 46] * 2
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, 300.0, -300.0]], dtype=torch.bfloat16)
    ones = torch.ones(6, dtype=torch.bfloat16)
    assert npu.npu_quantize(x, ones, None, torch.qint8, -1, False).tolist() == [[0, 2, 2, 0, 127, -128]]
    q, s = npu.npu_dynamic_quant(torch.tensor([[1.0, -2.0], [0.0, 0.0]], dtype=torch.float16))
    assert q.tolist() == [[64, -127], [0, 0]] and torch.equal(s, torch.tensor([2 / 127, 0.0]))  # fp32


def test_the_emulated_ops_refuse_what_the_real_ones_refuse(emu):
    npu = torch_npu()
    xq = torch.ones(2, 32, dtype=torch.int8)
    w = torch.ones(32, 16, dtype=torch.int8)
    with pytest.raises(npu_emulation.EmulationError, match="int64"):  # float16 out, no per-token scales
        npu.npu_quant_matmul(xq, w, torch.ones(16), output_dtype=torch.float16)
    with pytest.raises(npu_emulation.EmulationError, match="x2 is"):
        npu.npu_quant_matmul(xq, w.t().contiguous(), torch.ones(16), output_dtype=torch.bfloat16)
    with pytest.raises(npu_emulation.EmulationError, match="dtype"):  # scales in fp32 for bf16 input
        npu.npu_quantize(torch.ones(2, 32, dtype=torch.bfloat16), torch.ones(32), None, torch.qint8, -1, False)
    with pytest.raises(npu_emulation.EmulationError, match="antiquant_group_size"):
        npu.npu_weight_quant_batchmatmul(torch.ones(2, 64, dtype=torch.float16),
                                         torch.zeros(64, 1, dtype=torch.int32),
                                         torch.ones(1, 8, dtype=torch.float16), antiquant_group_size=64)
    with pytest.raises(npu_emulation.EmulationError, match="int4"):
        npu.npu_convert_weight_to_int4pack(torch.full((1, 8), 8, dtype=torch.int32))
