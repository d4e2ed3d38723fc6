"""SamplingParams, Request and SchedulerConfig validation: each bad field raises a ValueError naming it."""

import math

import pytest

from scheduler.protocol import MAX_LOGPROBS, WorkerSampling
from scheduler.request import MAX_N, Request, SamplingParams, choice_seed

BAD_PARAMS = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", True), ("max_tokens", "8"),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.5),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("top_k", -2), ("top_k", 1.0), ("top_k", False),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", "0.9"),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", None),
    ("seed", 1.5), ("seed", "7"),
    ("stop", 5), ("stop", [""]), ("stop", ["ok", 3]),
    ("stop_token_ids", "12"), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 5),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0),
    ("skip_special_tokens", None), ("skip_special_tokens", 0),
    ("presence_penalty", 3), ("presence_penalty", -2.5), ("presence_penalty", "1"),
    ("frequency_penalty", 2.01), ("frequency_penalty", math.nan),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("logit_bias", [[5, 1.0]]), ("logit_bias", "5"),
    ("n", 0), ("n", MAX_N + 1), ("n", 2.0), ("n", None),
]
BAD_LOGIT_BIAS = [({"abc": 1}, "'abc'"), ({"-3": 1}, "'-3'"), ({5: 200}, "200"), ({"5": "1"}, "'1'"),
                  ({1.5: 1}, "1.5"), ({"7": 1, "8": -100.5}, "-100.5"), ({"5": True}, "True")]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_each_bad_sampling_param_raises_naming_the_field(field, value):
    kwargs = {"max_tokens": 16, field: value}
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert field in str(e.value)
    assert repr(value) in str(e.value) or str(value) in str(e.value)


@pytest.mark.parametrize("value,shown", BAD_LOGIT_BIAS)
def test_each_bad_logit_bias_entry_is_named(value, shown):
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=value)
    assert str(e.value).startswith("logit_bias ") and shown in str(e.value)


def test_max_tokens_none_means_what_fits_and_must_be_resolved_before_scheduling():
    params = SamplingParams(max_tokens=None, min_tokens=100)
    assert params.max_tokens is None
    with pytest.raises(ValueError, match="max_tokens"):
        Request("r", [1, 2, 3], params)


def test_top_p_message_reads_like_the_design():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0}, {"top_k": 0}, {"top_k": -1}, {"top_p": 1}, {"min_p": 0}, {"min_p": 1},
    {"seed": 0}, {"seed": -5}, {"stop": "###"}, {"stop": None}, {"stop_token_ids": [1, 2]},
    {"logprobs": 0}, {"logprobs": MAX_LOGPROBS}, {"min_tokens": 16},
])
def test_valid_sampling_params_construct(kwargs):
    params = SamplingParams(max_tokens=16, **kwargs)
    assert isinstance(params.stop, tuple) and isinstance(params.stop_token_ids, tuple)


def test_logit_bias_takes_json_string_keys_and_reaches_the_worker_sorted():
    params = SamplingParams(logit_bias={"17": 5, 3: -100.0, "0": 100})
    assert params.logit_bias == {17: 5.0, 3: -100.0, 0: 100.0}
    ws = WorkerSampling.from_params(params, num_prompt_tokens=2)
    assert ws.logit_bias == ((0, 100.0), (3, -100.0), (17, 5.0)) and ws.has_penalties and not ws.counts_tokens
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match="at most 300"):
        SamplingParams(logit_bias={str(i): 1 for i in range(301)})
    with pytest.raises(ValueError, match="names token 5 twice"):
        SamplingParams(logit_bias={"5": 1, 5: 2})
    assert not WorkerSampling.from_params(SamplingParams(), num_prompt_tokens=2).has_penalties
    assert WorkerSampling.from_params(SamplingParams(repetition_penalty=1.1), num_prompt_tokens=2).counts_tokens


def test_min_tokens_becomes_a_position_ban_on_eos_and_stop_ids():
    params = SamplingParams(min_tokens=3, stop_token_ids=[9])
    ws = WorkerSampling.from_params(params, num_prompt_tokens=5, eos_token_ids=[1, 2])
    assert ws.ban_until == 5 + 3 and set(ws.banned_ids) == {1, 2, 9}
    ignoring = WorkerSampling.from_params(SamplingParams(min_tokens=3, ignore_eos=True), 5, [1, 2])
    assert ignoring.ban_until == 0 and ignoring.banned_ids == ()  # nothing left to ban


@pytest.mark.parametrize("prompt,field", [
    ([], "prompt"), ([1, -1], "prompt_token_ids"), ([1, 2**31], "prompt_token_ids"), ([1, "a"], "prompt_token_ids"),
    ([1, True], "prompt_token_ids"), ([2.0, 1], "prompt_token_ids"),
])
def test_bad_request_raises_naming_the_field(prompt, field):
    with pytest.raises(ValueError, match=field):
        Request("bad", prompt)


def test_request_params_must_be_sampling_params():
    with pytest.raises(ValueError, match="params"):
        Request("bad", [1], params={"max_tokens": 3})


def test_each_choice_gets_its_own_stable_seed():
    params = SamplingParams(n=4, seed=7, temperature=1.0)
    seeds = [params.choice(i).seed for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [choice_seed(7, i) for i in range(4)]  # a pure function of (seed, index)
    assert all(params.choice(i).n == 1 and params.choice(i).temperature == 1.0 for i in range(4))
    assert choice_seed(8, 1) != seeds[1]
    assert all(0 <= s < 2**63 for s in seeds)
    assert [SamplingParams(n=3).choice(i).seed for i in range(3)] == [None] * 3
