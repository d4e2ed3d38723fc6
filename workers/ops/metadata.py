"""Building the step's AttentionMetadata from host lists: what step_inputs packs into its one
host->device copy, and what tests and benchmarks use to describe a batch directly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.ops.base import AttentionMetadata


@dataclass
class SequenceRows:
    """One sequence of the flat batch: its new tokens start at position `start` (the tokens
    before it are in the cache already); `block_table` covers start + num_tokens tokens."""

    start: int
    num_tokens: int
    block_table: list[int]


@dataclass
class MetadataLists:
    """The integers of an AttentionMetadata on the host, ready to be packed."""

    slot_mapping: list[int]  # [T]
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    block_tables: list[int]  # [B * max_blocks], row-major, padded with 0
    max_blocks: int
    query_lens: list[int]  # [B]

    def int32_parts(self) -> list[list[int]]:
        """The parts that become int32 on the device, in the order `finish` expects."""
        return [self.query_start_loc, self.seq_lens, self.block_tables]


def metadata_lists(seqs: list[SequenceRows], block_size: int) -> MetadataLists:
    slot_mapping: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    query_lens: list[int] = []
    max_blocks = max(((s.start + s.num_tokens + block_size - 1) // block_size for s in seqs), default=0)
    tables: list[int] = []
    for s in seqs:
        table, end = s.block_table, s.start + s.num_tokens
        used = (end + block_size - 1) // block_size
        if len(table) < used:
            raise ValueError(f"block_table has {len(table)} blocks, {used} needed for {end} tokens")
        slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(s.start, end))
        qsl.append(qsl[-1] + s.num_tokens)
        seq_lens.append(end)
        query_lens.append(s.num_tokens)
        tables.extend(table[:used])
        tables.extend([0] * (max_blocks - used))
    return MetadataLists(slot_mapping, qsl, seq_lens, tables, max_blocks, query_lens)


def finish(lists: MetadataLists, *, num_decode: int, block_size: int, slot_mapping: torch.Tensor,
           int32_packed: torch.Tensor) -> AttentionMetadata:
    """Views over the device copies: slot_mapping [T] int64 and the int32 parts, concatenated."""
    b = len(lists.seq_lens)
    qsl, seq_lens, tables = torch.split(int32_packed, [b + 1, b, b * lists.max_blocks])
    return AttentionMetadata(
        num_tokens=len(lists.slot_mapping), num_decode=num_decode, block_size=block_size,
        slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens,
        block_tables=tables.view(b, lists.max_blocks),
        query_lens_host=lists.query_lens, seq_lens_host=lists.seq_lens,
    )


def build_metadata(seqs: list[SequenceRows], *, num_decode: int, block_size: int,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """The metadata of a batch whose first num_decode sequences are decode rows (tests, benchmarks)."""
    for i, s in enumerate(seqs[:num_decode]):
        if s.num_tokens != 1:
            raise ValueError(f"decode row {i} has num_tokens {s.num_tokens}, must be 1")
    lists = metadata_lists(seqs, block_size)
    slots = torch.tensor(lists.slot_mapping, dtype=torch.int64, device=device)
    packed = torch.tensor([x for p in lists.int32_parts() for x in p], dtype=torch.int32, device=device)
    return finish(lists, num_decode=num_decode, block_size=block_size, slot_mapping=slots, int32_packed=packed)


def build_decode_passes(passes: list[list[SequenceRows]], *, block_size: int,
                        device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[AttentionMetadata]]:
    """A drafter's single-token passes, built at once: each pass a batch of decode rows (one token a
    sequence). Returns every pass's positions, one pass after another ([sum of rows] int64: a
    drafter computes their rotary table once and slices it), and each pass's metadata, all from
    two host->device copies."""
    lists = []
    for j, seqs in enumerate(passes):
        if any(s.num_tokens != 1 for s in seqs):
            raise ValueError(f"pass {j}: every sequence of a decode pass has one token")
        lists.append(metadata_lists(seqs, block_size))
    positions = [s.start for seqs in passes for s in seqs]
    int64 = torch.tensor(positions + [x for m in lists for x in m.slot_mapping], dtype=torch.int64, device=device)
    int32 = torch.tensor([x for m in lists for p in m.int32_parts() for x in p], dtype=torch.int32, device=device)
    n = len(positions)
    slot_parts = torch.split(int64[n:], [len(m.slot_mapping) for m in lists])
    int32_parts = torch.split(int32, [sum(map(len, m.int32_parts())) for m in lists])
    return int64[:n], [finish(m, num_decode=len(m.seq_lens), block_size=block_size, slot_mapping=s, int32_packed=p)
                       for m, s, p in zip(lists, slot_parts, int32_parts)]
