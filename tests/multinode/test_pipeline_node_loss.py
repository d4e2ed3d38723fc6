"""A node that leaves the cluster mid-run under a pipeline-parallel replica: the replica is
rebuilt on a node that has room and its requests recompute to the same tokens; once no node has
room, its requests end with a clear error instead of hanging."""

from __future__ import annotations

import time

import pytest

import cluster
from scheduler.request import SamplingParams
from tests.cluster.faults import generate_in_background, wait_for_tokens
from tests.multinode.conftest import start_cluster, stop_cluster
from tests.oracle import hf_greedy_text

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog"]
N = 24
GREEDY = SamplingParams(max_tokens=N, temperature=0)


@pytest.fixture(scope="module")
def three_nodes():
    c, workers = start_cluster(3)
    yield c, workers
    stop_cluster(c)


def _stage_nodes(llm) -> list[str]:
    return [r["node_id"] for r in llm.engine.replicas[0].info["ranks"]]


def test_a_removed_node_moves_its_stage_elsewhere_then_fails_clearly_when_no_room_is_left(three_nodes):
    c, workers = three_nodes
    by_id = {n.node_id: n for n in workers}
    expected = hf_greedy_text(PROMPTS, N)
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1, step_timeout_s=20.0, start_timeout_s=20.0,
                        max_worker_restarts=3, restart_backoff_s=0.5, replica_cooldown_s=600.0,
                        accelerator_resource="NPU", pipeline_parallel_size=2) as llm:
        before = _stage_nodes(llm)
        t, box = generate_in_background(llm, PROMPTS, GREEDY)
        wait_for_tokens(llm, 3, timeout=120)
        c.remove_node(by_id[before[1]])  # the last stage's node goes away mid-generation
        t.join(timeout=300)
        assert not t.is_alive()
        moved = [o.token_ids for o in box["outs"]]
        after = _stage_nodes(llm)
        # a second node lost: two stages, one node with an NPU left; the requests must not hang
        c.remove_node(by_id[after[0]] if after[0] in by_id and after[0] != before[1] else by_id[after[1]])
        t0 = time.monotonic()
        outs = llm.generate(PROMPTS, GREEDY)
        waited = time.monotonic() - t0
        stats = llm.stats()
    assert moved == expected
    assert before[1] not in after and len(set(after)) == 2  # rebuilt on the node that had room
    assert all(o.finish_reason == "error" for o in outs), [o.finish_reason for o in outs]
    assert waited < 240
    assert stats["kv_blocks_used"] == 0
