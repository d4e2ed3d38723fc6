"""One request must never take a replica down for good: a request that makes every worker it
reaches fail (or the driver's step loop itself) is failed after `max_request_failures`
failures in a row, naming it; the requests beside it are recomputed to the same tokens, and
the replica serves on. The poison is simulated by worker actors (tests/cluster/faults.py)
that fail any step admitting a request whose prompt holds POISON_TOKEN."""

from __future__ import annotations

import pytest

import cluster
from cluster import SamplingParams
from tests.cluster.faults import POISON_EXIT_WORKER, POISON_GARBAGE_WORKER, POISON_TOKEN
from workers.actor import WORKER_ACTOR_ENV

pytestmark = pytest.mark.ray

PROMPTS = [list(range(10, 30)), list(range(100, 140)), [5, 6, 7, 8]]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.mark.parametrize("worker, loop_failures", [(POISON_EXIT_WORKER, 0), (POISON_GARBAGE_WORKER, 2)],
                         ids=["worker-exits", "step-loop-fails"])
def test_a_poison_pill_fails_alone_and_the_rest_recompute_unchanged(ray_session, monkeypatch, worker, loop_failures):
    monkeypatch.setenv(WORKER_ACTOR_ENV, worker)
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1, restart_backoff_s=0.1) as llm:
        expected = llm.generate(PROMPTS, GREEDY)
        outs = llm.generate(PROMPTS + [[3, 4, POISON_TOKEN, 5]], GREEDY)  # the pill among them, all at once
        stats, health, metrics = llm.stats(), llm.health(), llm.metrics_text().decode()
        after = llm.generate(PROMPTS[:1], GREEDY)
    assert [(o.token_ids, o.finish_reason) for o in outs[:3]] == [(o.token_ids, o.finish_reason) for o in expected]
    pill = outs[3]
    assert pill.finish_reason == "error" and pill.token_ids == []
    assert pill.request_id in pill.error and "2 failures" in pill.error and "max_request_failures" in pill.error
    assert stats["poisoned_requests"] == 1 and stats["suspect_requests"] == 0
    assert stats["worker_restarts"] == 2 and stats["loop_failures"] == loop_failures
    assert health["status"] == "ok" and stats["replicas"][0]["last_error"]
    assert "raylm_poisoned_requests_total 1.0" in metrics
    assert f"raylm_step_loop_failures_total {float(loop_failures)}" in metrics
    assert after[0].token_ids == expected[0].token_ids  # and it serves on


def test_max_request_failures_is_validated():
    with pytest.raises(ValueError, match="max_request_failures must be an integer >= 1, got 0"):
        cluster.EngineConfig(max_request_failures=0)
