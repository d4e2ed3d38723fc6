"""A worker that fails inside a step (exits, raises, hangs): the replica replaces it and
greedy and seeded outputs come out as if nothing happened. Apart from test_reliability.py so
that make test's workers run the two files side by side."""

from __future__ import annotations

import time

import pytest

import cluster
from cluster import SamplingParams
from tests.cluster.faults import GREEDY, PROMPTS, SEEDED, N, arm_fault
from tests.oracle import hf_greedy_text

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def expected():
    return hf_greedy_text(PROMPTS, N)


# both ways a step reaches a worker: its step channel (the CPU's default) and Ray actor calls
CHANNELS = pytest.mark.parametrize("channel", ["socket", "ray"])


@CHANNELS
@pytest.mark.parametrize("kind", ["exit", "raise"])
def test_worker_failing_inside_a_step_recovers_greedy_and_seeded(ray_session, faulty_workers, expected, kind, channel):
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1, step_channel=channel) as llm:
        assert llm.stats()["replicas"][0]["info"]["step_channel"] == channel
        clean_seeded = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        arm_fault(llm, kind, after_steps=4)
        greedy = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        arm_fault(llm, kind, after_steps=6)
        seeded = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        stats = llm.stats()
    assert greedy == expected
    assert seeded == clean_seeded
    assert stats["worker_restarts"] == 2


@CHANNELS
def test_hung_worker_is_detected_by_the_step_timeout(ray_session, faulty_workers, expected, channel):
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1, step_timeout_s=3.0, step_channel=channel) as llm:
        llm.generate("warm", SamplingParams(max_tokens=2))  # compile/warm paths outside the timed window
        arm_fault(llm, "sleep", after_steps=3, seconds=600)
        t0 = time.monotonic()
        outs = llm.generate(PROMPTS, GREEDY)
        elapsed = time.monotonic() - t0
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["worker_restarts"] == 1
    assert elapsed < 60
