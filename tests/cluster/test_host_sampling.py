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
