"""Penalties and logit_bias: what a request's own tokens (and its bias table) do to its logits.

`apply_penalties(logits, rows)` is the one implementation, over logits and token counts,
used by both paths: the worker's device sampling and the driver's host-logits sampling.
In order (vLLM's): logit_bias is added; repetition_penalty divides the positive and
multiplies the negative logits of every token seen in the prompt or the output; then
logit -= frequency_penalty * count + presence_penalty * (count > 0) over output tokens.

The rows come from two places that give equal PenaltyRows:
- on the worker, PenaltyState keeps each slot's state on the device, allocated the first
  time a request with penalties arrives: output-token counts [slots, V] int32, a prompt
  presence mask [slots, V] bool (repetition_penalty), the three penalties [slots] float32,
  and logit_bias as [slots, MAX_LOGIT_BIAS] (id, bias) pairs. An arrival resets its slot's
  rows and rebuilds them from the tokens the NewRequest carries (prompt, plus the outputs
  of a request recomputed after preemption or a worker restart), so counts equal those of
  an uninterrupted run. Each step the sampled ids are scatter-added into their slots'
  counts on the device (`record`): nothing waits for the host, and only ids leave it.
  A decode row verifying drafts (speculative decoding) samples each position as a row of its
  own: position j's gathered counts also count the row's first j drafts (`count_drafts`), and
  the tokens the row kept are counted in its slot afterwards (`record_runs`).
- on the driver (host-logits mode), `PenaltyRows.build` counts each row's token history.

A step whose rows have no penalties does no penalty work at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.protocol import MAX_LOGIT_BIAS, WorkerSampling


@dataclass
class PenaltyLayout:
    """Which of a step's sampling rows have penalties, and which parts they need (host lists)."""

    rows: list[int]  # [P] batch rows, ascending
    size: int  # B, the batch's rows
    frequency_presence: bool  # some row has a presence or frequency penalty
    repetition: bool  # some row has repetition_penalty != 1
    bias_width: int  # the most logit_bias entries of a row (0: none)

    @classmethod
    def of(cls, params: Sequence[WorkerSampling], rows: list[int]) -> PenaltyLayout:
        """rows: the batch rows whose params have penalties (at least one)."""
        ps = [params[i] for i in rows]
        return cls(rows, len(params),
                   any(sp.presence_penalty != 0 or sp.frequency_penalty != 0 for sp in ps),
                   any(sp.repetition_penalty != 1 for sp in ps),
                   max(len(sp.logit_bias) for sp in ps))

    @property
    def row_index(self) -> list[int] | None:
        """The rows as an index list, None when they are every row of the batch."""
        return None if len(self.rows) == self.size else self.rows


@dataclass
class PenaltyRows:
    """The penalized rows of one step's batch, as tensors on the logits' device. A part no row
    needs is None; a row without that penalty holds its neutral value (0, 1, no bias)."""

    rows: torch.Tensor | None  # [P] int64 batch rows (None: every row)
    counts: torch.Tensor | None  # [P, V] int32 output-token counts
    presence: torch.Tensor | None  # [P] float32, with frequency
    frequency: torch.Tensor | None  # [P] float32
    repetition: torch.Tensor | None  # [P] float32, with prompt_mask
    prompt_mask: torch.Tensor | None  # [P, V] bool, tokens of the prompt
    bias_ids: torch.Tensor | None  # [P, W] int64 (padding: id 0 with bias 0)
    bias_values: torch.Tensor | None  # [P, W] float32
    slots: torch.Tensor | None = None  # [P] int64, the device path: where `record` counts their ids

    @classmethod
    def build(cls, layout: PenaltyLayout, params: Sequence[WorkerSampling],
              histories: Sequence[tuple[Sequence[int], Sequence[int]] | None], vocab_size: int,
              device: torch.device) -> PenaltyRows:
        """From each penalized row's params and (prompt ids, output ids): the driver's path in
        host-logits mode, and the reference the worker's PenaltyState is tested against."""
        P, V, W = len(layout.rows), vocab_size, layout.bias_width
        ps = [params[i] for i in layout.rows]
        hist = [histories[i] for i in layout.rows]
        if any(h is None for h in hist):
            raise ValueError("a row with penalties needs its (prompt ids, output ids)")
        counting = layout.frequency_presence or layout.repetition
        counts = prompt_mask = bias_ids = bias_values = None
        if counting:
            counts = torch.zeros(P, V, dtype=torch.int32)
            for j, (_, outputs) in enumerate(hist):
                ids = torch.tensor([t for t in outputs if t < V], dtype=torch.int64)
                counts[j] = torch.bincount(ids, minlength=V).to(torch.int32)
        if layout.repetition:
            prompt_mask = torch.zeros(P, V, dtype=torch.bool)
            for j, (prompt, _) in enumerate(hist):
                prompt_mask[j, [t for t in prompt if t < V]] = True
        if W:
            pairs = [[(t, b) for t, b in sp.logit_bias if t < V] for sp in ps]
            bias_ids = torch.tensor([[t for t, _ in r] + [0] * (W - len(r)) for r in pairs], dtype=torch.int64)
            bias_values = torch.tensor([[b for _, b in r] + [0.0] * (W - len(r)) for r in pairs],
                                       dtype=torch.float32)

        def floats(name):
            return torch.tensor([float(getattr(sp, name)) for sp in ps], dtype=torch.float32)

        rows = layout.row_index
        out = cls(rows=None if rows is None else torch.tensor(rows, dtype=torch.int64), counts=counts,
                  presence=floats("presence_penalty") if layout.frequency_presence else None,
                  frequency=floats("frequency_penalty") if layout.frequency_presence else None,
                  repetition=floats("repetition_penalty") if layout.repetition else None,
                  prompt_mask=prompt_mask, bias_ids=bias_ids, bias_values=bias_values)
        dev = torch.device(device)
        for name, value in vars(out).items():
            if isinstance(value, torch.Tensor):
                setattr(out, name, value.to(dev))
        return out


