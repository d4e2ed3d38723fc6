"""Quantized Qwen3-MoE experts (W8A8 with dynamic per-token activations: compressed-tensors'
int-quantized, msmodelslim's W8A8_DYNAMIC, quantization="int8" at load).

Checkpoints are written by each format's rules (tests/workers/quant_checkpoints.py, experts under
their per-expert names) from HF's tiny random MoE models (tests/workers/moe_checkpoints.py), and
held to: HF's model with every quantized product computing the format's arithmetic (dequantized
weights; each input rounded per token to its int8 grid), written here independently of raylm's
loader; the CPU kernel against the reference table on seeded batches; greedy through the runner on
both CPU-run tables; and clear errors for experts raylm does not serve quantized."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.plans import PlanDriver
from tests.workers.moe_cases import PATTERNS, make_moe_case
from tests.workers.moe_checkpoints import hf_moe, write_checkpoint
from tests.workers.quant_checkpoints import PROJECTIONS, write_compressed_tensors, write_modelslim
from tests.workers.test_quant import TOLERANCE, forward_logits
from workers.loader import CheckpointError, load_model
from workers.ops import get_op_table
from workers.ops.base import Int8MoEWeights, route_tokens
from workers.ops.cpu_kernels import load as load_kernels
from workers.ops.reference import ReferenceOps
from workers.quant import QuantConfigError
from workers.quant.weights import quantize_int8
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig

FORMATS = ("compressed-tensors", "modelslim-w8a8-dynamic", "int8")
PROMPTS = [[5, 100, 20], list(range(10, 41)), [7] * 16, list(range(30, 75, 2))]
NEW = 12
EXACT, FLIP_TOLERANCE = 1e-5, 2e-2  # of max |logit|: equal up to float rounding; one int8 code step away
needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="raylm's CPU kernels could not be built here")


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_float")
    return {name: write_checkpoint(name, root / name) for name in ("top2", "sparse_step")}


def quantized(floats, name: str, fmt: str, root) -> tuple[str, str | None]:
    """(path, quantization) of checkpoint `name` in format `fmt`."""
    if fmt == "int8":
        return floats[name], "int8"
    write = write_compressed_tensors if fmt == "compressed-tensors" else \
        lambda s, d, experts: write_modelslim(s, d, dynamic=True, experts=experts)
    return str(write(floats[name], root / f"{name}-{fmt}", experts=True)), None


@pytest.fixture(scope="module")
def checkpoints(floats, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_quant")
    return {(name, fmt): quantized(floats, name, fmt, root) for name in floats for fmt in FORMATS}


# -- the format's arithmetic on HF's model ----------------------------------------------------------------------
def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded per row to its symmetric int8 grid (scale = max |x| / 127), in x's dtype."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(x / s).clamp(-128, 127) * s


def _tensors(path: str) -> dict:
    from pathlib import Path

    return {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}


def _dequantized(tensors: dict, quantization: str | None, name: str) -> torch.Tensor:
    """Weight `name` as the format stores it, dequantized (int8 at load: quantized here by its rule)."""
    if quantization == "int8":
        w = tensors[name].float()
        s = w.abs().amax(-1, keepdim=True) / 127
        return torch.round(w / s).clamp(-128, 127) * s
    return tensors[name].float() * tensors[name.removesuffix("weight") + "weight_scale"].float()


def fake_quant_hf(path: str, quantization: str | None, name: str):
    """HF's Qwen3-MoE `name` (the float model the checkpoints were written from) with every decoder
    projection (attention's, dense layers' MLPs) and every expert computing W8A8 dynamic: the weights
    of the checkpoint at `path` dequantized, each input rounded per token; in float64, so its sums
    are exact, as the format's are."""
    hf, tensors = hf_moe(name).double(), _tensors(path)
    for mod_name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and mod_name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.weight.data = _dequantized(tensors, quantization, mod_name + ".weight").double()
            module.register_forward_pre_hook(lambda _, args: (_fake_quant_rows(args[0]),))
        if mod_name.endswith("mlp.experts"):
            def per_expert(e, proj, mod_name=mod_name):
                return _dequantized(tensors, quantization, f"{mod_name}.{e}.{proj}.weight").double()
            n = module.num_experts
            w13 = [torch.cat([per_expert(e, "gate_proj"), per_expert(e, "up_proj")]) for e in range(n)]
            w2 = [per_expert(e, "down_proj") for e in range(n)]

            def forward(x, top_k_index, top_k_weights, w13=w13, w2=w2):
                out = torch.zeros_like(x)
                for e in range(len(w13)):
                    token, slot = torch.where(top_k_index == e)
                    if token.numel() == 0:
                        continue
                    gate, up = (_fake_quant_rows(x[token]) @ w13[e].t()).chunk(2, dim=-1)
                    h = _fake_quant_rows(torch.nn.functional.silu(gate) * up) @ w2[e].t()
                    out.index_add_(0, token, h * top_k_weights[token, slot, None])
                return out
            module.forward = forward
    return hf


