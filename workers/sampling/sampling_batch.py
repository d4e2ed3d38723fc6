"""SamplingBatch: a step's per-row sampling policy as device tensors, and how it is laid out.

SamplingLayout sorts a step's sampling rows onto the sampler's paths on the host (greedy or
random; which random rows filter by top-k, top-p, min-p; seeds; bans; logprobs). The batch's
per-row values then come either from each row's params (`SamplingBatch.build`, the driver's
host-logits path) or from the worker's per-slot device state (workers/sampling/slot_sampling.py);
both give the same batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from scheduler.protocol import WorkerSampling
from workers.sampling.penalties import PenaltyLayout, PenaltyRows

SAMPLING_EPS = 1e-5  # temperatures below this are treated as greedy (1/T would overflow)
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded row: a stable 63-bit mix of (seed, position)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


@dataclass
class SamplingBatch:
    """Per-row sampling policy, as device tensors. Index tensors are int64.

    "Random rows" are the rows that are not greedy; their parameters are indexed by
    position among the random rows ([R]). A `*_rows` tensor of None means "all of them".
    """

    size: int  # B
    all_greedy: bool
    random_idx: torch.Tensor | None = None  # [R] batch rows sampled at random (None: all or none)
    num_random: int = 0
    temperature: torch.Tensor | None = None  # [R] float32
    top_k: torch.Tensor | None = None  # [K] int64, k of each top-k row
    top_k_rows: torch.Tensor | None = None  # [K] positions among the random rows
    top_k_max: int = 0
    top_p: torch.Tensor | None = None  # [P] float32
    top_p_rows: torch.Tensor | None = None  # [P]
    top_p_within_k: bool = False  # every top-p row has top-k: its nucleus is among its top k
    top_p_k_idx: torch.Tensor | None = None  # [P] those rows' positions among the top-k rows
    log_min_p: torch.Tensor | None = None  # [M] float32, log(min_p)
    min_p_rows: torch.Tensor | None = None  # [M]
    seeded: list[tuple[int, int]] = field(default_factory=list)  # (position among random rows, seed)
    any_unseeded: bool = False
    ban_rows: torch.Tensor | None = None  # [N] with ban_ids: (row, id) pairs masked to -inf
    ban_ids: torch.Tensor | None = None  # [N]
    max_banned_id: int = -1
    logprob_rows: list[int] = field(default_factory=list)  # batch rows that asked, ascending
    logprob_n: list[int] = field(default_factory=list)  # top-n each of those rows asked for
    logprob_idx: torch.Tensor | None = None  # [L] = logprob_rows, None when every row asked
    max_logprobs: int = 0  # n_max over the rows that asked
    penalties: PenaltyRows | None = None  # rows with penalties or logit_bias (workers/sampling/penalties.py)

    @property
    def argmax_only(self) -> bool:
        """Every row's id is the argmax of its raw logits: greedy, with no penalties, bans or logprobs."""
        return self.all_greedy and self.penalties is None and self.ban_rows is None and not self.logprob_rows

    @classmethod
    def build(cls, params: list[WorkerSampling], positions: list[int], device: torch.device,
              histories: list[tuple[list[int], list[int]] | None] | None = None,
              vocab_size: int | None = None) -> SamplingBatch:
        """The batch from each row's params, copied to `device`: the driver's path in
        host-logits mode, and the reference the worker's per-slot path (SlotSampling) is
        tested against. positions[i] is the sequence position of the token row i samples.
        Rows with penalties need histories[i] = (prompt ids, output ids so far) and the
        logits' vocab_size."""
        device = torch.device(device)
        layout = SamplingLayout.of(params, positions)
        penalties = None
        if layout.penalties is not None:
            if histories is None or vocab_size is None:
                raise ValueError("rows with penalties need their token histories and the vocab size")
            penalties = PenaltyRows.build(layout.penalties, params, histories, vocab_size, device)
        rows = layout.value_rows()
        ints = {**layout.index_lists(), "top_k": [params[i].top_k for i in rows["top_k"]] or None}
        floats = dict(temperature=[float(params[i].temperature) for i in rows["temperature"]] or None,
                      top_p=[float(params[i].top_p) for i in rows["top_p"]] or None,
                      log_min_p=[math.log(params[i].min_p) for i in rows["log_min_p"]] or None)
        return layout.batch({**_to_device(ints, torch.int64, device), **_to_device(floats, torch.float32, device)},
                            penalties)


