"""Step: one StepPlan being built, then the bookkeeping its StepResult is checked against."""

from __future__ import annotations

from collections import Counter

from scheduler.protocol import NewRequest, ScheduledRow, StepPlan, StepResult, unpack_int32
from scheduler.request import Request


class Step:
    """Rows are added in plan order; each advances its request's num_computed_tokens.

    A row samples exactly when, after it, every token the worker knows for the request is
    computed (known = sent or already sampled, including samples still in flight): a
    decode row always, a prefill chunk when it is the last. Decode rows are appended by
    the Scheduler's inlined hot loop with the same bookkeeping as add_prefill_row.
    """

    __slots__ = ("step_id", "budget", "rows", "new_requests", "samples", "slots", "confirms", "logprob_rows",
                 "lookahead", "prefill_tokens", "_bs", "_caching")

    def __init__(self, step_id: int, budget: int, block_size: int, caching: bool) -> None:
        self.step_id = step_id
        self.budget = budget  # tokens left for this step
        self.rows: list[ScheduledRow] = []
        self.new_requests: list[NewRequest] = []
        self.samples: list[tuple[Request, int]] = []  # (request, position it samples), plan order
        self.slots: list[int] = []  # their slots: what StepResult.slots must be
        # (request, admission, computed after) for rows filling blocks
        self.confirms: list[tuple[Request, int, int]] = []
        self.logprob_rows: list[int] = []  # indexes into samples of requests that asked for logprobs
        self.lookahead: dict[int, int] = {}  # index into samples -> drafts its row may verify (speculation)
        self.prefill_tokens = 0
        self._bs = block_size
        self._caching = caching

    def add_prefill_row(self, req: Request, n: int, new_blocks: list[int]) -> None:
        """n of the request's sent tokens, from its num_computed_tokens on."""
        c = req.num_computed_tokens
        self.rows.append(ScheduledRow(req.slot, n, new_blocks, None))
        req.num_computed_tokens = c + n
        self.budget -= n
        self.prefill_tokens += n
        if c + n == req.num_tokens + req.num_inflight_samples:
            req.num_inflight_samples += 1
            req.last_sample_step = self.step_id
            if req.params.logprobs is not None:
                self.logprob_rows.append(len(self.samples))
            self.samples.append((req, c + n))
            self.slots.append(req.slot)
        if self._caching and (c + n) // self._bs > c // self._bs:
            self.confirms.append((req, req.admission, c + n))

    def has_row_for(self, slot: int) -> bool:
        return any(r.slot == slot for r in self.rows)

    def check(self, result: StepResult) -> tuple[list[int], list[int] | None, list[int] | None]:
        """The result's ids, each sampling row's count of them and of its drafts (None: one id
        each, nothing drafted), once the result is known to answer this step; else ValueError."""
        if result.step_id != self.step_id:
            raise ValueError(f"result for step {result.step_id} arrived; step {self.step_id} must come first")
        if list(result.slots) != self.slots:
            raise ValueError(f"step {self.step_id}: result slots {result.slots} "
                             f"are not the sampling rows' {self.slots}")
        ids = result.sampled_ids()  # [ids] int32
        counts = unpack_int32(result.num_ids) if result.num_ids else None
        drafted = unpack_int32(result.num_drafted) if result.num_drafted else None
        if counts is None:
            if len(ids) != len(self.samples):
                raise ValueError(f"step {self.step_id}: {len(ids)} sampled ids for {len(self.samples)} sampling rows")
        else:
            look = self.lookahead
            if len(counts) != len(self.samples) or sum(counts) != len(ids):
                raise ValueError(f"step {self.step_id}: {len(ids)} ids in {len(counts)} row counts "
                                 f"for {len(self.samples)} sampling rows")
            bad = [k for k, n in enumerate(counts) if not 1 <= n <= 1 + look.get(k, 0)]
            if bad:
                raise ValueError(f"step {self.step_id}: row {bad[0]} returned {counts[bad[0]]} ids, "
                                 f"expected 1 to {1 + look.get(bad[0], 0)}")
            if drafted is not None and (len(drafted) != len(counts)
                                        or any(not n - 1 <= d <= look.get(k, 0) for k, (n, d)
                                               in enumerate(zip(counts, drafted)))):
                raise ValueError(f"step {self.step_id}: draft counts {drafted!r:.80} do not fit the rows")
        if self.logprob_rows:  # one entry per id the row returned (a verified run's, in order)
            have = Counter(lp.row for lp in result.logprobs)
            missing = [k for k in self.logprob_rows if have[k] != (1 if counts is None else counts[k])]
            if missing:
                raise ValueError(f"step {self.step_id}: rows {missing} asked for logprobs and have none "
                                 f"or not one per id")
        return ids, counts, drafted

    def plan(self, finished: list[int], preempted: list[int]) -> StepPlan:
        return StepPlan(self.step_id, self.new_requests, self.rows, finished, preempted)
