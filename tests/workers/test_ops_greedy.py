"""Each op table end to end: greedy through the runner equals HF token for token (fp32, the
bundled tiny model) through chunked prefills mixed with decode rows, block boundaries, prefix
hits and a preemption."""

from __future__ import annotations

import pytest

from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling
from tests import oracle
from tests.plans import PlanDriver
from tests.workers.test_ops import TABLES
from workers.loader import bundled_model_path
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig

BS = 4
NEW = 24
PROMPTS = [[5, 100, 200], list(range(10, 41)), [7] * 16, list(range(300, 345, 2)), [1200, 3, 800, 44, 9, 1]]


@pytest.fixture(scope="module")
def expected():
    return oracle.hf_greedy(bundled_model_path(), PROMPTS, NEW)


def make_runner(ops, **kw):
    return ModelRunner(RunnerConfig(ops=ops, block_size=BS, num_kv_blocks=256, max_num_seqs=8, **kw))


@pytest.mark.parametrize("ops", TABLES)
@pytest.mark.parametrize("chunk", [None, 3, 8], ids=["whole", "chunk3", "chunk8"])
def test_greedy_equals_hf_through_chunks_and_block_boundaries(ops, chunk, expected):
    runner = make_runner(ops)
    assert runner.stats()["ops"]["table"] == ops
    driver = PlanDriver(runner, chunk_size=chunk)
    for prompt in PROMPTS:
        driver.add(prompt)
    assert driver.generate(NEW) == expected


@pytest.mark.parametrize("ops", TABLES)
def test_greedy_equals_hf_after_a_prefix_hit(ops):
    path = bundled_model_path()
    driver = PlanDriver(make_runner(ops), chunk_size=5)
    first = driver.add(PROMPTS[1])
    driver.generate(3)
    k = 6
    second_prompt = PROMPTS[1][: k * BS] + [900, 901, 902]
    second = driver.add(second_prompt, cached_blocks=first.block_table[:k])
    driver.generate(NEW)
    assert second.outputs[:NEW] == oracle.hf_greedy(path, [second_prompt], NEW)[0]
    assert first.outputs[:NEW] == oracle.hf_greedy(path, [PROMPTS[1]], NEW)[0]


@pytest.mark.parametrize("ops", TABLES)
def test_greedy_equals_hf_after_a_preemption(ops, expected):
    runner = make_runner(ops)
    driver = PlanDriver(runner)
    req = driver.add(PROMPTS[3])
    driver.generate(5)
    tokens = PROMPTS[3] + req.outputs
    blocks = list(range(100, 100 + -(-(len(tokens) + 2) // BS)))
    plan = StepPlan(step_id=99, preempted=[req.slot],
                    new_requests=[NewRequest(req.slot, tokens, 0, blocks, WorkerSampling())],
                    rows=[ScheduledRow(req.slot, len(tokens))])
    assert runner.execute(plan).sampled_ids() == [expected[3][len(req.outputs)]]
    nxt = runner.execute(StepPlan(step_id=100, rows=[ScheduledRow(req.slot, 1, [], USE_RESIDENT)]))
    assert nxt.sampled_ids() == [expected[3][len(req.outputs) + 1]]
