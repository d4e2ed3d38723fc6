"""The device tensors of one step, built from validated rows with one host->device copy.

The flat batch puts decode rows first (so attention answers them with one call), then
every prefill chunk's tokens, each chunk in plan order. Sampling rows stay in plan order.
All integer inputs, and the caller's sampling parts (workers/slot_sampling.py), are packed
into one int64 host buffer reused every step (workers/staging.py), copied once, and split
into views on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.protocol import USE_RESIDENT
from workers.attention import AttentionMetadata, PrefillChunk
from workers.slot_table import RowWork
from workers.staging import StepStaging


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


def _slots_of(table: list[int], start: int, n: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def build_step_inputs(rows: list[RowWork], *, block_size: int, last_tokens: torch.Tensor,
                      staging: StepStaging, sampling_ints: list[list[int]] = (),
                      sampling_floats: list[list[float]] = ()) -> StepInputs:
    decode = [w for w in rows if w.is_decode]
    prefill = [w for w in rows if not w.is_decode]
    ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    resident_rows: list[int] = []
    resident_slots: list[int] = []
    row_end: dict[int, int] = {}  # slot -> index of its row's last token in the flat batch

    # decode rows: one token at position `start`
    max_blocks = max((w.start // block_size + 1 for w in decode), default=0)
    decode_tables: list[int] = []
    context_lens: list[int] = []
    for i, w in enumerate(decode):
        table = w.state.block_table
        p = w.start
        if w.token == USE_RESIDENT:
            resident_rows.append(i)
            resident_slots.append(w.slot)
            ids.append(0)
        else:
            ids.append(w.token)
        positions.append(p)
        slot_mapping.append(table[p // block_size] * block_size + p % block_size)
        used = p // block_size + 1
        decode_tables.extend(table[:used])
        decode_tables.extend([0] * (max_blocks - used))
        context_lens.append(p + 1)
        row_end[w.slot] = i
    padded = any(c != max_blocks * block_size for c in context_lens)

    # prefill chunks
    chunks: list[PrefillChunk] = []
    chunk_blocks: list[int] = []
    chunk_counts: list[int] = []  # blocks each chunk gathers (0: it starts at position 0)
    for w in prefill:
        s, n, start = len(ids), w.num_tokens, w.start
        ids.extend(w.state.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        slot_mapping.extend(_slots_of(w.state.block_table, start, n, block_size))
        num_blocks = 0
        if start:
            num_blocks = (start + n + block_size - 1) // block_size
            chunk_blocks.extend(w.state.block_table[:num_blocks])
        chunks.append(PrefillChunk(start=s, num_tokens=n, num_cached=start))
        chunk_counts.append(num_blocks)
        row_end[w.slot] = s + n - 1

    sampling_rows = [w for w in rows if w.samples]
    logits_idx = [row_end[w.slot] for w in sampling_rows]
    identity = len(logits_idx) == len(ids) and all(i == j for i, j in enumerate(logits_idx))
    sample_slots = [w.slot for w in sampling_rows]

    parts = [ids, positions, slot_mapping, decode_tables, context_lens, chunk_blocks,
             resident_rows, resident_slots, [] if identity else logits_idx, sample_slots]
    ints, floats = staging.upload([*parts, *sampling_ints], sampling_floats)  # the step's one copy
    (t_ids, t_pos, t_slots, t_tables, t_ctx, t_chunk_blocks,
     t_res_rows, t_res_slots, t_logits_idx, t_sample_slots) = ints[:len(parts)]

    if resident_rows:
        t_ids.index_copy_(0, t_res_rows, last_tokens.index_select(0, t_res_slots))
    offset = 0
    for chunk, count in zip(chunks, chunk_counts):
        if count:
            chunk.block_ids = t_chunk_blocks[offset:offset + count]
            offset += count
    attn = AttentionMetadata.build(
        slot_mapping=t_slots, block_size=block_size,
        decode_block_tables=t_tables.view(len(decode), max_blocks) if decode else None,
        decode_context_lens=t_ctx, decode_padded=padded, prefills=chunks,
    )
    return StepInputs(
        num_tokens=len(ids), input_ids=t_ids, positions=t_pos, attn=attn,
        logits_indices=None if identity else t_logits_idx, sample_slots=t_sample_slots,
        slots=sample_slots, work=sampling_rows, sampling_ints=ints[len(parts):], sampling_floats=floats,
    )
