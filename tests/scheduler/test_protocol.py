"""StepPlan / StepResult: msgpack round trips, message size, malformed input."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.protocol import (
    PROTOCOL_VERSION,
    USE_RESIDENT,
    NewRequest,
    ProtocolError,
    RowLogprobs,
    ScheduledRow,
    StepPlan,
    StepResult,
    WorkerSampling,
    pack_int32,
    sampled_on_device,
    unpack_int32,
)
from scheduler.request import SamplingParams
from tests.factories import FakeRunner, make_requests, make_scheduler

int32s = st.integers(0, 2**31 - 1)
floats32 = st.floats(-1e6, 1e6, width=32)


def test_step_plan_round_trip_keeps_every_field():
    sampling = WorkerSampling.from_params(
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3, logprobs=5, min_tokens=2,
                       stop_token_ids=(9,), presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.3,
                       logit_bias={"12": -100, "7": 0.5}), num_prompt_tokens=4, eos_token_ids=(2, 3))
    plan = StepPlan(
        step_id=41,
        new_requests=[NewRequest(5, [1, 2, 3, 151_000], 0, [7, 8], sampling, 3)],
        rows=[ScheduledRow(5, 4, [], None), ScheduledRow(1, 1, [9], USE_RESIDENT), ScheduledRow(2, 1, [], 17)],
        finished=[3],
        preempted=[4, 6],
    )
    assert StepPlan.from_bytes(plan.to_bytes()) == plan


def test_step_result_round_trip_keeps_every_field():
    result = StepResult(
        step_id=7, slots=[0, 3], token_ids=pack_int32([11, 151_643]),
        logprobs=[RowLogprobs(1, -0.5, [151_643, 2], [-0.5, -1.25])],
        logits=bytes(range(16)), logits_shape=(2, 2), logits_dtype="bfloat16", step_time=0.25,
    )
    back = StepResult.from_bytes(result.to_bytes())
    assert back == result
    assert back.sampled_ids() == [11, 151_643]


@settings(max_examples=60, deadline=None)
@given(st.lists(int32s, max_size=50))
def test_int32_packing_round_trips(values):
    assert unpack_int32(pack_int32(values)) == values
    assert len(pack_int32(values)) == 4 * len(values)


@settings(max_examples=40, deadline=None)
@given(
    step_id=st.integers(0, 2**40),
    rows=st.lists(st.tuples(st.integers(0, 255), st.integers(1, 4096), st.lists(int32s, max_size=4),
                            st.one_of(st.none(), st.just(USE_RESIDENT), int32s)), max_size=20),
    finished=st.lists(st.integers(0, 255), max_size=5),
    tokens=st.lists(int32s, min_size=1, max_size=30),
)
def test_arbitrary_plans_round_trip(step_id, rows, finished, tokens):
    nr = NewRequest(0, tokens, 0, [1, 2], WorkerSampling(temperature=0.5, seed=None, banned_ids=(1, 2)))
    plan = StepPlan(step_id, [nr], [ScheduledRow(*r) for r in rows], finished, finished[::-1])
    assert StepPlan.from_bytes(plan.to_bytes()) == plan


@settings(max_examples=40, deadline=None)
@given(slots=st.lists(st.integers(0, 1023), max_size=64), step_time=floats32)
def test_arbitrary_results_round_trip(slots, step_time):
    result = StepResult(3, slots, pack_int32(range(len(slots))), logits_shape=(len(slots), 0), step_time=step_time)
    assert StepResult.from_bytes(result.to_bytes()) == result


def test_decode_result_for_64_rows_fits_5_bytes_a_row_plus_64():
    # the worst realistic case: large step id, slots up to 63, token ids near the vocab's end
    result = StepResult(2**31 - 1, list(range(64)), pack_int32([151_000 + i for i in range(64)]),
                        logits_shape=(64, 0), step_time=0.0123)
    assert len(result.to_bytes()) <= 64 * 5 + 64


def test_a_real_decode_step_result_for_64_rows_fits_the_bound():
    sched = make_scheduler(num_blocks=256, max_num_seqs=64, max_num_batched_tokens=2048)
    for r in make_requests(64, prompt_len=5, max_tokens=50, ignore_eos=True):
        sched.add_request(r)
    runner = FakeRunner.for_scheduler(sched)
    sched.update(runner.execute(sched.schedule()))  # every prompt fits one step
    plan = sched.schedule()
    assert len(plan.rows) == 64 and all(r.num_tokens == 1 for r in plan.rows)
    result = runner.execute(plan)
    assert len(result.slots) == 64
    assert len(result.to_bytes()) <= 64 * 5 + 64


def test_device_sampling_is_told_apart_from_host_logits():
    assert sampled_on_device(StepResult(0, [1], pack_int32([5]), logits_shape=(1, 0)))
    assert not sampled_on_device(StepResult(0, [1], b"", logits=bytes(8), logits_shape=(1, 2)))


@pytest.mark.parametrize("data", [
    b"",
    b"\xc1",  # never used in msgpack
    b"\x00",
    msgpack.packb([PROTOCOL_VERSION + 1, 0, [], [], [], []]),
    msgpack.packb([PROTOCOL_VERSION, 0, [], []]),
    msgpack.packb([PROTOCOL_VERSION, 0, [[0, b"\x01\x02\x03", 0, [], [0, -1, 1, 0, None, None, 0, []]]], [], [], []]),
    msgpack.packb([PROTOCOL_VERSION, 0, [], [[0, 1]], [], []]),
    msgpack.packb({"step_id": 0}),
])
def test_malformed_plans_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        StepPlan.from_bytes(data)


@pytest.mark.parametrize("data", [
    b"",
    b"\x93\x01",  # truncated array
    msgpack.packb([PROTOCOL_VERSION + 1, 0, [], b"", [], b"", [0, 0], "float32", 0.0, b"", b""]),
    msgpack.packb([PROTOCOL_VERSION, 0, [0], "not bytes", [], b"", [1, 0], "float32", 0.0, b"", b""]),
    msgpack.packb([PROTOCOL_VERSION, 0, [0], b"\x01", [], b"", [1, 0], "float32", 0.0, b"", b""]),
    msgpack.packb([PROTOCOL_VERSION, 0, [], b"", [[0, 1.0]], b"", [0, 0], "float32", 0.0, b"", b""]),
    msgpack.packb([PROTOCOL_VERSION, 0, [], b"", [], b"", [0], "float32", 0.0, b"", b""]),
    msgpack.packb([PROTOCOL_VERSION, 0, [], b"", [], b"", [0, 0], "float32", 0.0, [1], b""]),
    msgpack.packb([PROTOCOL_VERSION, 0, [], b"", [], b"", [0, 0], "float32", 0.0]),  # version 2's arity
])
def test_malformed_results_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        StepResult.from_bytes(data).sampled_ids()


def test_truncated_messages_raise_protocol_error():
    plan = StepPlan(1, rows=[ScheduledRow(0, 3, [1], None)]).to_bytes()
    result = StepResult(1, [0, 1], pack_int32([4, 5]), logits_shape=(2, 0)).to_bytes()
    for cut in range(len(plan)):
        with pytest.raises(ProtocolError):
            StepPlan.from_bytes(plan[:cut])
    for cut in range(len(result)):
        with pytest.raises(ProtocolError):
            StepResult.from_bytes(result[:cut])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_raise_anything_but_protocol_error(data):
    for decode in (StepPlan.from_bytes, StepResult.from_bytes):
        try:
            decode(data)
        except ProtocolError:
            pass


def test_a_grammar_travels_once_with_its_request_and_where_it_starts():
    from scheduler.grammar_spec import GrammarSpec

    spec = GrammarSpec("json_schema", '{"type": "object"}')
    sampling = WorkerSampling.from_params(SamplingParams(grammar=spec), num_prompt_tokens=4)
    assert (sampling.grammar, sampling.grammar_start) == (spec, 4)
    plan = StepPlan(step_id=1, new_requests=[NewRequest(0, [1, 2, 3, 4], 0, [7], sampling)],
                    rows=[ScheduledRow(0, 4, [], None)])
    assert StepPlan.from_bytes(plan.to_bytes()) == plan
    assert WorkerSampling.from_params(SamplingParams(), 4).grammar is None
    with pytest.raises(ValueError, match="grammar must be a GrammarSpec"):
        WorkerSampling(grammar="json").check()
    with pytest.raises(ValueError, match="grammar kind must be one of"):
        GrammarSpec("xml")
    with pytest.raises(ValueError, match="grammar_start"):
        WorkerSampling(grammar=spec, grammar_start=-1).check()
    with pytest.raises(ValueError, match="json_schema grammar needs a non-empty text"):
        GrammarSpec("json_schema", " ")
