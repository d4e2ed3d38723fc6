"""SlotTable: the worker's per-slot view of its requests, applying a StepPlan's diffs after
checking the whole plan. Pure Python: no torch, no Ray."""

from __future__ import annotations

import copy

import pytest

from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling
from workers.slot_table import SlotTable

BS = 4


def make_table(**kw) -> SlotTable:
    kw = {"max_num_seqs": 4, "num_blocks": 16, "block_size": BS, "max_model_len": 32, "vocab_size": 100, **kw}
    return SlotTable(**kw)


def new(slot: int, tokens, computed: int = 0, blocks=(0, 1, 2), sampling=None, num_prompt=None) -> NewRequest:
    return NewRequest(slot, list(tokens), computed, list(blocks), sampling or WorkerSampling(), num_prompt)


def admitted(table: SlotTable, slot: int = 0, tokens=range(10, 16)) -> SlotTable:
    """`slot` holds a prompt of six tokens, all computed in one prefill."""
    table.apply(StepPlan(0, new_requests=[new(slot, tokens, blocks=(slot * 4, slot * 4 + 1))],
                         rows=[ScheduledRow(slot, len(tokens))]))
    return table


def test_a_prefill_in_chunks_samples_only_when_every_known_token_is_computed():
    table = make_table()
    (w,) = table.apply(StepPlan(0, new_requests=[new(1, range(10, 20), computed=4)], rows=[ScheduledRow(1, 3)]))
    assert (w.slot, w.start, w.num_tokens, w.token, w.samples, w.is_decode) == (1, 4, 3, None, False, False)
    (w,) = table.apply(StepPlan(1, rows=[ScheduledRow(1, 3)]))
    assert (w.start, w.num_tokens, w.samples) == (7, 3, True)
    assert table.states[1].num_computed == 10 and len(table) == 1


def test_decode_rows_take_a_token_or_the_resident_one_and_new_blocks_extend_the_table():
    table = admitted(make_table())
    (w,) = table.apply(StepPlan(1, rows=[ScheduledRow(0, 1, [5], 42)]))
    assert (w.start, w.token, w.samples, w.is_decode) == (6, 42, True, True)
    assert table.states[0].block_table == [0, 1, 5] and table.states[0].num_computed == 7
    with pytest.raises(ValueError, match="uses the resident token, but this worker has sampled none"):
        table.apply(StepPlan(2, rows=[ScheduledRow(0, 1, [], USE_RESIDENT)]))
    table.states[0].has_resident = True  # what the runner records once it sampled for the slot
    (w,) = table.apply(StepPlan(2, rows=[ScheduledRow(0, 1, [], USE_RESIDENT)]))
    assert w.token == USE_RESIDENT and w.start == 7


def test_finished_and_preempted_slots_are_dropped_and_may_be_readmitted_in_the_same_plan():
    table = admitted(admitted(make_table(), 0), 1)
    table.apply(StepPlan(1, finished=[0], preempted=[1]))
    assert len(table) == 0
    table = admitted(make_table(), 2)
    (w,) = table.apply(StepPlan(1, finished=[2], new_requests=[new(2, [7, 8, 9])], rows=[ScheduledRow(2, 3)]))
    assert table.states[2].token_ids == [7, 8, 9] and w.samples
    table.clear()
    assert len(table) == 0