def assert_close_but_for_boundary_flips(got: torch.Tensor, expected: torch.Tensor, what: str, close: float,
                                        flips: int) -> None:
    """Logits [positions, vocab] within `close` x max |logit| at all but `flips` positions, and within
    FLIP_TOLERANCE x max |logit| at those: an input that lands on a rounding boundary of its int8 grid
    in one computation and not the other (products rounded in another order) moves that token's
    logits by one code step's worth."""
    scale = expected.abs().max().item()
    per_position = (got - expected).abs().amax(dim=-1) / scale
    print(f"{what}: worst positions {sorted(per_position.tolist())[-3:]} of max |logit| {scale:.1f}")
    assert int((per_position > close).sum()) <= flips, per_position
    assert per_position.max().item() <= FLIP_TOLERANCE, per_position


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["top2", "sparse_step"])
def test_loaded_logits_equal_the_formats_arithmetic(checkpoints, name, fmt):
    path, quantization = checkpoints[name, fmt]
    model = load_model(path, quantization=quantization)
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts and all(m.gate_up_proj.dtype == torch.int8 and m.down_proj.dtype == torch.int8 for m in experts)
    if quantization is None:
        for n, m in model.named_modules():  # the int8 values are the checkpoint's, stacked per layer
            if n.endswith("mlp.experts"):
                stored = _tensors(path)
                assert torch.equal(m.gate_up_proj[1, : m.gate_up_proj.shape[1] // 2], stored[f"{n}.1.gate_proj.weight"])
                assert torch.equal(m.down_proj_scale[1], stored[f"{n}.1.down_proj.weight_scale"].float().view(-1))
    hf = fake_quant_hf(path, quantization, name)
    ids = [3 + (7 * i) % 120 for i in range(48)]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    for ops in ("reference", "cpu"):
        model.prepare(get_op_table("cpu", ops))
        got = forward_logits(model, ids)
        # the reference computes the format's sums exactly, as HF's float64 does, but the ops between them
        # (norms, attention) in fp32, whose rounding differs by CPU: an input that lands on an int8 rounding
        # boundary in one and not the other moves its position's logits by one code step, and through
        # attention every later position's a little. The CPU table's dense W8A8 linears also finish their sums
        # in fp32 (the experts' kernel in float64, as the reference): held to the dense formats' tolerance.
        assert_close_but_for_boundary_flips(got, expected, f"{name} {fmt} {ops}",
                                            EXACT if ops == "reference" else TOLERANCE, len(ids) // 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_through_the_runner_is_the_same_on_both_tables(checkpoints, fmt):
    path, quantization = checkpoints["top2", fmt]
    outs = {}
    for ops in ("reference", "cpu"):
        runner = ModelRunner(RunnerConfig(model=path, ops=ops, block_size=4, num_kv_blocks=256, max_num_seqs=8,
                                          quantization=quantization))
        driver = PlanDriver(runner, chunk_size=5)
        for prompt in PROMPTS:
            driver.add(prompt)
        outs[ops] = driver.generate(NEW)
        stats = runner.stats()
        assert stats["quantization"]["scheme"] == "w8a8-dynamic"
        assert f"moe-w8a8-dynamic:{'reference' if ops == 'reference' else 'cpp-int8'}" in stats["ops"]["quantized"]
    assert outs["cpu"] == outs["reference"]


def test_int8_at_load_holds_the_experts_at_a_quarter_of_fp32(floats):
    fp32 = load_model(floats["top2"])
    int8 = load_model(floats["top2"], quantization="int8")
    for (n, a), (m, b) in zip(fp32.named_modules(), int8.named_modules()):
        if n.endswith("mlp.experts"):
            assert n == m
            for proj in ("gate_up_proj", "down_proj"):
                w, q, s = getattr(a, proj), getattr(b, proj), getattr(b, proj + "_scale")
                assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == w.shape[:2]
                assert (q.float() * s[..., None] - w).abs().max() <= s.max() / 2 + 1e-6  # round to nearest
                assert q.nbytes == w.nbytes // 4


# -- the CPU kernel against the reference table ---------------------------------------------------------------
CASES = [  # (tokens, num_experts, top_k, first_expert, num_local, hidden, intermediate)
    (1, 8, 2, 0, None, 48, 40), (5, 8, 8, 0, None, 64, 32), (13, 16, 4, 4, 8, 40, 28), (70, 8, 2, 0, None, 96, 64),
    (33, 128, 8, 120, 8, 64, 48), (130, 16, 4, 0, None, 64, 48),
    # tens of tokens an expert, widths in whole 64-column tiles: AMX-INT8 where the CPU has it (and the rest)
    (150, 4, 2, 0, None, 64, 128), (200, 8, 2, 0, None, 128, 80)]


def int8_case(seed, tokens, num_experts, top_k, first_expert, num_local, hidden, intermediate, dtype, pattern):
    case = make_moe_case(seed=seed, tokens=tokens, num_experts=num_experts, top_k=top_k, hidden=hidden,
                         intermediate=intermediate, dtype=dtype, pattern=pattern, first_expert=first_expert,
                         num_local=num_local, hot=first_expert)
    w13, w2 = quantize_int8(case.w13), quantize_int8(case.w2)
    return case, Int8MoEWeights(w13.qweight, w2.qweight, case.first_expert, case.num_experts, w13.scale, w2.scale)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s[:3])))
