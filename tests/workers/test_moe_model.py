"""Qwen3-MoE against HF transformers (fp32): checkpoints in both expert layouts load the same
weights; greedy through the runner equals HF token for token through chunked prefills, a prefix
hit and a preemption, on every CPU-run table; the config's dense and sparse layers; loader
errors; a bf16 checkpoint computing in fp32 keeps its experts bf16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling
from tests import oracle
from tests.plans import PlanDriver
from tests.workers.moe_checkpoints import hf_moe, write_checkpoint
from workers.loader import CheckpointError, load_config, load_model
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig

BS = 4
NEW = 16
PROMPTS = [[5, 100, 20], list(range(10, 41)), [7] * 16, list(range(30, 75, 2)), [120, 3, 80, 44, 9, 1]]
TABLES = ("reference", "cpu")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: write_checkpoint(name, root / name) for name in ("top2", "sparse_step", "stacked")}


@pytest.fixture(scope="module")
def expected(paths):
    return {name: oracle.hf_greedy(paths[name], PROMPTS, NEW) for name in ("top2", "sparse_step")}


def make_runner(path, ops, **kw):
    return ModelRunner(RunnerConfig(model=path, ops=ops, block_size=BS, num_kv_blocks=256, max_num_seqs=8, **kw))


def test_both_expert_layouts_load_hfs_weights(paths):
    hf = hf_moe("top2").state_dict()
    for name in ("top2", "stacked"):
        ours = dict(load_model(paths[name]).named_parameters())
        assert set(ours) == set(hf) - {"lm_head.weight"}  # tied
        for key, value in ours.items():
            assert torch.equal(value, hf[key]), key


def test_sparse_and_dense_layers_follow_the_config(paths):
    config = load_config(paths["sparse_step"])
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (6, 3, False)
    assert [config.is_sparse(i) for i in range(4)] == [False, True, False, False]  # step 2; layer 3 mlp-only
    names = {n for n, _ in load_model(paths["sparse_step"]).named_parameters()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.gate.weight" in names
    for layer in (0, 2, 3):
        assert f"model.layers.{layer}.mlp.gate_proj.weight" in names
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj" not in names


@pytest.mark.parametrize("ops", TABLES)
@pytest.mark.parametrize("name", ["top2", "sparse_step", "stacked"])
@pytest.mark.parametrize("chunk", [None, 3], ids=["whole", "chunk3"])
def test_greedy_equals_hf_through_chunks(paths, expected, ops, name, chunk):
    runner = make_runner(paths[name], ops)
    assert runner.stats()["moe"]["num_experts"] == load_config(paths[name]).num_experts
    driver = PlanDriver(runner, chunk_size=chunk)
    for prompt in PROMPTS:
        driver.add(prompt)
    assert driver.generate(NEW) == expected["top2" if name == "stacked" else name]


@pytest.mark.parametrize("ops", TABLES)
def test_greedy_equals_hf_after_a_prefix_hit_and_a_preemption(paths, expected, ops):
    path = paths["top2"]
    runner = make_runner(path, ops)
    driver = PlanDriver(runner, chunk_size=5)
    first = driver.add(PROMPTS[1])
    driver.generate(3)
    k = 6
    second_prompt = PROMPTS[1][: k * BS] + [90, 91, 92]
    second = driver.add(second_prompt, cached_blocks=first.block_table[:k])
    driver.generate(NEW)
    assert second.outputs[:NEW] == oracle.hf_greedy(path, [second_prompt], NEW)[0]
    assert first.outputs[:NEW] == expected["top2"][1]

    runner = make_runner(path, ops)
    driver = PlanDriver(runner)
    req = driver.add(PROMPTS[3])
    driver.generate(5)
    tokens = PROMPTS[3] + req.outputs
    blocks = list(range(100, 100 + -(-(len(tokens) + 2) // BS)))
    plan = StepPlan(step_id=99, preempted=[req.slot],
                    new_requests=[NewRequest(req.slot, tokens, 0, blocks, WorkerSampling())],
                    rows=[ScheduledRow(req.slot, len(tokens))])
    assert runner.execute(plan).sampled_ids() == [expected["top2"][3][len(req.outputs)]]
    nxt = runner.execute(StepPlan(step_id=100, rows=[ScheduledRow(req.slot, 1, [], USE_RESIDENT)]))
    assert nxt.sampled_ids() == [expected["top2"][3][len(req.outputs) + 1]]


def test_bf16_experts_stay_bf16_when_the_model_computes_in_fp32(paths, tmp_path):
    import shutil

    d = tmp_path / "bf16"
    hf_moe("top2").to(torch.bfloat16).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{paths['top2']}/{f}", d / f)
    stored = load_file(str(d / "model.safetensors"))
    runner = make_runner(str(d), "cpu", dtype="float32")
    stats = runner.stats()
    assert stats["dtype"] == "float32" and stats["moe"]["experts_dtype"] == "bfloat16"
    experts = sum(t.nbytes for n, t in stored.items() if ".experts." in n)
    assert stats["weight_bytes"] < sum(t.nbytes for t in stored.values()) + experts  # no wide copy of them
    outputs = []
    for r in (runner, make_runner(str(d), "reference", dtype="float32")):  # widening is exact: same tokens
        driver = PlanDriver(r)
        driver.add(PROMPTS[1])
        outputs.append(driver.generate(8))
    assert outputs[0] == outputs[1]


def test_a_bf16_checkpoint_computing_in_fp32_holds_about_its_own_bytes(paths, tmp_path, monkeypatch):
    """Every matrix at the checkpoint's width (experts, embedding, the layers' projections and the
    lm_head read by the narrow linear), nothing kept twice; the tokens those of the fp32 reference."""
    import shutil

    from workers.ops import cpu_kernels, cpu_narrow

    if cpu_kernels.load() is None:
        pytest.skip("raylm's CPU kernels did not build here")
    monkeypatch.setattr(cpu_narrow, "NARROW_MIN_ELEMENTS", 1)  # the tiny model's projections qualify
    monkeypatch.setenv(cpu_narrow.ENV, "all")
    d = tmp_path / "bf16"
    hf_moe("engine").to(torch.bfloat16).save_pretrained(d)  # untied; sizes whole panels (no padding rows)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{paths['sparse_step']}/{f}", d / f)
    stored = sum(t.nbytes for t in load_file(str(d / "model.safetensors")).values())
    runner = make_runner(str(d), "cpu", dtype="float32")
    stats = runner.stats()
    # the fp32 norms (vectors) are the only bytes past the checkpoint's
    assert stats["dtype"] == "float32" and stats["weight_bytes"] <= 1.02 * stored
    outputs = []
    for r in (runner, make_runner(str(d), "reference", dtype="float32")):
        driver = PlanDriver(r)
        driver.add(PROMPTS[1])
        outputs.append(driver.generate(8))
    assert outputs[0] == outputs[1]
    assert runner.stats()["lm_head_argmax_steps"] > 0  # greedy ids came from the bf16 lm_head fused with argmax


def _edit_checkpoint(src: str, dst, edit) -> str:
    import shutil

    shutil.copytree(src, dst)
    state = load_file(f"{dst}/model.safetensors")
    edit(state)
    save_file(state, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_loader_names_a_missing_expert_a_stray_one_and_a_wrong_shape(paths, tmp_path):
    key = "model.layers.1.mlp.experts.5.up_proj.weight"
    d = _edit_checkpoint(paths["top2"], tmp_path / "missing", lambda s: s.pop(key))
    with pytest.raises(CheckpointError, match=r"missing weight 'model\.layers\.1\.mlp\.experts\.gate_up_proj'"):
        load_model(d)
    d = _edit_checkpoint(paths["top2"], tmp_path / "stray",
                         lambda s: s.update({"model.layers.0.mlp.experts.8.up_proj.weight": s[key].clone()}))
    with pytest.raises(CheckpointError, match=r"unexpected weight 'model\.layers\.0\.mlp\.experts\.8\.up_proj"):
        load_model(d)
    d = _edit_checkpoint(paths["top2"], tmp_path / "shape", lambda s: s.update({key: s[key][:-1].clone()}))
    with pytest.raises(CheckpointError, match=r"shape mismatch for .*experts\.5\.up_proj.*\(27, 40\).*\(28, 40\)"):
        load_model(d)


def test_a_moe_config_missing_its_expert_fields_is_refused(paths, tmp_path):
    import shutil

    d = tmp_path / "noexperts"
    shutil.copytree(paths["top2"], d)
    raw = json.loads((d / "config.json").read_text())
    raw.pop("num_local_experts", None)
    raw.pop("num_experts", None)
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="config.json lacks 'num_experts'"):
        load_config(d)
