"""Tensor-parallel replicas through the engine: a replica is a group of worker actors (gloo
on the CPU, one thread each); outputs equal HF's; bytes pulled per decode step do not
change; 2 replicas x TP 2 place one rank per faked NPU. (A rank that dies, raises or hangs:
test_tensor_parallel_faults.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cluster
from cluster import SamplingParams
from tests.cluster.tp_workload import GREEDY, PENALIZED, PROMPTS, N
from tests.oracle import hf_greedy, hf_greedy_text
from workers.loader import bundled_model_path, load_tokenizer

pytestmark = pytest.mark.ray



@pytest.fixture(scope="module")
def expected():
    return hf_greedy_text(PROMPTS, N)


@pytest.mark.timeout(600)
def test_tp2_replica_matches_hf_and_pulls_the_same_bytes(ray_session, expected):
    stats, penalized = {}, {}
    for tp in (1, 2):
        with cluster.launch(num_kv_blocks=64, threads_per_worker=1, tensor_parallel_size=tp) as llm:
            # one request first: its decode steps have one row each, the same steps for any TP
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
            stats[tp] = llm.stats()
            outs = llm.generate(PROMPTS, GREEDY)
            info = llm.stats()["replicas"][0]["info"]
            penalized[tp] = [o.token_ids for o in llm.generate(PROMPTS, PENALIZED)]  # rank 0 counts them
        assert [o.token_ids for o in outs] == expected
    assert penalized[2] == penalized[1]
    assert stats[2]["tensor_parallel_size"] == 2
    ranks = info["ranks"]
    assert len(ranks) == 2 and len({r["pid"] for r in ranks}) == 2 and len({r["node_id"] for r in ranks}) == 1
    assert stats[2]["decode_steps"] == stats[1]["decode_steps"] > 0
    assert stats[2]["bytes_pulled_per_decode_step"] == stats[1]["bytes_pulled_per_decode_step"] > 0


def test_tp_that_does_not_divide_the_heads_is_refused_before_any_actor_starts(ray_session):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide num_attention_heads \(4\)"):
        cluster.launch(tensor_parallel_size=3, threads_per_worker=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        cluster.launch(tensor_parallel_size=0)


@pytest.mark.heavy
@pytest.mark.timeout(900)  # a Ray of its own and four actors
def test_two_replicas_of_tp2_take_one_faked_npu_per_rank(expected):
    root = Path(__file__).resolve().parents[2]
    tok = load_tokenizer(bundled_model_path())
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.tp_four_npus"], input=json.dumps([ids, N]), cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    visible = [r["visible"] for rep in got["ranks"] for r in rep]
    assert sorted(visible) == ["0", "1", "2", "3"]  # one NPU per rank, none shared
    assert all(len({r["node"] for r in rep}) == 1 for rep in got["ranks"])  # each group on one node
    assert all(s > 0 for s in got["steps"])  # both replicas served
    assert got["outputs"] == hf_greedy(bundled_model_path(), ids, N)  # ignore_eos: N tokens each