def test_cpu_int8_kernel_equals_the_reference(shape, pattern, dtype):
    """Same steps, same roundings (exact int32 sums, the epilogue in float64): float32 differs by the
    silu's exp and the order the experts' outputs are added only (no input of these seeded cases lands
    on an int8 rounding boundary in one and not the other); half precision adds the fp32 sum of the
    experts' outputs, rounded once, where the reference adds them in x's dtype."""
    case, experts = int8_case(sum(v or 0 for v in shape), *shape, dtype, pattern)
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_quantized_moe(experts, dtype)
    got = ops.fused_moe(case.x, case.router_logits, handle, case.top_k, case.renormalize)
    want = ReferenceOps().fused_moe(case.x, case.router_logits, experts, case.top_k, case.renormalize)
    assert got.dtype == dtype and got.shape == case.x.shape
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0)
    if shape[0]:
        assert ops.describe()["moe"].endswith(": cpp-int8")
    # the experts as they lie, row by row (the kernel's layout on CPUs without VNNI's panels)
    weights, ids = route_tokens(case.router_logits, case.top_k, case.renormalize)
    rows = torch.empty_like(case.x)
    load_kernels().fused_moe_int8(rows, case.x, experts.w13, experts.w13_scale, experts.w2, experts.w2_scale,
                                      ids, weights, experts.first_expert)
    torch.testing.assert_close(rows.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0)


def test_a_forced_reference_path_runs_int8_experts_through_the_reference(monkeypatch):
    monkeypatch.setenv("RAYLM_CPU_MOE", "reference")
    case, experts = int8_case(1, 9, 8, 2, 0, None, 48, 40, torch.float32, "random")
    ops = get_op_table("cpu", "cpu")
    got = ops.fused_moe(case.x, case.router_logits, ops.prepare_quantized_moe(experts), 2, True)
    assert torch.equal(got, ReferenceOps().fused_moe(case.x, case.router_logits, experts, 2, True))
    assert "moe-w8a8-dynamic:reference" in ops.describe()["quantized"]


# -- what raylm refuses ----------------------------------------------------------------------------------------
def _rewrite(path, edit_description=None, edit_tensors=None):
    if edit_description is not None:
        f = path / "quant_model_description.json"
        desc = json.loads(f.read_text())
        edit_description(desc)
        f.write_text(json.dumps(desc))
    if edit_tensors is not None:
        tensors = load_file(path / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(path / "model.safetensors"))


def test_static_w8a8_experts_are_refused_by_name(floats, tmp_path):
    path = write_modelslim(floats["top2"], tmp_path / "ms", dynamic=True, experts=True)

    def static_experts(desc):
        for k in desc:
            if ".experts." in k and k.endswith(".weight"):
                desc[k] = "W8A8"
    _rewrite(path, edit_description=static_experts)
    with pytest.raises(QuantConfigError, match=r"experts model\.layers\.0\.mlp\.experts\.\* are w8a8-static"):
        load_model(str(path))


def test_a_layer_whose_experts_mix_schemes_is_refused(floats, tmp_path):
    path = write_modelslim(floats["top2"], tmp_path / "ms", dynamic=True, experts=True)
    _rewrite(path, edit_description=lambda d: d.update({"model.layers.1.mlp.experts.3.up_proj.weight": "FLOAT"}))
    with pytest.raises(QuantConfigError, match=r"experts of model\.layers\.1\.mlp\.experts mix"):
        load_model(str(path))


def test_nonzero_expert_offsets_are_refused(floats, tmp_path):
    path = write_modelslim(floats["top2"], tmp_path / "ms", dynamic=True, experts=True)
    name = "model.layers.2.mlp.experts.5.down_proj.weight_offset"
    _rewrite(path, edit_tensors=lambda t: t[name].fill_(1.0))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + " is not all zeros"):
        load_model(str(path))


def test_a_missing_expert_scale_is_named(floats, tmp_path):
    path = write_compressed_tensors(floats["top2"], tmp_path / "ct", experts=True)
    _rewrite(path, edit_tensors=lambda t: t.pop("model.layers.0.mlp.experts.7.up_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"missing weight 'model\.layers\.0\.mlp\.experts\.gate_up_proj_scale'"):
        load_model(str(path))
