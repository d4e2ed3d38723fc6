"""Host-logits mode (device_outputs=False): the driver samples, one Sampler per replica.

A seeded request's tokens depend only on its seed, its positions and the logits, so they
must be the same from run to run and with one replica or two. A Sampler shared by the
replicas' loop threads breaks that: one thread reseeds the per-row generator while another
draws from it.
"""

from __future__ import annotations

import pytest

import cluster
from cluster import SamplingParams

pytestmark = pytest.mark.ray

PROMPTS = ["北京故宫是", "Hello", "Once upon a time", "def fibonacci(n):", "The quick brown fox", "数据并行"]
NUM_REQUESTS = 24


def _seeded_outputs(llm) -> list[list[int]]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_REQUESTS)]
    params = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(NUM_REQUESTS)]
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_seeded_requests_sample_the_same_with_one_or_two_replicas(ray_session):
    opts = dict(device_outputs=False, num_kv_blocks=128, threads_per_worker=1, max_num_seqs=16)
    with cluster.launch(num_replicas=1, **opts) as llm:
        one = _seeded_outputs(llm)
    with cluster.launch(num_replicas=2, **opts) as llm:
        assert llm.stats()["device_outputs"] is False
        first = _seeded_outputs(llm)
        second = _seeded_outputs(llm)
        assert all(r["generated_tokens"] > 0 for r in llm.stats()["replicas"]), "routing used one replica only"
    assert all(len(t) == 24 for t in one)
    assert first == second
    assert first == one


def test_penalties_sample_the_same_on_the_device_under_preemption_and_on_the_driver(ray_session):
    """Seeded and greedy requests with penalties and logit_bias: host-logits mode (the driver
    counts each request's history) and device sampling in a KV pool small enough to preempt
    (recomputed requests rebuild their counts on the worker) give the same tokens."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, seed=50 + i, temperature=[0.0, 0.9][i % 2],
                             frequency_penalty=[2.0, 0.5, 0.0, -1.0][i % 4], presence_penalty=[0.0, 1.0][i % 2],
                             repetition_penalty=[1.0, 1.5, 1.2, 1.0][i % 4],
                             logit_bias={"13": 3.0, "2039": -5.0} if i % 3 == 0 else None)
              for i in range(8)]
    plain = [SamplingParams(max_tokens=20, ignore_eos=True, seed=p.seed, temperature=p.temperature) for p in params]
    opts = dict(num_replicas=1, threads_per_worker=1, max_num_seqs=8)
    with cluster.launch(device_outputs=False, num_kv_blocks=128, **opts) as llm:
        host = [o.token_ids for o in llm.generate(prompts, params)]
        unpenalized = [o.token_ids for o in llm.generate(prompts, plain)]
    with cluster.launch(device_outputs=True, num_kv_blocks=14, block_size=4, **opts) as llm:
        device = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    assert device == host
    assert sum(u != d for u, d in zip(unpenalized, device)) >= 4  # the penalties changed what was sampled
