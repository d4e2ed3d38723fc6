"""Speculative decoding (n-gram) on the worker: the config's vLLM keys and errors, prompt lookup,
and the bundled model's outputs with speculation equal to its outputs without, through prefix
hits, preemption, chunked prefill, pipelining and seeded sampling in the same batch."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.config import EngineConfig
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from tests.factories import drive
from tests.workers.tp_ranks import job, run_ranks
from workers.ngram import propose_ngram
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig
from workers.spec_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_config_takes_vllms_keys():
    cfg = SpeculativeConfig.from_dict(NGRAM)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 1, 3)
    one = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)  # the other bound follows the one given
    old = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2})
    assert old.method == "ngram"
    assert EngineConfig(speculative_config=NGRAM).scheduler_config(num_blocks=8, max_model_len=64) \
        .num_lookahead_tokens == 4


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, "method 'eagle3' is not supported yet"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2}, "'draft_model' is not supported yet"),
    ({"method": "beam", "num_speculative_tokens": 2}, "method must be one of ngram, got 'beam'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4 must be <= prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, "prompt_lookup_max must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "ngram", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 2}, "leave model unset"),
    ("ngram", "must be a mapping"),
])
def test_bad_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_speculation_with_pipeline_parallelism_is_refused_for_now():
    with pytest.raises(ValueError, match="pipeline_parallel_size 1 for now, got 2"):
        EngineConfig(speculative_config=NGRAM, pipeline_parallel_size=2)


def naive_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_equals_a_plain_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        for min_n, max_n, k in ((1, 3, 4), (2, 2, 1), (1, 5, 8)):
            assert propose_ngram(np.array(tokens), min_n=min_n, max_n=max_n, k=k) == \
                naive_lookup(tokens, min_n, max_n, k), tokens


PROMPTS = [[5, 100, 200, 5, 100, 200, 5, 100], list(range(10, 40)), [7] * 17, [1200, 3, 800, 44, 9, 1, 1200, 3],
           [5, 100, 200, 5, 100, 200, 5, 100, 300, 301]]


def generate(speculative, *, num_blocks=256, budget=64, depth=1, seeded=False, max_tokens=40):
    """Every prompt's output through a Scheduler and a ModelRunner of the bundled model, in-process."""
    runner = ModelRunner(RunnerConfig(block_size=4, num_kv_blocks=num_blocks, max_num_seqs=8,
                                      max_num_batched_tokens=budget, speculative=speculative))
    sched = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=4, max_num_seqs=8,
                                      max_num_batched_tokens=budget, max_model_len=runner.max_model_len,
                                      num_lookahead_tokens=0 if speculative is None else
                                      speculative.num_speculative_tokens))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    if seeded:
        reqs.append(Request("seeded", PROMPTS[0], SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=3,
                                                                 ignore_eos=True)))
    for r in reqs:
        sched.add_request(r)
    drive(sched, runner, depth=depth)
    return [r.output_token_ids for r in reqs], sched.stats(), runner.stats()


@pytest.fixture(scope="module")
def plain():
    return generate(None, seeded=True)[0]


@pytest.mark.parametrize("case", [
    {}, {"depth": 2}, {"budget": 7}, {"num_blocks": 30}, {"k": 1}, {"k": 8},
], ids=["whole", "pipelined", "chunked", "preempting", "k1", "k8"])
def test_greedy_outputs_equal_those_without_speculation(plain, case):
    case = dict(case)
    k = case.pop("k", 4)
    spec = SpeculativeConfig.from_dict({**NGRAM, "num_speculative_tokens": k})
    outputs, sched_stats, runner_stats = generate(spec, seeded=True, **case)
    assert outputs == plain
    worker = runner_stats["speculative"]
    assert worker["accepted_tokens"] > 0  # drafts were taken, so the equality above means something
    assert worker["accepted_tokens"] < worker["draft_tokens"]  # and some were refused
    assert (sched_stats["spec_draft_tokens"], sched_stats["spec_accepted_tokens"]) == \
        (worker["draft_tokens"], worker["accepted_tokens"])
    assert sched_stats["spec_mean_accepted_length"] > 1
    if case.get("num_blocks"):
        assert sched_stats["num_preemptions"] > 0
    assert sched_stats["kv_blocks_used"] == 0


def test_speculation_needs_device_outputs():
    with pytest.raises(ValueError, match="device outputs must be on"):
        ModelRunner(RunnerConfig(num_kv_blocks=16, device_outputs=False,
                                 speculative=SpeculativeConfig.from_dict(NGRAM)))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_draft_alike_and_equal_one_rank_without_speculation():
    runner_kw = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    spec = SpeculativeConfig.from_dict(NGRAM)
    ((plain, _),) = run_ranks(1, [job(runner_kw, PROMPTS, 24, scheduler={})])
    ((got, stats),) = run_ranks(2, [job(dict(runner_kw, speculative=spec), PROMPTS, 24,
                                        scheduler={"num_lookahead_tokens": 4})])
    assert got == plain
    assert stats["tensor_parallel_size"] == 2
    assert 0 < stats["speculative"]["accepted_tokens"] < stats["speculative"]["draft_tokens"]
