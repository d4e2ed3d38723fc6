"""Pipeline parallelism across the nodes of a local multi-node Ray: stages really land on
different nodes (read back from Ray), greedy equals HF and one stage (dense, 2 x 2 with tensor
parallelism, MoE), seeded sampling is the same for every layout, and a stage that dies or raises
mid-run is rebuilt with its requests recomputed to the same tokens."""

from __future__ import annotations

import pytest

import cluster
from scheduler.request import SamplingParams
from tests.cluster.faults import generate_in_background, wait_for_tokens
from tests.multinode.conftest import start_cluster, stop_cluster
from tests.oracle import hf_greedy, hf_greedy_text
from tests.workers.moe_checkpoints import write_checkpoint

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900)]

PROMPTS = ["北京故宫是", "Hello there", "The quick brown fox jumps over the lazy dog", "def add(a, b):"]
N = 16
GREEDY = SamplingParams(max_tokens=N, temperature=0)
SEEDED = SamplingParams(max_tokens=N, temperature=1.0, top_k=50, seed=99)
ENGINE = dict(num_kv_blocks=64, threads_per_worker=1, step_timeout_s=20.0)


@pytest.fixture(scope="module")
def nodes():
    """Three worker nodes (one NPU, two NPU_PAIR each) beside an accelerator-less head."""
    c, workers = start_cluster(3)
    yield [n.node_id for n in workers]
    stop_cluster(c)


@pytest.fixture(scope="module")
def expected():
    return hf_greedy_text(PROMPTS, N)


def _stage_nodes(llm) -> list[list[str]]:
    """The node each rank runs on (as the rank read it from Ray), grouped by pipeline stage."""
    ranks = llm.engine.replicas[0].info["ranks"]
    stages: dict[int, list[str]] = {}
    for r in ranks:
        stages.setdefault(r["pipeline_stage"], []).append(r["node_id"])
    return [stages[s] for s in sorted(stages)]


def _run(**layout):
    with cluster.launch(**ENGINE, **layout) as llm:
        greedy = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        seeded = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        return greedy, seeded, _stage_nodes(llm), llm.stats()


def test_two_stages_on_two_nodes_equal_hf_and_one_stage(nodes, expected):
    one = _run(accelerator_resource="NPU")
    two = _run(accelerator_resource="NPU", pipeline_parallel_size=2)
    assert one[0] == expected and two[0] == expected
    assert two[1] == one[1]  # seeded sampling: the same tokens whatever the layout
    (first,), (last,) = two[2]
    assert first != last and {first, last} <= set(nodes)  # one NPU per node: the stages cannot share one
    assert two[3]["pipeline_parallel_size"] == 2 and two[3]["kv_blocks_used"] == 0


def test_two_stages_of_two_tensor_ranks_each_keep_a_stage_on_one_node(nodes, expected):
    greedy, seeded, stages, _ = _run(accelerator_resource="NPU_PAIR", pipeline_parallel_size=2,
                                     tensor_parallel_size=2)
    one = _run(accelerator_resource="NPU")
    assert greedy == expected and seeded == one[1]
    assert [len(set(s)) for s in stages] == [1, 1]  # a stage's TP ranks share a node (STRICT_PACK)
    assert stages[0][0] != stages[1][0]  # no node holds four NPU_PAIR: the stages went apart


def test_a_moe_model_over_two_nodes_equals_hf(nodes, tmp_path):
    path = write_checkpoint("top2", tmp_path / "top2")
    prompts = [[5, 100, 20, 7, 9, 11], [42, 43, 44], list(range(1, 19))]
    with cluster.launch(path, **ENGINE, accelerator_resource="NPU", pipeline_parallel_size=2) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True))]
        stages = _stage_nodes(llm)
    assert got == hf_greedy(path, prompts, 12)
    assert stages[0] != stages[1]


def test_a_stage_that_dies_or_raises_is_rebuilt_with_the_same_outputs(nodes, expected, faulty_workers):
    import ray

    with cluster.launch(**ENGINE, accelerator_resource="NPU", pipeline_parallel_size=2) as llm:
        rep = llm.engine.replicas[0]
        clean_seeded = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        # the first stage killed from outside mid-generation: the last is left waiting for activations
        t, box = generate_in_background(llm, PROMPTS, GREEDY)
        wait_for_tokens(llm, llm.stats()["generated_tokens"] + 3, timeout=120)
        ray.kill(rep.workers[0], no_restart=True)
        t.join(timeout=300)
        killed = [o.token_ids for o in box["outs"]]
        # the last stage raises inside a step: the first stage's sends are left unanswered
        ray.get(rep.workers[1].arm_fault.remote("raise", after_steps=4))
        raised = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        stats = llm.stats()
    assert killed == expected
    assert raised == clean_seeded
    assert stats["worker_restarts"] == 2 and stats["kv_blocks_used"] == 0
