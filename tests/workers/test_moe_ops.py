"""Fused MoE: every CPU path (raylm's kernel, aten's GEMM per expert, torch._grouped_mm, the
reference's loop), the grouped-GEMM function the CUDA table runs, and the reference table itself,
against reference_moe (float64) on seeded cases: each routing pattern, empty and single-token
batches and larger ones, top-k 1 / 2 / 8, 8 and 128 experts, expert-parallel slices, weights
narrower than the activations, sizes off the vector width; then how the CPU table picks its path."""

from __future__ import annotations

import pytest
import torch

from tests.workers.moe_cases import make_moe_case, reference_moe
from workers.ops import cpu_kernels, cpu_moe, get_op_table
from workers.ops.cuda import CudaOpTable
from workers.ops.moe_grouped import grouped_mm_fits, grouped_mm_moe
from workers.ops.reference import ReferenceOps

HAVE_KERNELS = cpu_kernels.load() is not None
needs_kernels = pytest.mark.skipif(not HAVE_KERNELS, reason=f"raylm's CPU kernels not built: {cpu_kernels.failure()}")

# (x dtype, weight dtype)
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
          (torch.bfloat16, torch.bfloat16)]
CASES = {
    "one token": dict(tokens=1),
    "empty batch": dict(tokens=0),
    "64 tokens, 128 experts, top-8": dict(tokens=64, num_experts=128, top_k=8),
    "one expert, top-1, not renormalized": dict(tokens=70, top_k=1, pattern="one_expert", renormalize=False),
    "few experts": dict(tokens=33, pattern="few_experts"),
    "EP slice, hot expert held": dict(tokens=40, first_expert=2, num_local=4, pattern="one_expert", hot=3),
    "EP slice, hot expert elsewhere": dict(tokens=9, first_expert=4, num_local=4, pattern="one_expert", hot=1,
                                           top_k=1),
    "EP slice of 128, one token, top-8": dict(tokens=1, num_experts=128, top_k=8, first_expert=64, num_local=32,
                                              renormalize=False),
    "hidden 36, intermediate 20": dict(tokens=17, hidden=36, intermediate=20),
}
PATHS = [pytest.param("cpp-packed", marks=needs_kernels), pytest.param("cpp", marks=needs_kernels),
         pytest.param("aten-mm", marks=needs_kernels), "grouped-mm", "reference"]


def make_case(name, dtypes, seed=0):
    x_dtype, w_dtype = dtypes
    return make_moe_case(seed=seed, dtype=x_dtype, weight_dtype=w_dtype, **CASES[name])


def assert_matches_reference(out, case):
    """fp32 compute within 1e-5 of the float64 answer (relative to its scale); bf16 within bf16's
    rounding of the products and their sum."""
    want = reference_moe(case)
    assert out.shape == case.x.shape and out.dtype == case.x.dtype
    tol = 1e-5 if case.x.dtype == torch.float32 else 2e-2
    scale = max(want.abs().amax().item(), 1e-3) if want.numel() else 1.0
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * scale)


def fits(path, case):
    return path != "grouped-mm" or grouped_mm_fits(case.x, case.weights())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("name", list(CASES))
def test_each_cpu_path_equals_the_reference(name, dtypes, path, monkeypatch):
    monkeypatch.setenv(cpu_moe.ENV, path)
    case = make_case(name, dtypes)
    if not fits(path, case):
        pytest.skip("torch._grouped_mm takes rows of 16-byte multiples only")
    ops = get_op_table("cpu", "cpu")
    experts = ops.prepare_moe(case.w13, case.w2, case.first_expert, case.num_experts, dtype=case.x.dtype)
    assert experts.w13.dtype == case.w13.dtype  # never widened
    if path != "cpp-packed":
        assert experts.w13.data_ptr() == case.w13.data_ptr()  # no copy (cpp-packed: the packed layout instead)
    out = ops.fused_moe(case.x, case.router_logits, experts, case.top_k, case.renormalize)
    assert_matches_reference(out, case)
    if case.x.shape[0]:
        assert ops.describe()["moe"].endswith(f": {path}")


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("name", list(CASES))
def test_the_grouped_mm_function_and_the_cuda_table_equal_the_reference(name, dtypes):
    """What the CUDA table runs, on the CPU (torch._grouped_mm runs here): widening the hit experts
    where the weights are narrower; the table falls back to the reference loop where sizes do not fit."""
    case = make_case(name, dtypes, seed=1)
    if grouped_mm_fits(case.x, case.weights()):
        assert_matches_reference(grouped_mm_moe(case.x, case.router_logits, case.weights(), case.top_k,
                                                case.renormalize), case)
    ops = CudaOpTable()
    out = ops.fused_moe(case.x, case.router_logits, ops.prepare_moe(case.w13, case.w2, case.first_expert,
                                                                     case.num_experts), case.top_k, case.renormalize)
    assert_matches_reference(out, case)


@pytest.mark.parametrize("dtypes", [DTYPES[0], DTYPES[3]], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_table_equals_reference_moe(name, dtypes):
    case = make_case(name, dtypes, seed=2)
    out = ReferenceOps().fused_moe(case.x, case.router_logits, case.weights(), case.top_k, case.renormalize)
    assert_matches_reference(out, case)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 130])
