"""Whatever the API accepts, the worker can run: a property test over generated request bodies.

Each example is a /v1/completions body whose sampling fields are drawn from edge values (huge
and negative integers, floats at and past float32's range, NaN, infinities, ids past the vocab).
It goes where a served request goes: parsed by the API's model, turned into SamplingParams,
checked against the model (cluster.core.engine.make_request), scheduled, encoded into StepPlan bytes,
decoded and run by the bundled tiny model's ModelRunner, which samples on its device, and the
result applied by the scheduler. A body is either refused with a ValueError naming a field at
the boundary, or every step of it runs without an exception. No Ray.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cluster.core.engine import make_request
from cluster.openai.api_models import CompletionRequest
from scheduler.protocol import StepPlan, StepResult
from scheduler.request import FinishReason
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig

STEPS = 3  # steps run per accepted body: admission (prefill + first sample), then decodes

BIG_INTS = [-(2**70), -(2**63) - 1, -(2**63), -(2**31), -2, -1, 0, 1, 2, 20, 2047, 2048, 2**31 - 1, 2**31,
            2**63 - 1, 2**63, 2**64, 2**70]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e-45, 1e-39, 1e-5, 1e-3, 0.5, 1.0, 2.0, 100.0, 1e3, 1e4, 3.4e38, 3.5e38, 1e308,
               -1e308, -1.0, float("inf"), float("-inf"), float("nan")]
ints = st.one_of(st.sampled_from(BIG_INTS), st.integers(-(2**80), 2**80))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
anything = st.one_of(ints, floats)


def mostly(valid, edge=anything):
    """Values the API accepts, at and near the ends of their ranges, and now and then anything."""
    return st.one_of(valid, valid, valid, edge)


def ends(low, high, *inner):
    return st.one_of(st.sampled_from([low, high, *inner]), st.floats(low, high))


token_ids = mostly(st.one_of(st.sampled_from([0, 1, 2, 2046, 2047]), st.integers(0, 2047)), ints)
FIELDS = {
    "temperature": mostly(ends(0.0, 3.4028234663852886e38, 1e-45, 1e-39, 1e-5, 1e-3, 1e30)),
    "top_p": mostly(ends(5e-324, 1.0, 1e-300, 1e-8)),
    "top_k": mostly(st.one_of(st.sampled_from([-1, 0, 1, 2047, 2048, 2**31 - 1]), st.integers(-1, 2**31 - 1)), ints),
    "min_p": mostly(ends(0.0, 1.0, 5e-324, 1e-300)),
    "seed": mostly(st.one_of(st.sampled_from([-(2**63), -1, 0, 2**63 - 1]), st.integers(-(2**63), 2**63 - 1)), ints),
    "max_tokens": mostly(st.sampled_from([1, 2, 16, 4092]), ints),
    "min_tokens": mostly(st.sampled_from([0, 1, 2, 16]), ints),
    "logprobs": mostly(st.integers(0, 20), ints),
    "n": mostly(st.integers(1, 3), st.sampled_from([0, 17, 2**70])),
    "presence_penalty": mostly(ends(-2.0, 2.0)),
    "frequency_penalty": mostly(ends(-2.0, 2.0)),
    "repetition_penalty": mostly(ends(1e-3, 1e3, 1.0)),
    "stop_token_ids": st.lists(token_ids, max_size=4),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(mostly(token_ids.map(str), st.text(max_size=3)), mostly(ends(-100.0, 100.0)),
                                  max_size=3),
}
bodies = st.fixed_dictionaries({"model": st.just("tiny"), "prompt": st.lists(token_ids, max_size=4)},
                               optional=FIELDS)


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(RunnerConfig(device="cpu", block_size=16, num_kv_blocks=64, max_num_seqs=4))
    yield r
    r.close()


def run_to_completion_or_steps(runner: ModelRunner, requests) -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=16, max_num_seqs=4,
                                      max_num_batched_tokens=256, max_model_len=runner.max_model_len))
    for r in requests:
        sched.add_request(r)
    for _ in range(STEPS):
        plan = sched.schedule()
        if plan is None:
            break
        result = runner.execute(StepPlan.from_bytes(plan.to_bytes()))  # over the wire, as a worker gets it
        sched.update(StepResult.from_bytes(result.to_bytes()))
    for r in requests:  # what is left is aborted, which the worker must take too
        sched.finish(r.request_id, FinishReason.ABORT)
    plan = sched.schedule()
    if plan is not None:
        runner.execute(StepPlan.from_bytes(plan.to_bytes()))


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_a_body_is_refused_naming_a_field_or_runs_on_the_worker(runner, body):
    try:
        req = CompletionRequest.model_validate_json(json.dumps(body))
    except ValidationError:
        event("refused by the API's model")
        return  # the HTTP layer's 400, naming the field (tests/cluster/test_server.py)
    try:
        params = req.sampling_params(16, req.logprobs)
        requests = [make_request(f"r{i}", list(req.prompts()[0]), params.choice(i), vocab_size=runner.vocab_size,
                                 max_model_len=runner.max_model_len, eos_token_ids={2}) for i in range(params.n)]
    except ValueError as e:
        assert str(e).split(" ", 1)[0].split("=", 1)[0].rstrip(":") in {
            *FIELDS, "prompt", "prompt_token_ids", "logit_bias", "params.n"}, str(e)
        event("refused naming a field")
        return
    event("accepted and run")
    run_to_completion_or_steps(runner, requests)
