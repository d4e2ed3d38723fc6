"""The NPU table's fused MoE on the CPU, through the torch_npu emulation, against the reference.

Seeded cases (tests/workers/moe_cases.py) for every routing pattern: single tokens and batches,
top_k 1 / 2 / 8 of 8 and 128 experts, whole layers and expert-parallel slices (including one
expert, and slices that hold none of a token's choices), renormalized or not, float16 and
bfloat16 (the table computes half precision only). Plus which torch_npu ops it calls, and that
the emulated ops refuse what the real ones refuse and poison what they leave undefined."""

from __future__ import annotations

import pytest
import torch

from tests.workers import npu_emulation
from tests.workers.moe_cases import PATTERNS, make_moe_case, reference_moe
from workers.ops.npu import NpuMoEWeights, NpuOpTable, torch_npu

pytestmark = pytest.mark.npu_emulated

MOE_OPS = ["npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu",
           "npu_grouped_matmul", "npu_moe_token_unpermute"]
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # atol = rtol, against the float64 reference


@pytest.fixture
def emu(monkeypatch):
    return npu_emulation.install(monkeypatch)


def _run(case):
    table = NpuOpTable()
    experts = table.prepare_moe(case.w13, case.w2, case.first_expert, case.num_experts)
    return table.fused_moe(case.x, case.router_logits, experts, case.top_k, case.renormalize)


# (tokens, num_experts, top_k, first_expert, num_local, renormalize)
SHAPES = [
    (1, 8, 1, 0, None, True),
    (1, 8, 2, 4, 4, False),  # expert parallelism: the second half
    (1, 128, 8, 0, 64, True),
    (7, 8, 2, 0, None, False),
    (13, 8, 8, 0, None, True),  # every token uses every expert
    (13, 8, 8, 2, 3, False),
    (9, 128, 8, 0, None, True),
    (16, 128, 8, 32, 16, False),
    (9, 128, 8, 120, 8, True),  # the last slice
    (24, 8, 1, 3, 1, False),  # one local expert: its group list is a cumsum of one
    (40, 128, 8, 3, 1, True),  # ... the one the "one_expert" pattern sends every token to
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tokens,num_experts,top_k,first_expert,num_local,renormalize", SHAPES)
def test_fused_moe_matches_reference(emu, tokens, num_experts, top_k, first_expert, num_local, renormalize, pattern,
                                     dtype):
    case = make_moe_case(seed=tokens * 131 + num_experts + top_k * 7 + first_expert, tokens=tokens,
                         num_experts=num_experts, top_k=top_k, dtype=dtype, pattern=pattern, renormalize=renormalize,
                         first_expert=first_expert, num_local=num_local)
    out = _run(case)
    assert out.dtype == dtype and out.shape == case.x.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference_moe(case), atol=tol, rtol=tol)
    assert emu.calls == MOE_OPS


def test_a_rank_holding_none_of_the_choices_adds_exactly_zero(emu):
    """A token whose one choice (expert 3) is held elsewhere: no row is kept and the undefined
    (NaN here) rows are never read. Then a batch whose choices are mostly elsewhere."""
    case = make_moe_case(seed=2, tokens=1, top_k=1, dtype=torch.bfloat16, pattern="one_expert", hot=3,
                         first_expert=4, num_local=4)
    assert torch.equal(_run(case), torch.zeros_like(case.x))
    case = make_moe_case(seed=3, tokens=4, top_k=2, dtype=torch.float16, pattern="one_expert", hot=3,
                         first_expert=0, num_local=2)  # expert 3 and the other choice are mostly elsewhere
    out = _run(case)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), reference_moe(case), atol=5e-3, rtol=5e-3)


def test_prepare_moe_lays_the_experts_out_once_for_the_grouped_matmul(emu):
    case = make_moe_case(seed=4, tokens=3, dtype=torch.float16, first_expert=2, num_local=5)
    w13, w2 = torch.nn.Parameter(case.w13, requires_grad=False), torch.nn.Parameter(case.w2, requires_grad=False)
    before = w13.clone(), w2.clone()
    experts = NpuOpTable().prepare_moe(w13, w2, case.first_expert, case.num_experts)
    assert isinstance(experts, NpuMoEWeights) and (experts.num_local, experts.intermediate_size) == (5, 40)
    assert experts.gate_up.shape == (5, 48, 80) and experts.gate_up.is_contiguous()  # [E, hidden, 2I]
    assert experts.down.shape == (5, 40, 48) and experts.down.is_contiguous()  # [E, I, hidden]
    assert torch.equal(experts.gate_up[1], before[0][1].t()) and torch.equal(experts.down[4], before[1][4].t())
    # the model's parameters now view the new layout: the experts are held once
    assert torch.equal(w13, before[0]) and torch.equal(w2, before[1])
    assert w13.untyped_storage().data_ptr() == experts.gate_up.untyped_storage().data_ptr()
    assert w2.untyped_storage().data_ptr() == experts.down.untyped_storage().data_ptr()
    again = NpuOpTable().prepare_moe(w13, w2, case.first_expert, case.num_experts)  # copies nothing
    assert again.gate_up.untyped_storage().data_ptr() == experts.gate_up.untyped_storage().data_ptr()
    assert emu.calls == []  # nothing runs at load


