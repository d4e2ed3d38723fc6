"""Qwen3-MoE over two ranks (spawned processes, gloo): experts split whole across the ranks
(expert parallelism) or each expert's intermediate dim split (plain TP), both equal to one rank
and to HF; each rank holds and reads only its part, int8 experts with their scales included."""

from __future__ import annotations

import shutil

import pytest
import torch

from scheduler.protocol import WorkerSampling
from tests import oracle
from tests.workers.moe_checkpoints import hf_moe, write_checkpoint
from tests.workers.quant_checkpoints import write_compressed_tensors
from tests.workers.tp_ranks import job, run_ranks
from workers.loader import load_config, load_model
from workers.ops import cpu_kernels
from workers.parallel import TensorParallel

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

PROMPTS = [[5, 100, 20, 7, 9, 11], [42, 43, 44], list(range(1, 19))]
NEW = 12
RUNNER = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4)
SEEDED = [WorkerSampling(temperature=1.0, top_k=20, seed=99 + i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tp")
    paths = {name: write_checkpoint(name, root / name) for name in ("top2", "sparse_step")}
    bf16 = root / "top2_bf16"  # computing in fp32 on the CPU: experts packed at their width
    hf_moe("top2").to(torch.bfloat16).save_pretrained(bf16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{paths['top2']}/{f}", bf16 / f)
    paths["top2_bf16"] = str(bf16)
    paths["top2_w8a8"] = str(write_compressed_tensors(paths["top2"], root / "top2_w8a8", experts=True))
    return paths


@pytest.fixture(scope="module")
def runs(paths):
    jobs = [job(dict(RUNNER, model=paths["top2"]), PROMPTS, NEW, chunk=5),
            job(dict(RUNNER, model=paths["sparse_step"]), PROMPTS, NEW),
            job(dict(RUNNER, model=paths["top2"]), PROMPTS, NEW, SEEDED),
            job(dict(RUNNER, model=paths["top2_bf16"], dtype="float32"), PROMPTS, NEW),
            job(dict(RUNNER, model=paths["top2_w8a8"]), PROMPTS, NEW),
            job(dict(RUNNER, model=paths["top2"], quantization="int8"), PROMPTS, NEW)]
    return {"one": run_ranks(1, jobs), "tp": run_ranks(2, jobs), "ep": run_ranks(2, jobs, expert_parallel=True)}


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_two_ranks_equal_one_and_hf(runs, paths, layout):
    for i, name in enumerate(("top2", "sparse_step")):
        expected = oracle.hf_greedy(paths[name], PROMPTS, NEW)
        assert runs["one"][i][0] == expected
        assert runs[layout][i][0] == expected
    assert runs[layout][2][0] == runs["one"][2][0]  # seeded sampling too
    assert runs[layout][3][0] == runs["one"][3][0]  # bf16 experts packed per rank
    assert runs["one"][3][1]["moe"]["experts_dtype"] == "bfloat16"
    if cpu_kernels.load() is not None:
        assert runs[layout][3][1]["ops"]["moe"].endswith(": cpp-packed")


def test_expert_parallel_ranks_hold_whole_experts_and_tp_ranks_slices(runs):
    ep, tp, one = runs["ep"][0][1]["moe"], runs["tp"][0][1]["moe"], runs["one"][0][1]["moe"]
    assert (one["local_experts"], one["expert_parallel"]) == (8, False)
    assert (ep["local_experts"], ep["first_expert"], ep["expert_parallel"]) == (4, 0, True)
    assert (tp["local_experts"], tp["expert_parallel"]) == (8, False)
    whole = runs["one"][0][1]["weight_bytes"]
    assert runs["ep"][0][1]["weight_bytes"] < whole and runs["tp"][0][1]["weight_bytes"] < whole


def test_each_rank_loads_its_own_experts_from_the_checkpoint(paths):
    full = load_model(paths["top2"])
    inter = load_config(paths["top2"]).moe_intermediate_size
    for rank in range(2):
        # a rank's view for slicing only: its collectives are never called
        ep = load_model(paths["top2"], parallel=TensorParallel(rank, 2, expert_parallel=True))
        tp = load_model(paths["top2"], parallel=TensorParallel(rank, 2))
        for layer in range(3):
            whole = full.model.layers[layer].mlp.experts
            mine = ep.model.layers[layer].mlp.experts
            assert mine.first_expert == 4 * rank
            assert mine.gate_up_proj.equal(whole.gate_up_proj[4 * rank:4 * rank + 4])
            assert mine.down_proj.equal(whole.down_proj[4 * rank:4 * rank + 4])
            sliced = tp.model.layers[layer].mlp.experts
            half = inter // 2
            gate = whole.gate_up_proj[:, rank * half:(rank + 1) * half]
            up = whole.gate_up_proj[:, inter + rank * half:inter + (rank + 1) * half]
            assert sliced.gate_up_proj.equal(torch.cat([gate, up], dim=1))
            assert sliced.down_proj.equal(whole.down_proj[:, :, rank * half:(rank + 1) * half])


@pytest.mark.parametrize("job_index", [4, 5], ids=["compressed-tensors", "int8-at-load"])
def test_int8_experts_over_two_ranks(runs, job_index):
    """Both layouts quantize a row-parallel linear's input per rank, over the rank's slice (attention's
    o_proj under either; each expert's down under plain TP), as the dense formats do and vLLM does:
    other activation scales than one rank's, so held close to one rank, not equal. (Expert-parallel
    slices against the reference: tests/workers/test_moe_quant.py.)"""
    one = runs["one"][job_index]
    for layout in ("ep", "tp"):
        got = runs[layout][job_index]
        equal = sum(a == b for x, y in zip(one[0], got[0]) for a, b in zip(x, y))
        assert equal >= 0.75 * len(PROMPTS) * NEW, (layout, one[0], got[0])
    ep, tp = runs["ep"][job_index], runs["tp"][job_index]
    for stats in (one[1], ep[1], tp[1]):
        assert "moe-w8a8-dynamic" in stats["ops"]["quantized"]
    assert ep[1]["weight_bytes"] < one[1]["weight_bytes"] and tp[1]["weight_bytes"] < one[1]["weight_bytes"]