def test_the_kernel_splits_large_batches_across_token_chunks_and_threads(tokens, monkeypatch):
    """More tokens on one expert than one pass serves (one_expert at 130 tokens), every thread busy."""
    monkeypatch.setenv(cpu_moe.ENV, "cpp")
    case = make_moe_case(seed=3, tokens=tokens, num_experts=16, top_k=4, hidden=64, intermediate=48,
                         pattern="one_expert", weight_dtype=torch.bfloat16)
    ops = get_op_table("cpu", "cpu")
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, max(threads, 2)}):
            torch.set_num_threads(n)
            assert_matches_reference(ops.fused_moe(case.x, case.router_logits, case.weights(), case.top_k,
                                                   case.renormalize), case)
    finally:
        torch.set_num_threads(threads)
    for op in (cpu_kernels.load().fused_moe, cpu_kernels.load().fused_moe_mm):  # an empty batch, called directly
        out = torch.ones(0, 64)
        op(out, case.x[:0], case.w13, case.w2, torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4), 0)


def test_the_cpu_table_measures_its_candidates_once_per_case_and_keeps_the_fastest(monkeypatch):
    monkeypatch.delenv(cpu_moe.ENV, raising=False)
    monkeypatch.setattr(cpu_moe, "_chosen", {})
    timed = []
    fake = {"cpp": 3.0, "aten-mm": 1.0, "grouped-mm": 2.0}

    def fake_time(self, path, x, *args):
        timed.append((path, x.shape[0]))
        return fake[path]

    monkeypatch.setattr(cpu_moe.CPUMoE, "_time", fake_time)
    ops = get_op_table("cpu", "cpu")
    same = make_moe_case(seed=4, tokens=5)  # fp32 weights: every path reads them as they are
    for _ in range(2):
        assert_matches_reference(ops.fused_moe(same.x, same.router_logits, same.weights(), 2, True), same)
    want = ["cpp", "aten-mm", "grouped-mm"] if HAVE_KERNELS else ["grouped-mm"]
    assert [p for p, _ in timed] == (want if len(want) > 1 else [])  # measured once, on the first call
    assert ops.describe()["moe"] == f"float32/float32 T<=8: {'aten-mm' if HAVE_KERNELS else 'grouped-mm'}"
    big = make_moe_case(seed=5, tokens=cpu_moe.MEASURE_TOKENS + 88)  # measured on its first MEASURE_TOKENS tokens
    ops.fused_moe(big.x, big.router_logits, big.weights(), 2, True)
    assert all(n == cpu_moe.MEASURE_TOKENS for _, n in timed[len(want):]) and "T>1024" in ops.describe()["moe"]
    narrow = make_moe_case(seed=6, tokens=5, weight_dtype=torch.bfloat16)  # only the kernel reads bf16 as is
    assert ops.moe.candidates(narrow.x, narrow.weights()) == (["cpp"] if HAVE_KERNELS else ["grouped-mm"])


def test_the_cpu_table_without_kernels_runs_torch_paths_and_says_so(monkeypatch):
    monkeypatch.delenv(cpu_moe.ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setattr(cpu_kernels, "failure", lambda: "OSError: no c++ here")
    ops = get_op_table("cpu", "cpu")
    for dtypes, name, path in ((DTYPES[1], "few experts", "grouped-mm"),
                               (DTYPES[3], "hidden 36, intermediate 20", "reference")):
        case = make_case(name, dtypes, seed=7)
        out = ops.fused_moe(case.x, case.router_logits, case.weights(), case.top_k, case.renormalize)
        assert_matches_reference(out, case)
        assert f": {path}" in ops.describe()["moe"]
    assert ops.describe()["kernels"] == "not built: OSError: no c++ here"
    monkeypatch.setenv(cpu_moe.ENV, "cpp")
    with pytest.raises(RuntimeError, match="needs raylm's CPU kernels, which could not be built: OSError"):
        ops.fused_moe(case.x, case.router_logits, case.weights(), case.top_k, case.renormalize)


def test_an_unknown_or_unfit_forced_moe_path_is_refused(monkeypatch):
    ops = get_op_table("cpu", "cpu")
    case = make_case("hidden 36, intermediate 20", DTYPES[3])
    monkeypatch.setenv(cpu_moe.ENV, "fast")
    with pytest.raises(ValueError,
                       match="RAYLM_CPU_MOE must be one of cpp-packed, cpp, aten-mm, grouped-mm, reference"):
        ops.fused_moe(case.x, case.router_logits, case.weights(), case.top_k, case.renormalize)
    monkeypatch.setenv(cpu_moe.ENV, "grouped-mm")
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        ops.fused_moe(case.x, case.router_logits, case.weights(), case.top_k, case.renormalize)


def test_token_buckets():
    assert [cpu_moe.bucket(t) for t in (1, 2, 8, 9, 64, 256, 257, 1024, 1025)] == \
        ["T<=1", "T<=8", "T<=8", "T<=64", "T<=64", "T<=256", "T<=1024", "T<=1024", "T>1024"]


@needs_kernels
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_only_experts_narrower_than_the_activations_are_packed_unforced(dtypes, monkeypatch):
    monkeypatch.delenv(cpu_moe.ENV, raising=False)
    case = make_case("64 tokens, 128 experts, top-8", dtypes, seed=4)
    ops = get_op_table("cpu", "cpu")
    experts = ops.prepare_moe(case.w13, case.w2, case.first_expert, case.num_experts, dtype=case.x.dtype)
    narrower = case.w13.dtype.itemsize < case.x.dtype.itemsize
    assert isinstance(experts, cpu_moe.PackedMoEWeights) == narrower
    assert_matches_reference(ops.fused_moe(case.x, case.router_logits, experts, case.top_k, case.renormalize), case)
    assert ops.describe()["moe"].endswith(": cpp-packed") == narrower
    if narrower:  # packed experts serve no other path
        monkeypatch.setenv(cpu_moe.ENV, "cpp")
        with pytest.raises(ValueError, match="these experts are packed for the 'cpp-packed' MoE path, not 'cpp'"):
            ops.fused_moe(case.x, case.router_logits, experts, case.top_k, case.renormalize)
