"""A tensor-parallel rank that dies, raises or hangs takes its group down; the group is rebuilt
and outputs stay the same. Its own file so that xdist runs its four engine starts beside the
other tensor-parallel tests."""

from __future__ import annotations

import pytest

import cluster
from tests.cluster.faults import generate_in_background, wait_for_tokens
from tests.cluster.tp_workload import GREEDY, PROMPTS, SEEDED, N
from tests.oracle import hf_greedy_text

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def expected():
    return hf_greedy_text(PROMPTS, N)


@pytest.mark.heavy
@pytest.mark.timeout(900)  # four engine starts of two actors each
def test_a_rank_that_dies_raises_or_hangs_is_rebuilt_with_the_same_outputs(ray_session, expected, faulty_workers):
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1, tensor_parallel_size=2, step_timeout_s=15.0) as llm:
        rep = llm.engine.replicas[0]
        clean_seeded = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        # killed from outside mid-generation: rank 0 is left waiting in a collective
        t, box = generate_in_background(llm, PROMPTS, GREEDY)
        wait_for_tokens(llm, llm.stats()["generated_tokens"] + 3, timeout=120)
        ray_session.kill(rep.workers[1], no_restart=True)
        t.join(timeout=300)
        killed = [o.token_ids for o in box["outs"]]
        # raises inside a step, then hangs inside a step (the step timeout catches it)
        ray_session.get(rep.workers[1].arm_fault.remote("raise", after_steps=4))
        raised = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        ray_session.get(rep.workers[1].arm_fault.remote("sleep", after_steps=3, seconds=600))
        hung = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        stats = llm.stats()
    assert killed == expected and hung == expected
    assert raised == clean_seeded
    assert stats["worker_restarts"] == 3
    assert stats["kv_blocks_used"] == 0