@dataclass
class SamplingLayout:
    """One step's sampling rows sorted onto the sampler's paths: host lists, from each row's
    (already validated) params. Positions among the random rows are `j`; batch rows `i`."""

    size: int  # B
    rand: list[int]  # [R] batch rows sampled at random (not greedy), ascending
    k_rows: list[int]  # [K] j of the rows with top-k
    top_k_max: int
    p_rows: list[int]  # [P] j of the rows with top-p
    pk: list[int]  # [P] each top-p row's index among the top-k rows, -1 without top-k
    m_rows: list[int]  # [M] j of the rows with min-p
    seeded: list[tuple[int, int]]  # (j, row seed)
    any_unseeded: bool
    ban_rows: list[int]  # [N] with ban_ids: (row, id) pairs masked to -inf
    ban_ids: list[int]
    logprob_rows: list[int]  # batch rows that asked for logprobs, ascending
    logprob_n: list[int]
    penalties: PenaltyLayout | None = None  # None: no row has penalties

    @classmethod
    def of(cls, params: list[WorkerSampling], positions: list[int]) -> SamplingLayout:
        if len(params) != len(positions):
            raise ValueError(f"got {len(params)} sampling params but {len(positions)} positions")
        if positions and min(positions) < 0:  # params were checked once, when their request arrived
            raise ValueError(f"positions must be >= 0, got {min(positions)}")
        rand, k_rows, p_rows, pk, m_rows, seeded, ban_r, ban_c, lp_rows, lp_n = [], [], [], [], [], [], [], [], [], []
        any_unseeded, top_k_max, pen_rows = False, 0, []
        for i, (sp, pos) in enumerate(zip(params, positions)):
            if sp.has_penalties:
                pen_rows.append(i)
            if sp.banned_ids and pos < sp.ban_until:
                ban_r += [i] * len(sp.banned_ids)
                ban_c += sp.banned_ids
            if sp.logprobs is not None:
                lp_rows.append(i)
                lp_n.append(sp.logprobs)
            if sp.temperature < SAMPLING_EPS:
                continue
            j = len(rand)
            rand.append(i)
            if sp.top_k > 0:
                k_rows.append(j)
                top_k_max = max(top_k_max, sp.top_k)
            if sp.top_p < 1:
                p_rows.append(j)
                pk.append(len(k_rows) - 1 if sp.top_k > 0 else -1)
            if sp.min_p > 0:
                m_rows.append(j)
            if sp.seed is None:
                any_unseeded = True
            else:
                seeded.append((j, row_seed(sp.seed, pos)))
        return cls(len(params), rand, k_rows, top_k_max, p_rows, pk, m_rows, seeded, any_unseeded,
                   ban_r, ban_c, lp_rows, lp_n,
                   PenaltyLayout.of(params, pen_rows) if pen_rows else None)

    @property
    def top_p_within_k(self) -> bool:
        return bool(self.pk) and min(self.pk) >= 0

    def index_lists(self) -> dict[str, list[int] | None]:
        """The batch's int64 index tensors as lists (None: absent, or covering every row)."""
        B, R, greedy = self.size, len(self.rand), len(self.rand) < self.size

        def some(rows, total):  # an index list, or None when it covers every row
            return None if len(rows) == total else rows

        return dict(random_idx=self.rand if greedy and self.rand else None,
                    top_k_rows=some(self.k_rows, R) if self.k_rows else None,
                    top_p_rows=some(self.p_rows, R) if self.p_rows else None,
                    top_p_k_idx=some(self.pk, len(self.k_rows)) if self.top_p_within_k else None,
                    min_p_rows=some(self.m_rows, R) if self.m_rows else None,
                    ban_rows=self.ban_rows or None, ban_ids=self.ban_ids or None,
                    logprob_idx=some(self.logprob_rows, B) if self.logprob_rows else None)

    def value_rows(self) -> dict[str, list[int]]:
        """For each per-row value tensor, the batch rows whose values it holds, in order."""
        rand = self.rand
        return dict(temperature=rand, top_k=[rand[j] for j in self.k_rows],
                    top_p=[rand[j] for j in self.p_rows], log_min_p=[rand[j] for j in self.m_rows])

    def batch(self, tensors: dict[str, torch.Tensor | None], penalties: PenaltyRows | None = None
              ) -> SamplingBatch:
        """The SamplingBatch, given the device tensors named by index_lists() and value_rows()
        (and the penalized rows', when self.penalties says there are some)."""
        return SamplingBatch(
            size=self.size, all_greedy=not self.rand, num_random=len(self.rand), top_k_max=self.top_k_max,
            top_p_within_k=self.top_p_within_k, seeded=self.seeded, any_unseeded=self.any_unseeded,
            max_banned_id=max(self.ban_ids, default=-1), logprob_rows=self.logprob_rows,
            logprob_n=self.logprob_n, max_logprobs=max(self.logprob_n, default=0), penalties=penalties,
            **tensors)


def _to_device(lists: dict[str, list | None], dtype: torch.dtype, device: torch.device) -> dict:
    """The lists as tensors on `device` (None stays None), copied in one transfer."""
    present = {k: v for k, v in lists.items() if v is not None}
    out = dict.fromkeys(lists)
    if present:
        flat = torch.tensor([x for v in present.values() for x in v], dtype=dtype)
        # accelerators: pinned + non_blocking, so the copy does not wait for queued work
        flat = flat.pin_memory().to(device, non_blocking=True) if device.type != "cpu" else flat
        out.update(zip(present, torch.split(flat, [len(v) for v in present.values()])))
    return out


