"""The device tensors of one step, built from validated rows with one host->device copy.

The flat batch puts decode rows first (so attention answers them with one call), then
every prefill chunk's tokens, each chunk in plan order, then the decode rows that verify drafts
(their input token and drafts, attended like a chunk). Sampling rows stay in plan order; the
verifying rows sample apart from them (Verify), at each of their positions.
All integer inputs, the AttentionMetadata's among them (built here once per step, shared by
every layer), and the caller's sampling parts (workers/sampling/slot_sampling.py), are packed into one
int64 host buffer reused every step (workers/staging.py), copied once, and split into views
on the device; the metadata's int32 parts sit side by side and are cast with one op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.protocol import USE_RESIDENT
from workers.ops.base import AttentionMetadata
from workers.ops.metadata import SequenceRows, finish, metadata_lists
from workers.slot_table import RowWork
from workers.staging import StepStaging


@dataclass
class Verify:
    """The decode rows that verify drafted tokens: the flat-batch indices of their positions,
    where each lands in a [rows, k + 1] grid, and their drafts in a [rows, k] grid (-1 pads)."""

    work: list[RowWork]  # [R]
    k: int  # the most drafts of any of them
    indices: torch.Tensor  # [V] int64: flat-batch rows of every verified position, row after row
    grid_index: torch.Tensor  # [V] int64: each one's place in the [R, k + 1] grid
    drafts: torch.Tensor  # [R * k] int64
    slots: torch.Tensor  # [R] int64
    logprobs: list | None = None  # RowLogprobs of the verified positions that asked (row: index among them)


@dataclass
class StepInputs:
    num_tokens: int  # T
    input_ids: torch.Tensor  # [T] int64 (resident tokens already filled in)
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor | None  # [B] rows of the flat batch that sample; None: all T, in order
    sample_slots: torch.Tensor  # [B] int64 slots of the sampling rows, in plan order
    slots: list[int]  # [B] the same, on the host
    work: list[RowWork]  # [B] the sampling rows
    sampling_ints: list[torch.Tensor]  # device views of the caller's `sampling_ints` parts (int64)
    sampling_floats: list[torch.Tensor]  # device views of its `sampling_floats` parts (float32)
    verify: Verify | None = None  # rows verifying drafts (not among `work`); None when none drafted
    row_starts: dict[int, int] | None = None  # slot -> index of its row's first token in the flat batch


def build_step_inputs(rows: list[RowWork], *, block_size: int, last_tokens: torch.Tensor,
                      staging: StepStaging, sampling_ints: list[list[int]] = (),
                      sampling_floats: list[list[float]] = ()) -> StepInputs:
    decode = [w for w in rows if w.is_decode and not w.draft]
    prefill = [w for w in rows if not w.is_decode]
    verifying = [w for w in rows if w.draft]
    ids: list[int] = []
    positions: list[int] = []
    resident_rows: list[int] = []
    resident_slots: list[int] = []
    row_end: dict[int, int] = {}  # slot -> index of its row's last token in the flat batch
    row_start: dict[int, int] = {}  # slot -> index of its first
    seqs: list[SequenceRows] = []

    def put_input(w: RowWork) -> None:  # a decode row's input token, or a placeholder for its resident one
        if w.token == USE_RESIDENT:
            resident_rows.append(len(ids))
            resident_slots.append(w.slot)
            ids.append(0)
        else:
            ids.append(w.token)

    # decode rows: one token at position `start`
    for i, w in enumerate(decode):
        put_input(w)
        positions.append(w.start)
        seqs.append(SequenceRows(w.start, 1, w.state.block_table))
        row_end[w.slot] = row_start[w.slot] = i

    # prefill chunks
    for w in prefill:
        s, n, start = len(ids), w.num_tokens, w.start
        row_start[w.slot] = s
        ids.extend(w.state.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        seqs.append(SequenceRows(start, n, w.state.block_table))
        row_end[w.slot] = s + n - 1

    # decode rows with drafts: the input token, then the drafts, at positions start, start + 1, ...
    k = max((len(w.draft) for w in verifying), default=0)
    verify_idx: list[int] = []
    grid_idx: list[int] = []
    drafts: list[int] = []
    for r, w in enumerate(verifying):
        s, d = len(ids), len(w.draft)
        row_start[w.slot] = s
        put_input(w)
        ids.extend(w.draft)
        positions.extend(range(w.start, w.start + d + 1))
        seqs.append(SequenceRows(w.start, d + 1, w.state.block_table))
        verify_idx.extend(range(s, s + d + 1))
        grid_idx.extend(range(r * (k + 1), r * (k + 1) + d + 1))
        drafts.extend(w.draft)
        drafts.extend([-1] * (k - d))
    meta = metadata_lists(seqs, block_size)

    sampling_rows = [w for w in rows if w.samples and not w.draft]
    logits_idx = [row_end[w.slot] for w in sampling_rows]
    identity = len(logits_idx) == len(ids) and all(i == j for i, j in enumerate(logits_idx))
    sample_slots = [w.slot for w in sampling_rows]

    int32_parts = meta.int32_parts()  # query_start_loc, seq_lens, block_tables
    parts = [ids, positions, meta.slot_mapping, resident_rows, resident_slots,
             [] if identity else logits_idx, sample_slots, verify_idx, grid_idx, drafts,
             [w.slot for w in verifying], *int32_parts]
    ints, floats = staging.upload([*parts, *sampling_ints], sampling_floats)  # the step's one copy
    (t_ids, t_pos, t_slots, t_res_rows, t_res_slots, t_logits_idx, t_sample_slots) = ints[:7]
    int32_packed = torch.cat(ints[11:len(parts)]).to(torch.int32)  # [B + 1 + B + B * max_blocks]

    if resident_rows:
        t_ids.index_copy_(0, t_res_rows, last_tokens.index_select(0, t_res_slots))
    attn = finish(meta, num_decode=len(decode), block_size=block_size, slot_mapping=t_slots,
                  int32_packed=int32_packed)
    return StepInputs(
        num_tokens=len(ids), input_ids=t_ids, positions=t_pos, attn=attn,
        logits_indices=None if identity else t_logits_idx, sample_slots=t_sample_slots,
        slots=sample_slots, work=sampling_rows, sampling_ints=ints[len(parts):], sampling_floats=floats,
        verify=Verify(verifying, k, *ints[7:11]) if verifying else None, row_starts=row_start,
    )