def test_the_table_refuses_what_it_cannot_compute(emu):
    table = NpuOpTable()
    case = make_moe_case(seed=5, tokens=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        table.prepare_moe(case.w13, case.w2, 0, 8)
    half = make_moe_case(seed=5, tokens=2, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="prepare_moe"):
        table.fused_moe(half.x, half.router_logits, half.weights(), 2, True)  # the plain MoEWeights
    experts = table.prepare_moe(half.w13, half.w2, 0, 8)
    with pytest.raises(ValueError, match="one dtype"):
        table.fused_moe(half.x.half(), half.router_logits.half(), experts, 2, True)


def _routing_args(case, **overrides):
    n, k = case.x.shape[0], case.top_k
    ids = torch.topk(case.router_logits.float(), k).indices.to(torch.int32)
    args = dict(active_num=n * k, expert_num=case.num_experts, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                quant_mode=-1, active_expert_range=[0, case.num_experts], row_idx_type=0)
    return ids, {**args, **overrides}


@pytest.mark.parametrize("bad,match", [
    (dict(quant_mode=0), "quant_mode"),  # the default, static quantization, which the op does not support
    (dict(active_num=-1), "active_num"),
    (dict(active_expert_range=[4, 9]), "active_expert_range"),
    (dict(expert_tokens_num_flag=False), "expert_tokens_num_flag"),
])
def test_init_routing_refuses_bad_arguments(emu, bad, match):
    case = make_moe_case(seed=6, tokens=3, dtype=torch.float16)
    ids, args = _routing_args(case, **bad)
    with pytest.raises(npu_emulation.EmulationError, match=match):
        torch_npu().npu_moe_init_routing_v2(case.x, ids, **args)


def test_init_routing_leaves_the_rows_of_other_ranks_undefined(emu):
    """With an active range, only the kept pairs' rows are defined (NaN past them, here) and the
    gather index marks the dropped pairs -1, which the combine refuses."""
    npu = torch_npu()
    case = make_moe_case(seed=7, tokens=5, dtype=torch.float16)
    ids, args = _routing_args(case, active_expert_range=[2, 5])
    rows, src_to_row, counts, _ = npu.npu_moe_init_routing_v2(case.x, ids, **args)
    local = (ids >= 2) & (ids < 5)
    kept = int(local.sum())
    assert counts.tolist() == [int((ids == e).sum()) for e in (2, 3, 4)] and counts.dtype == torch.int64
    assert rows[kept:].isnan().all() and not rows[:kept].isnan().any()
    assert ((src_to_row.view(5, 2) < 0) == ~local).all()
    token = src_to_row.view(5, 2)[local].long()
    assert torch.equal(rows[token], case.x[torch.where(local)[0]])  # each kept pair's row is its token's
    with pytest.raises(npu_emulation.EmulationError, match="active_expert_range"):
        npu.npu_moe_token_unpermute(permuted_tokens=rows, sorted_indices=src_to_row, probs=torch.ones(5, 2).half())


def test_grouped_matmul_refuses_the_untransposed_weight(emu):
    """The experts as the model holds them ([E, out, in]) are the wrong layout for the op."""
    npu = torch_npu()
    case = make_moe_case(seed=8, tokens=4, dtype=torch.bfloat16)
    counts = torch.tensor([4] + [0] * 7, dtype=torch.int64)
    with pytest.raises(npu_emulation.EmulationError, match=r"\[E, in, out\]"):
        npu.npu_grouped_matmul(x=[case.x], weight=[case.w13], group_list=counts, group_list_type=1, group_type=0,
                               split_item=2)
    with pytest.raises(npu_emulation.EmulationError, match="length 1"):
        npu.npu_grouped_matmul(x=[case.x], weight=[case.w13[:1].transpose(1, 2).contiguous()],
                               group_list=counts[:1], group_list_type=1, group_type=0, split_item=2)
