"""Qwen3-MoE through the engine (Ray workers): greedy equals HF through prefix hits and
preemption; n, penalties and grammars work; a killed rank of an expert-parallel TP 2 replica is
rebuilt and its requests recompute to identical tokens."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster import SamplingParams
from scheduler.grammar_spec import GrammarSpec
from tests import oracle
from tests.cluster.faults import generate_in_background, wait_for_tokens
from tests.workers.moe_checkpoints import write_checkpoint
from workers.loader import load_tokenizer

pytestmark = pytest.mark.ray

PROMPTS = ["北京故宫是", "Hello there", "The quick brown fox jumps over the lazy dog", "Once upon a time",
           "def add(a, b):"]
N = 20
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_checkpoint("engine", tmp_path_factory.mktemp("moe_engine") / "engine")


@pytest.fixture(scope="module")
def prompt_ids(moe):
    tok = load_tokenizer(moe)
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(moe, prompt_ids):
    return oracle.hf_greedy(moe, prompt_ids, N)


@pytest.mark.timeout(600)
def test_greedy_equals_hf_through_prefix_hits_and_preemption_and_features_work(ray_session, moe, prompt_ids,
                                                                                expected):
    with cluster.launch(model=moe, num_kv_blocks=8, block_size=4, max_num_seqs=8, threads_per_worker=1) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        preempted = llm.stats()["num_preemptions"]
        again = llm.generate(PROMPTS[2], GREEDY)  # its prompt's full blocks are cached by now
        stats = llm.stats()
        seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2)
        choices = [[c.token_ids for c in llm.generate(PROMPTS[1], seeded).outputs] for _ in range(2)]
        penalized = llm.generate(PROMPTS[3], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True,
                                                            repetition_penalty=1.3)).outputs[0].token_ids
        structured = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0,
                                                             grammar=GrammarSpec("json_object"))).outputs[0].text
        info = stats["replicas"][0]["info"]
    assert preempted > 0  # eight blocks of four tokens do not hold five requests at once
    assert again.outputs[0].token_ids == expected[2] and stats["prefix_hit_tokens"] > 0
    assert choices[0] == choices[1] and choices[0][0] != choices[0][1]
    hf = oracle.hf_model(moe)
    with torch.inference_mode():
        x = torch.tensor([prompt_ids[3]])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                           repetition_penalty=1.3, pad_token_id=0)[0, x.shape[1]:].tolist()
    assert penalized == want
    assert structured.lstrip().startswith("{")
    assert info["moe"]["num_experts"] == 8 and info["moe"]["local_experts"] == 8


@pytest.mark.timeout(900)
def test_a_killed_rank_of_an_expert_parallel_replica_recomputes_identical_tokens(ray_session, moe, expected,
                                                                                faulty_workers):
    with cluster.launch(model=moe, num_kv_blocks=64, threads_per_worker=1, tensor_parallel_size=2,
                        enable_expert_parallel=True, step_timeout_s=15.0) as llm:
        rep = llm.engine.replicas[0]
        info = llm.stats()["replicas"][0]["info"]
        t, box = generate_in_background(llm, PROMPTS, GREEDY)
        wait_for_tokens(llm, 3, timeout=120)
        ray_session.kill(rep.workers[1], no_restart=True)
        t.join(timeout=300)
        killed = [o.token_ids for o in box["outs"]]
        stats = llm.stats()
    assert info["moe"]["expert_parallel"] and info["moe"]["local_experts"] == 4
    assert killed == expected
    assert stats["worker_restarts"] == 1 and stats["kv_blocks_used"] == 0