BAD_PLANS = {
    "slot out of range": (StepPlan(1, new_requests=[new(4, [1, 2])]), "slot 4 is outside \\[0, 4\\)"),
    "occupied slot": (StepPlan(1, new_requests=[new(0, [1, 2])]), "slot 0, which still holds a request"),
    "admitted twice": (StepPlan(1, new_requests=[new(2, [1]), new(2, [1])]), "slot 2 is admitted twice"),
    "no tokens": (StepPlan(1, new_requests=[new(2, [])]), "has no tokens"),
    "too long": (StepPlan(1, new_requests=[new(2, [1] * 33)]), "more than max_model_len 32"),
    "token outside vocab": (StepPlan(1, new_requests=[new(2, [1, 100])]), "token id 100 is outside"),
    "all computed": (StepPlan(1, new_requests=[new(2, [1, 2], computed=2)]), "num_computed 2 must be in"),
    "too few blocks": (StepPlan(1, new_requests=[new(2, range(9), computed=8, blocks=[3])]),
                       "1 blocks cannot hold its 8 computed tokens"),
    "block outside pool": (StepPlan(1, new_requests=[new(2, [1], blocks=[16])]), "block id 16 is outside"),
    "bias outside vocab": (StepPlan(1, new_requests=[new(2, [1], sampling=WorkerSampling(logit_bias=((100, 1.0),)))]),
                           "logit_bias token id 100 is outside \\[0, 100\\)"),
    "ban outside vocab": (StepPlan(1, new_requests=[new(2, [1], sampling=WorkerSampling(ban_until=5,
                                                                                     banned_ids=(3, 100)))]),
                          "banned id 100 is outside \\[0, 100\\)"),
    "bias out of range": (StepPlan(1, new_requests=[new(2, [1], sampling=WorkerSampling(logit_bias=((5, 101.0),)))]),
                          "logit_bias values must be numbers in \\[-100, 100\\], got 101.0"),
    "bad penalty": (StepPlan(1, new_requests=[new(2, [1], sampling=WorkerSampling(repetition_penalty=0.0))]),
                    "repetition_penalty must be a number in \\[0.001, 1000\\]"),
    "prompt longer than tokens": (StepPlan(1, new_requests=[new(2, [1, 2], num_prompt=3)]),
                                  "num_prompt 3 must be in \\[1, 2\\]"),
    "empty prompt": (StepPlan(1, new_requests=[new(2, [1, 2], num_prompt=0)]), "num_prompt 0 must be in"),
    "empty slot row": (StepPlan(1, rows=[ScheduledRow(3, 1)]), "slot 3, which holds no request"),
    "scheduled twice": (StepPlan(1, rows=[ScheduledRow(0, 1, [], 5), ScheduledRow(0, 1, [], 5)]),
                        "slot 0 is scheduled twice"),
    "zero tokens": (StepPlan(1, rows=[ScheduledRow(0, 0, [], 5)]), "num_tokens must be an integer >= 1"),
    "decode of two": (StepPlan(1, rows=[ScheduledRow(0, 2, [], 5)]), "num_tokens 2, expected 1"),
    "prefill past known": (StepPlan(1, rows=[ScheduledRow(0, 1)]), "asks for 1 tokens but only 0"),
    "decode token outside vocab": (StepPlan(1, rows=[ScheduledRow(0, 1, [], 100)]), "token 100 is outside"),
    "new block outside pool": (StepPlan(1, rows=[ScheduledRow(0, 1, [-1], 5)]), "block id -1 is outside"),
    "dropped slot row": (StepPlan(1, finished=[0], rows=[ScheduledRow(0, 1, [], 5)]), "holds no request"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_a_bad_plan_is_refused_whole_and_changes_nothing(case):
    plan, message = BAD_PLANS[case]
    table = admitted(make_table())
    before = copy.deepcopy(table.states)
    with pytest.raises(ValueError, match=message):
        table.apply(plan)
    assert table.states == before


def test_a_row_beyond_its_blocks_or_the_model_length_is_refused():
    for max_len, row, message in [(32, ScheduledRow(0, 1, [], 5), "2 blocks of 4 cannot hold 9 tokens"),
                                  (8, ScheduledRow(0, 1, [6], 5), "reaches position 8, beyond max_model_len 8")]:
        table = admitted(make_table(max_model_len=max_len))
        table.apply(StepPlan(1, rows=[ScheduledRow(0, 1, [], 5)]))
        table.apply(StepPlan(2, rows=[ScheduledRow(0, 1, [], 5)]))  # position 7: the last of two blocks
        with pytest.raises(ValueError, match=message):
            table.apply(StepPlan(3, rows=[row]))


def test_one_bad_row_leaves_the_good_rows_and_admissions_unapplied():
    table = admitted(make_table())
    before = copy.deepcopy(table.states)
    plan = StepPlan(1, new_requests=[new(1, [1, 2, 3])], rows=[ScheduledRow(1, 3), ScheduledRow(0, 1, [], 100)])
    with pytest.raises(ValueError, match="token 100"):
        table.apply(plan)
    assert table.states == before


def test_a_plan_over_the_token_budget_is_refused_before_anything_changes():
    table = admitted(make_table(max_num_batched_tokens=8), slot=0)
    before = copy.deepcopy(table.states)
    plan = StepPlan(3, new_requests=[new(1, range(20, 30), blocks=(4, 5, 6))], rows=[ScheduledRow(1, 9)])
    with pytest.raises(ValueError, match="step 3 schedules 9 tokens, more than max_num_batched_tokens 8"):
        table.apply(plan)
    assert table.states == before
    assert len(make_table().apply(plan)) == 1  # without a budget the same plan applies


def test_a_slots_known_array_follows_what_is_appended():
    """known_array: the tokens sent then those sampled, as they grow (kept between calls)."""
    from scheduler.protocol import WorkerSampling
    from workers.slot_table import SlotState

    state = SlotState([4, 5, 6], 3, [0], WorkerSampling(), 3)
    assert state.known_array().tolist() == [4, 5, 6]
    state.generated.append(9)
    assert state.known_array().tolist() == [4, 5, 6, 9]
    state.generated += list(range(100, 300))  # past the buffer's room: it grows
    assert state.known_array().tolist() == [4, 5, 6, 9, *range(100, 300)]
    assert state.known_array().tolist() == state.known_tokens(0, 204)
