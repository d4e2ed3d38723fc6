"""The single-token passes a drafter runs after its first (draft model and EAGLE-3 head alike).

Draft j of a row is made by a pass over draft j - 1, one token a row, for the rows whose
lookahead exceeds j (a row near its max_tokens drafts fewer). Those passes' positions and
attention metadata are known before the first of them runs, so they are built at once: two
host->device copies for all of them, and one rotary table the passes slice, instead of a few
small copies and a rotary computation per pass.
"""

from __future__ import annotations

import torch

from workers.ops.metadata import SequenceRows, build_decode_passes
from workers.slot_table import RowWork


class DraftPasses:
    def __init__(self, rows: list[RowWork], *, offset: int, block_size: int, device: torch.device) -> None:
        """rows: the drafting rows, in the order of the drafter's columns; pass j (1 .. longest
        lookahead - 1) runs each live row at position start + j + offset."""
        self.device = device
        self.live: list[list[int]] = []
        for j in range(1, max(w.lookahead for w in rows)):
            self.live.append([i for i, w in enumerate(rows) if w.lookahead > j])  # a subset of the pass before's
        passes = [[SequenceRows(rows[i].start + j + offset, 1, rows[i].state.block_table) for i in live]
                  for j, live in enumerate(self.live, start=1)]
        self.positions, self.metadata = build_decode_passes(passes, block_size=block_size, device=device)
        self.bounds = [0]
        for live in self.live:
            self.bounds.append(self.bounds[-1] + len(live))
        self.num_rows = len(rows)

    def __iter__(self):
        """(j, index, positions, metadata) of each pass: index None when every row is live, else
        the live rows' places among all rows (int64, on the device)."""
        for j, (live, meta) in enumerate(zip(self.live, self.metadata), start=1):
            index = None if len(live) == self.num_rows else torch.tensor(live, dtype=torch.int64, device=self.device)
            yield j, index, self.slice(j, self.positions), meta

    def slice(self, j: int, t: torch.Tensor) -> torch.Tensor:
        """Pass j's rows of a tensor laid out like `positions` (a rotary table)."""
        return t[self.bounds[j - 1]:self.bounds[j]]

    @staticmethod
    def scatter(index: torch.Tensor | None, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A pass's ids [live] as a column over all rows ([R], -1 where a row made no draft)."""
        if index is None:
            return out
        column = torch.full_like(like, -1)
        column[index] = out
        return column