def apply_penalties(logits: torch.Tensor, pen: PenaltyRows) -> None:
    """logits [B, V] float32, changed in place on pen's rows only."""
    x = logits if pen.rows is None else logits.index_select(0, pen.rows)  # [P, V]
    if pen.bias_ids is not None:
        x.scatter_add_(1, pen.bias_ids, pen.bias_values)
    if pen.counts is not None:
        seen = pen.counts > 0  # [P, V]
        if pen.repetition is not None:
            rep = pen.repetition[:, None]
            x = torch.where(seen | pen.prompt_mask, torch.where(x > 0, x / rep, x * rep), x)
        if pen.frequency is not None:
            x = x - pen.frequency[:, None] * pen.counts - pen.presence[:, None] * seen
    if pen.rows is None:
        if x is not logits:
            logits.copy_(x)
    else:
        logits.index_copy_(0, pen.rows, x)


class PenaltyState:
    """Each slot's penalty state on the worker's device; see the module docstring."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}  # allocated on first need, then kept
        self._one = torch.ones((), dtype=torch.int32, device=self.device)
        self._true = torch.ones((), dtype=torch.bool, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def close(self) -> None:
        self.tensors.clear()

    def _tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill=0) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            t = self.tensors[name] = torch.full(shape, fill, dtype=dtype, device=self.device)
        return t

    def prepare(self, arrivals: dict[int, tuple[WorkerSampling, Sequence[int], int]]
                ) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
        """Host side: the int64 and float32 parts that write these arrivals (slot -> params,
        token ids, prompt length) with the step's one copy. Allocates what they first need."""
        pen = {s: a for s, a in arrivals.items() if a[0].has_penalties}
        if not pen:
            return {}, {}
        S, V = self.num_slots, self.vocab_size
        for name in ("presence_penalty", "frequency_penalty"):
            self._tensor(name, (S,), torch.float32)
        self._tensor("repetition_penalty", (S,), torch.float32, 1.0)
        if any(sp.counts_tokens for sp, _, _ in pen.values()):
            self._tensor("counts", (S, V), torch.int32)
        if any(sp.repetition_penalty != 1 for sp, _, _ in pen.values()):
            self._tensor("prompt_mask", (S, V), torch.bool)
        if any(sp.logit_bias for sp, _, _ in pen.values()):
            self._tensor("bias_ids", (S, MAX_LOGIT_BIAS), torch.int64)
            self._tensor("bias_values", (S, MAX_LOGIT_BIAS), torch.float32)
        ints = {name: [] for name in ("pen_arrived", "pen_output_index", "pen_prompt_slots",
                                      "pen_prompt_index", "pen_bias_index", "pen_bias_ids")}
        floats = {name: [] for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                        "pen_bias_values")}
        for slot, (sp, tokens, num_prompt) in pen.items():
            ints["pen_arrived"].append(slot)
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
                floats[name].append(float(getattr(sp, name)))
            if sp.counts_tokens:  # counts of the outputs it already has (a recomputed request)
                ints["pen_output_index"] += [slot * V + t for t in tokens[num_prompt:] if t < V]
            if sp.repetition_penalty != 1:
                ints["pen_prompt_slots"].append(slot)
                ints["pen_prompt_index"] += [slot * V + t for t in set(tokens[:num_prompt]) if t < V]
            pairs = [(t, b) for t, b in sp.logit_bias if t < V]
            ints["pen_bias_index"] += [slot * MAX_LOGIT_BIAS + j for j in range(len(pairs))]
            ints["pen_bias_ids"] += [t for t, _ in pairs]
            floats["pen_bias_values"] += [b for _, b in pairs]
        return ({k: v for k, v in ints.items() if v}, {k: v for k, v in floats.items() if v})

    def finish(self, ints: dict[str, torch.Tensor], floats: dict[str, torch.Tensor]) -> None:
        """Device side, given the views of prepare's parts: reset and rebuild the arrived slots."""
        arrived = ints.get("pen_arrived")
        if arrived is None:
            return
        t = self.tensors
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            t[name].index_copy_(0, arrived, floats[name])
        if "counts" in t:  # every arrival with penalties starts from its own tokens
            t["counts"].index_fill_(0, arrived, 0)
            if "pen_output_index" in ints:
                t["counts"].view(-1).index_put_((ints["pen_output_index"],), self._one, accumulate=True)
        if "pen_prompt_slots" in ints:
            t["prompt_mask"].index_fill_(0, ints["pen_prompt_slots"], False)
            if "pen_prompt_index" in ints:
                t["prompt_mask"].view(-1).index_put_((ints["pen_prompt_index"],), self._true)
        if "bias_ids" in t:
            t["bias_ids"].index_fill_(0, arrived, 0)
            t["bias_values"].index_fill_(0, arrived, 0.0)
            if "pen_bias_index" in ints:
                idx = ints["pen_bias_index"]
                t["bias_ids"].view(-1).index_copy_(0, idx, ints["pen_bias_ids"])
                t["bias_values"].view(-1).index_copy_(0, idx, floats["pen_bias_values"])

    def gather(self, layout: PenaltyLayout, rows: torch.Tensor | None, slots: torch.Tensor) -> PenaltyRows:
        """The step's PenaltyRows from the rows' slots [P] (device views)."""
        t = self.tensors

        def take(name):
            return t[name].index_select(0, slots)

        counting = layout.frequency_presence or layout.repetition
        W = layout.bias_width
        return PenaltyRows(
            rows=rows, counts=take("counts") if counting else None,
            presence=take("presence_penalty") if layout.frequency_presence else None,
            frequency=take("frequency_penalty") if layout.frequency_presence else None,
            repetition=take("repetition_penalty") if layout.repetition else None,
            prompt_mask=take("prompt_mask") if layout.repetition else None,
            bias_ids=t["bias_ids"][:, :W].index_select(0, slots) if W else None,
            bias_values=t["bias_values"][:, :W].index_select(0, slots) if W else None,
            slots=slots)

    def count_drafts(self, pen: PenaltyRows, entries: list[int]) -> None:
        """Count drafted tokens in a step's gathered counts: `entries` are (penalized row p,
        token) pairs flattened to p * V + token, one per draft before that row's position."""
        if pen.counts is not None and entries:
            idx = torch.tensor(entries, dtype=torch.int64, device=self.device)
            pen.counts.view(-1).index_put_((idx,), self._one, accumulate=True)

    def record_runs(self, slots: torch.Tensor, grid: torch.Tensor, accepted: torch.Tensor,
                    counted: torch.Tensor) -> None:
        """After verification: count each counted row's kept tokens, grid[r, :accepted[r] + 1]
        (slots [R], grid [R, K] int64, accepted [R], counted [R] bool), in its slot."""
        counts = self.tensors.get("counts")
        if counts is None:
            return
        keep = (torch.arange(grid.shape[1], device=grid.device)[None, :] <= accepted[:, None]) & counted[:, None]
        idx = (slots[:, None] * self.vocab_size + grid)[keep]
        counts.view(-1).index_put_((idx,), self._one, accumulate=True)

    def record(self, pen: PenaltyRows, token_ids: torch.Tensor) -> None:
        """After sampling: count the penalized rows' sampled ids [B] in their slots, on the device."""
        counts = self.tensors.get("counts")
        if counts is None or pen.slots is None:
            return
        ids = token_ids if pen.rows is None else token_ids.index_select(0, pen.rows)
        counts.view(-1).index_put_((pen.slots * self.vocab_size + ids.to(torch.int64),), self._one, accumulate=True)
