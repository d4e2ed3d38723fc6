"""SlotSampling: every slot's sampling parameters, resident on the worker's device.

A request's parameters reach the worker once, in its NewRequest (checked there, by
SlotTable). They are written into per-slot device tensors ([max_num_seqs] each: the way
vLLM's persistent batch keeps them) with the next step's inputs, and each step gathers
its rows' values from those tensors on the device. So a step sends only ints: which rows
take which path (SamplingLayout) and the slots to gather from, packed into the same
single host->device copy as the step's other inputs (workers/staging.py), plus the
float parameters of the requests that just arrived. Requests with penalties keep more state
per slot (workers/sampling/penalties.py: PenaltyState), written the same way when they arrive and
counted after each step's sampling (`record`).

`prepare` (host, before the copy) and `finish` (device views, after it) bracket that copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.protocol import WorkerSampling
from workers.sampling.penalties import PenaltyState
from workers.sampling.sampling_batch import SamplingBatch, SamplingLayout

_FLOATS = ("temperature", "top_p", "log_min_p")  # float32 per slot
_VALUES = ("temperature", "top_k", "top_p", "log_min_p")  # what a batch gathers per row


@dataclass
class SamplingUpload:
    """One step's sampling parts for the step's copy, and what to make of them after it."""

    layout: SamplingLayout | None  # None: no row samples this step
    ints: dict[str, list[int]]  # name -> int64 values, in upload order
    floats: dict[str, list[float]]  # name -> float32 values, in upload order


class SlotSampling:
    def __init__(self, num_slots: int, device: torch.device, vocab_size: int) -> None:
        dev = torch.device(device)
        self.values = {  # [num_slots] each; a slot's entries are valid while its request is on the worker
            "temperature": torch.ones(num_slots, dtype=torch.float32, device=dev),
            "top_k": torch.zeros(num_slots, dtype=torch.int64, device=dev),
            "top_p": torch.ones(num_slots, dtype=torch.float32, device=dev),
            "log_min_p": torch.zeros(num_slots, dtype=torch.float32, device=dev),
        }
        self.penalties = PenaltyState(num_slots, vocab_size, dev)  # allocates when first needed
        # slot -> (params, token ids, prompt length) not yet written to the device
        self._arrived: dict[int, tuple[WorkerSampling, Sequence[int], int]] = {}

    def admit(self, slot: int, sampling: WorkerSampling, token_ids: Sequence[int] = (),
              num_prompt: int | None = None) -> None:
        """A request arrived in `slot` with these known tokens, the first num_prompt of them
        (None: all) its prompt: its params go to the device with the next step's copy."""
        # a later arrival in the same slot replaces an unwritten one
        self._arrived[slot] = (sampling, token_ids, len(token_ids) if num_prompt is None else num_prompt)

    def clear(self) -> None:
        self._arrived.clear()

    def prepare(self, params: list[WorkerSampling], positions: list[int], slots: list[int]) -> SamplingUpload:
        """Host side of one step whose sampling rows have these params, sampled positions and slots."""
        ints: dict[str, list[int]] = {}
        floats: dict[str, list[float]] = {}
        if self._arrived:
            arrivals, self._arrived = self._arrived, {}
            arrived = [sp for sp, _, _ in arrivals.values()]
            ints["arrived_slots"] = list(arrivals)
            ints["arrived_top_k"] = [sp.top_k for sp in arrived]
            floats["temperature"] = [float(sp.temperature) for sp in arrived]
            floats["top_p"] = [float(sp.top_p) for sp in arrived]
            floats["log_min_p"] = [math.log(sp.min_p) if sp.min_p > 0 else 0.0 for sp in arrived]
            pen_ints, pen_floats = self.penalties.prepare(arrivals)
            ints.update(pen_ints)
            floats.update(pen_floats)
        layout = SamplingLayout.of(params, positions) if params else None
        if layout is not None:
            ints.update((name, rows) for name, rows in layout.index_lists().items() if rows is not None)
            for name, rows in layout.value_rows().items():
                if rows:
                    ints[f"{name}_slots"] = [slots[i] for i in rows]
            if layout.penalties is not None:
                if layout.penalties.row_index is not None:
                    ints["pen_rows"] = layout.penalties.row_index
                ints["pen_slots"] = [slots[i] for i in layout.penalties.rows]
        return SamplingUpload(layout, ints, floats)

    def finish(self, upload: SamplingUpload, ints: list[torch.Tensor], floats: list[torch.Tensor]
               ) -> SamplingBatch | None:
        """Device side, given the uploaded parts' views: write the arrivals, gather the batch."""
        iv = dict(zip(upload.ints, ints))
        fv = dict(zip(upload.floats, floats))
        if "arrived_slots" in iv:
            idx = iv["arrived_slots"]
            self.values["top_k"].index_copy_(0, idx, iv["arrived_top_k"])
            for name in _FLOATS:
                self.values[name].index_copy_(0, idx, fv[name])
            self.penalties.finish(iv, fv)
        layout = upload.layout
        if layout is None:
            return None
        tensors = {name: iv.get(name) for name in layout.index_lists()}
        for name in _VALUES:
            idx = iv.get(f"{name}_slots")
            tensors[name] = None if idx is None else self.values[name].index_select(0, idx)
        penalties = None
        if layout.penalties is not None:
            penalties = self.penalties.gather(layout.penalties, iv.get("pen_rows"), iv["pen_slots"])
        return layout.batch(tensors, penalties)

    def record(self, batch: SamplingBatch | None, token_ids: torch.Tensor) -> None:
        """After the step sampled token_ids [B]: count them where penalties need it (device only)."""
        if batch is not None and batch.penalties is not None:
            self.penalties.record(batch.penalties, token_ids)
