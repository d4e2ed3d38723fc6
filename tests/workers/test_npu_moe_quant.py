"""The NPU table's int8 MoE (W8A8 dynamic experts, as vllm-ascend runs W8A8_DYNAMIC Qwen3-MoE) on the
CPU, through the torch_npu emulation, against the reference table's fused_moe on the same experts.

Seeded experts, quantized per output channel by `quantize_int8`, over every routing pattern and shape
the float MoE is tested on (tests/workers/moe_cases.py, test_npu_moe.py's SHAPES: 1 to 40 tokens, 8
and 128 experts, top_k 1 / 2 / 8, expert-parallel slices down to one local expert, renormalized or
not), float16 and bfloat16. Plus the torch_npu ops it calls, that prepare holds the int8 values
once, and that the emulated int8 grouped matmul refuses what the real one refuses.

Tolerance: |npu - reference| <= ATOL + RTOL * |reference| per element. Both quantize x per token
identically (fp32 max |x| / 127, round half to even), both round the gate/up output to x's dtype
once, and both requantize silu(gate) * up per token before down. They differ in (1) the epilogues:
the NPU dequantizes in fp32 (with a bfloat16 per-channel scale for bfloat16 outputs, the only
combination the A2/A3 op takes), the reference in float64, so a gate/up or down output may round
to a neighbouring value of x's dtype; (2) SwiGLU, rounded once on the NPU, twice (silu, then the
product) by the reference; (3) the combine, an fp32 weighted sum rounded once on the NPU, the
reference adding each expert's rounded output into a sum rounded at every step (top_k 8: up to 8
roundings; RTOL, two units in the last place of the output dtype, covers these). Through (1) and
(2) an activation of the down projection's input that lands on an int8 rounding boundary takes the
neighbouring code, which moves the outputs by one quantization step times a down weight: about
max |row| / 127 * |w2| ~ 0.01 - 0.03 for these unit-scale activations and 1 / sqrt(fan_in) weights.
ATOL allows about one such step in float16 (2^-5) and a few in bfloat16 (2^-4), whose one-unit
differences are 8x larger against the int8 step and so flip many more codes. Measured worst over
these cases: 0.018 (float16), 0.031 (bfloat16). A wrong layout, scale or routing is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from tests.workers import npu_emulation
from tests.workers.moe_cases import PATTERNS, make_moe_case
from tests.workers.test_npu_moe import SHAPES
from workers.ops.base import Int8MoEWeights
from workers.ops.npu import NpuInt8MoEWeights, NpuOpTable, torch_npu
from workers.ops.reference import ReferenceOps
from workers.quant.weights import quantize_int8

pytestmark = pytest.mark.npu_emulated

INT8_MOE_OPS = ["npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2", "npu_dynamic_quant", "npu_grouped_matmul",
                "npu_swiglu", "npu_dynamic_quant", "npu_grouped_matmul", "npu_moe_token_unpermute"]
ATOL = {torch.float16: 2 ** -5, torch.bfloat16: 2 ** -4}  # about one int8 step of the down input (see above)
RTOL = {torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}  # two units in the last place
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


@pytest.fixture
def emu(monkeypatch):
    return npu_emulation.install(monkeypatch)


def int8_case(*, seed: int, dtype: torch.dtype, **shape):
    """A moe_cases batch whose fp32 experts are quantized W8A8 (per output channel) -> (case, Int8MoEWeights)."""
    case = make_moe_case(seed=seed, dtype=dtype, weight_dtype=torch.float32, **shape)
    w13, w2 = quantize_int8(case.w13), quantize_int8(case.w2)  # [E, 2I, H] / [E, H, I], scales [E, 2I] / [E, H]
    experts = Int8MoEWeights(w13.qweight, w2.qweight, case.first_expert, case.num_experts, w13.scale, w2.scale)
    return case, experts


def reference(case, experts: Int8MoEWeights) -> torch.Tensor:
    return ReferenceOps().fused_moe(case.x, case.router_logits, experts, case.top_k, case.renormalize)


def run_npu(case, experts: Int8MoEWeights, dtype: torch.dtype | None = None) -> torch.Tensor:
    table = NpuOpTable()
    handle = table.prepare_quantized_moe(experts, dtype)
    return table.fused_moe(case.x, case.router_logits, handle, case.top_k, case.renormalize)


@DTYPES
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tokens,num_experts,top_k,first_expert,num_local,renormalize", SHAPES)
def test_int8_fused_moe_matches_reference(emu, tokens, num_experts, top_k, first_expert, num_local, renormalize,
                                          pattern, dtype):
    case, experts = int8_case(seed=tokens * 131 + num_experts + top_k * 7 + first_expert, tokens=tokens,
                              num_experts=num_experts, top_k=top_k, dtype=dtype, pattern=pattern,
                              renormalize=renormalize, first_expert=first_expert, num_local=num_local)
    want = reference(case, experts)  # before prepare lays the experts out: it must not change their values
    out = run_npu(case, experts, dtype)
    assert out.dtype == dtype and out.shape == case.x.shape and not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    assert emu.calls == INT8_MOE_OPS


def test_a_rank_holding_none_of_the_choices_adds_exactly_zero(emu):
    """Expert parallelism: a token whose one choice is held elsewhere keeps no row, and the undefined
    (NaN here) rows past the kept ones, quantized and multiplied too, are never read."""
    case, experts = int8_case(seed=2, tokens=1, top_k=1, dtype=torch.bfloat16, pattern="one_expert", hot=3,
                              first_expert=4, num_local=4)
    assert torch.equal(run_npu(case, experts), torch.zeros_like(case.x))
    case, experts = int8_case(seed=3, tokens=4, top_k=2, dtype=torch.float16, pattern="one_expert", hot=3,
                              first_expert=0, num_local=2)  # expert 3 and most other choices are elsewhere
    want = reference(case, experts)
    out = run_npu(case, experts)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL[torch.float16], rtol=RTOL[torch.float16])


def test_a_handle_serves_either_activation_dtype(emu):
    """Scales made for one activation dtype at prepare; those of the other on its first call."""
    case16, experts = int8_case(seed=9, tokens=6, dtype=torch.float16, first_expert=2, num_local=4)
    table = NpuOpTable()
    handle = table.prepare_quantized_moe(experts, torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        x, logits = case16.x.to(dtype), case16.router_logits.to(dtype)
        want = ReferenceOps().fused_moe(x, logits, handle, case16.top_k, case16.renormalize)  # the prepared values
        out = table.fused_moe(x, logits, handle, case16.top_k, case16.renormalize)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want.float(), atol=ATOL[dtype], rtol=RTOL[dtype])


def test_prepare_holds_the_int8_experts_once_in_the_grouped_matmul_layout(emu):
    _, experts = int8_case(seed=4, tokens=3, dtype=torch.float16, first_expert=2, num_local=5)
    w13 = torch.nn.Parameter(experts.w13, requires_grad=False)  # as the model holds them
    w2 = torch.nn.Parameter(experts.w2, requires_grad=False)
    experts = Int8MoEWeights(w13, w2, experts.first_expert, experts.num_experts, experts.w13_scale, experts.w2_scale)
    before = w13.clone(), w2.clone()
    table = NpuOpTable()
    handle = table.prepare_quantized_moe(experts, torch.float16)
    assert isinstance(handle, NpuInt8MoEWeights) and (handle.num_local, handle.intermediate_size) == (5, 40)
    assert handle.gate_up_int8.dtype == handle.down_int8.dtype == torch.int8
    assert handle.gate_up_int8.shape == (5, 48, 80) and handle.gate_up_int8.is_contiguous()  # [E, hidden, 2I]
    assert handle.down_int8.shape == (5, 40, 48) and handle.down_int8.is_contiguous()  # [E, I, hidden]
    assert torch.equal(handle.gate_up_int8[1], before[0][1].t())
    assert torch.equal(handle.down_int8[4], before[1][4].t())
    # still Int8MoEWeights: each expert's W8A8 linears, [out, in], as the reference reads them
    assert torch.equal(handle.gate_up(1).qweight, before[0][1])
    assert torch.equal(handle.down(4).scale, experts.w2_scale[4])
    # the model's parameters keep their values and shapes, now views of the new layout: held once
    assert torch.equal(w13, before[0]) and torch.equal(w2, before[1])
    assert w13.untyped_storage().data_ptr() == handle.gate_up_int8.untyped_storage().data_ptr()
    assert w2.untyped_storage().data_ptr() == handle.down_int8.untyped_storage().data_ptr()
    again = NpuOpTable().prepare_quantized_moe(experts, torch.float16)  # a second call copies nothing
    assert again.gate_up_int8.untyped_storage().data_ptr() == handle.gate_up_int8.untyped_storage().data_ptr()
    assert table.describe()["quantized"] == "moe-w8a8-dynamic:npu_grouped_matmul"
    assert emu.calls == []  # nothing runs at load


def test_the_table_refuses_what_it_cannot_compute(emu):
    case, experts = int8_case(seed=5, tokens=2, dtype=torch.bfloat16)
    table = NpuOpTable()
    with pytest.raises(TypeError, match="prepare_quantized_moe"):  # the unprepared Int8MoEWeights
        table.fused_moe(case.x, case.router_logits, experts, case.top_k, case.renormalize)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        table.prepare_quantized_moe(experts, torch.float32)
    float_experts = Int8MoEWeights(experts.w13.float(), experts.w2.float(), 0, 8, experts.w13_scale, experts.w2_scale)
    with pytest.raises(ValueError, match="int8"):
        table.prepare_quantized_moe(float_experts, torch.bfloat16)


# -- the emulated int8 grouped matmul --------------------------------------------------------------

def _gmm_args(out_dtype=torch.float16, **overrides):
    """int8 x [6, 32] in groups of 2 / 0 / 3 rows (the last row past them), int8 weight [3, 32, 16]."""
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-128, 128, (6, 32), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (3, 32, 16), generator=g, dtype=torch.int8)
    scale = (torch.rand(3, 16, generator=g) * 1e-3).to(torch.float32 if out_dtype == torch.float16 else out_dtype)
    args = dict(x=[x], weight=[w], scale=[scale], per_token_scale=[torch.rand(6, generator=g) * 1e-2],
                group_list=torch.tensor([2, 0, 3]), group_list_type=1, group_type=0, split_item=2,
                output_dtype=out_dtype)
    return {**args, **overrides}


@DTYPES
def test_emulated_int8_grouped_matmul_dequantizes_exact_sums(emu, dtype):
    a = _gmm_args(dtype)
    (x,), (w,), (s,), (pts,) = a["x"], a["weight"], a["scale"], a["per_token_scale"]
    y = torch_npu().npu_grouped_matmul(**a)[0]
    assert y.dtype == dtype and y.shape == (6, 16)
    expert = [0, 0, 2, 2, 2]  # rows 0-1 expert 0, none for expert 1, rows 2-4 expert 2
    for row, e in enumerate(expert):
        acc = (x[row].long()[:, None] * w[e].long()).sum(0)  # exact int32 sums
        assert torch.equal(y[row], (acc.float() * s[e].float() * pts[row]).to(dtype))
    assert y[5].isnan().all()  # past the groups: not written


@pytest.mark.parametrize("bad,match", [
    (dict(scale=None), "needs scale"),
    (dict(scale=[torch.ones(3, 16, dtype=torch.bfloat16)]), "float32 scale"),  # float16 output takes fp32 scales
    (dict(output_dtype=torch.bfloat16), "bfloat16 scale"),  # ... bfloat16 output bf16 ones (A2/A3)
    (dict(scale=[torch.ones(3, 16, dtype=torch.float32)] * 2), "needs scale"),  # one per weight tensor
    (dict(scale=[torch.ones(16)]), r"\[E, N\]"),
    (dict(scale=[torch.ones(16, 3)]), r"\[E, N\]"),
    (dict(per_token_scale=[torch.ones(5)]), "per_token_scale"),
    (dict(per_token_scale=[torch.ones(6, dtype=torch.float16)]), "per_token_scale"),
    (dict(output_dtype=None), "output"),  # int8 output: not emulated
    (dict(weight=[torch.ones(3, 32, 16, dtype=torch.float16)]), "antiquant"),
])
def test_emulated_int8_grouped_matmul_refuses_a_bad_scale(emu, bad, match):
    with pytest.raises(npu_emulation.EmulationError, match=match):
        torch_npu().npu_grouped_matmul(**_gmm_args(**bad))


def test_emulated_float_grouped_matmul_refuses_scales(emu):
    a = _gmm_args()
    x = a["x"][0].half()
    w = torch.ones(3, 32, 16, dtype=torch.float16)
    with pytest.raises(npu_emulation.EmulationError, match="scale"):
        torch_npu().npu_grouped_matmul(**{**a, "x": [x], "weight": [w], "output_dtype": None})
