"""build_step_inputs on the CPU, without Ray or a model: the flat batch (decode rows first,
then prefill chunks in plan order), KV slots from the block tables, resident tokens taken
from the device buffer, and which rows sample, all checked against a plain-Python reading
of the same rows."""

from __future__ import annotations

import torch

from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling
from workers.slot_table import SlotTable
from workers.staging import StepStaging
from workers.step_inputs import build_step_inputs

BS = 4
CPU = torch.device("cpu")


def table() -> SlotTable:
    return SlotTable(max_num_seqs=8, num_blocks=32, block_size=BS, max_model_len=64, vocab_size=1000)


def admit(t: SlotTable, slot: int, prompt: list[int], blocks: list[int]) -> None:
    """`slot` holds `prompt`, computed in one prefill, and a resident token sampled after it."""
    t.apply(StepPlan(0, new_requests=[NewRequest(slot, prompt, 0, blocks, WorkerSampling())],
                     rows=[ScheduledRow(slot, len(prompt))]))
    t.states[slot].has_resident = True


def expected_batch(rows, last_tokens):
    """(input ids, positions, KV slots, index of each row's last token) in the flat order."""
    ordered = [w for w in rows if w.is_decode] + [w for w in rows if not w.is_decode]
    ids, pos, kv, last = [], [], [], {}
    for w in ordered:
        for p in range(w.start, w.start + w.num_tokens):
            if w.token is None:
                ids.append(w.state.token_ids[p])
            else:
                ids.append(int(last_tokens[w.slot]) if w.token == USE_RESIDENT else w.token)
            pos.append(p)
            kv.append(w.state.block_table[p // BS] * BS + p % BS)
        last[w.slot] = len(ids) - 1
    return ids, pos, kv, last


def mixed_rows():
    t = table()
    admit(t, 0, list(range(100, 106)), [0, 1])  # 6 tokens: decodes at position 6
    admit(t, 3, list(range(200, 209)), [2, 3, 4])  # 9 tokens: decodes at position 9
    plan = StepPlan(1, new_requests=[NewRequest(5, list(range(300, 311)), 4, [5, 6, 7], WorkerSampling()),
                                     NewRequest(6, list(range(400, 403)), 0, [8], WorkerSampling())],
                    rows=[ScheduledRow(5, 5),  # a chunk after a 4-token prefix hit: does not sample yet
                          ScheduledRow(3, 1, [], 77),  # a decode row with the driver's token
                          ScheduledRow(6, 3),  # a whole prompt: samples
                          ScheduledRow(0, 1, [], USE_RESIDENT)])  # a decode row on the resident token
    return t.apply(plan)


def test_the_flat_batch_puts_decodes_first_and_maps_every_token_to_its_kv_slot():
    rows = mixed_rows()
    last_tokens = torch.arange(1000, 1008, dtype=torch.int64)  # slot s holds 1000 + s
    inputs = build_step_inputs(rows, block_size=BS, last_tokens=last_tokens, staging=StepStaging(CPU))
    ids, pos, kv, last = expected_batch(rows, last_tokens)
    assert inputs.num_tokens == len(ids) == 1 + 1 + 5 + 3
    assert inputs.input_ids.tolist() == ids and ids[1] == 1000  # slot 0's resident token, filled in
    assert inputs.positions.tolist() == pos
    assert inputs.attn.slot_mapping.tolist() == kv


def test_the_rows_that_sample_keep_plan_order_and_point_at_their_last_token():
    rows = mixed_rows()
    inputs = build_step_inputs(rows, block_size=BS, last_tokens=torch.zeros(8, dtype=torch.int64),
                               staging=StepStaging(CPU))
    _, _, _, last = expected_batch(rows, torch.zeros(8))
    sampling = [w for w in rows if w.samples]
    assert [w.slot for w in sampling] == [3, 6, 0]  # slot 5's chunk leaves 2 prompt tokens uncomputed
    assert inputs.slots == inputs.sample_slots.tolist() == [3, 6, 0]
    assert inputs.logits_indices.tolist() == [last[s] for s in (3, 6, 0)]
    assert inputs.work == sampling


def test_the_callers_sampling_parts_ride_in_the_same_copy():
    rows = mixed_rows()
    staging = StepStaging(CPU)
    inputs = build_step_inputs(rows, block_size=BS, last_tokens=torch.zeros(8, dtype=torch.int64), staging=staging,
                               sampling_ints=[[3, 6], [], [9]], sampling_floats=[[0.5, 0.25], [2.0]])
    assert [t.tolist() for t in inputs.sampling_ints] == [[3, 6], [], [9]]
    assert [t.tolist() for t in inputs.sampling_floats] == [[0.5, 0.25], [2.0]]
    assert inputs.sampling_floats[0].dtype == torch.float32 and staging.num_allocations == 1


def test_attention_metadata_lists_decode_rows_then_chunks_with_padded_block_tables():
    rows = mixed_rows()
    inputs = build_step_inputs(rows, block_size=BS, last_tokens=torch.zeros(8, dtype=torch.int64),
                               staging=StepStaging(CPU))
    attn = inputs.attn
    assert attn.num_decode == 2 and attn.num_tokens == inputs.num_tokens == 10
    # slot 3 decodes at position 9, slot 0 at 6; slot 5's chunk of 5 after a 4-token hit; slot 6's whole prompt of 3
    assert attn.query_start_loc.tolist() == [0, 1, 2, 7, 10]
    assert attn.seq_lens.tolist() == [10, 7, 9, 3] and attn.seq_lens_host == [10, 7, 9, 3]
    assert attn.query_lens_host == [1, 1, 5, 3]
    assert attn.block_tables.dtype == torch.int32 and attn.query_start_loc.dtype == torch.int32
    # each row's blocks covering its keys, padded with block 0 to the longest
    assert attn.block_tables.tolist() == [[2, 3, 4], [0, 1, 0], [5, 6, 7], [8, 0, 0]]


def test_an_all_decode_step_samples_every_row_in_place():
    t = table()
    for s in (1, 2):
        admit(t, s, list(range(10 * s, 10 * s + 7)), [s * 2, s * 2 + 1])  # decodes at position 7
    rows = t.apply(StepPlan(1, rows=[ScheduledRow(2, 1, [], USE_RESIDENT), ScheduledRow(1, 1, [], USE_RESIDENT)]))
    last_tokens = torch.tensor([0, 11, 22, 0, 0, 0, 0, 0])
    inputs = build_step_inputs(rows, block_size=BS, last_tokens=last_tokens, staging=StepStaging(CPU))
    assert inputs.logits_indices is None  # the flat batch is the sampling batch
    assert inputs.input_ids.tolist() == [22, 11] and inputs.positions.tolist() == [7, 7]
    assert inputs.attn.seq_lens.tolist() == [8, 8]  # both contexts fill their two blocks
    assert inputs.slots == [2, 1]
