"""The worker's view of its requests, one per slot, and the validation of a StepPlan.

A decode row of n > 1 tokens (speculative decoding) is its input token plus room for up to
n - 1 drafted tokens; the runner drafts and verifies them and advances the computed count by
the accepted ones.

A StepPlan carries diffs (see scheduler/protocol.py); SlotTable.apply checks a whole plan
against the current state (raising ValueError before changing anything), then applies it:
drop finished and preempted slots, admit new requests, append new blocks and advance each
scheduled request's computed count. It returns one RowWork per scheduled row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler.checks import check_int, is_int
from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling


@dataclass
class SlotState:
    token_ids: list[int]  # every token the driver sent (prompt, plus outputs when recomputing)
    num_computed: int  # tokens whose K/V are in the cache
    block_table: list[int]
    sampling: WorkerSampling
    num_prompt: int  # the leading token_ids that are the prompt; the rest were generated
    has_resident: bool = False  # last_tokens[slot] holds a token this worker sampled for it
    generated: list[int] = field(default_factory=list)  # ids it sampled since admission (when speculating)
    draft_computed: int = 0  # positions whose K/V a draft model holds (workers/draft_model.py)
    grammar: object = None  # workers.sampling.grammar_masks.RequestGrammar once a row with a grammar samples
    _array: np.ndarray | None = field(default=None, repr=False, compare=False)  # known_array's buffer (room to grow)
    _array_len: int = field(default=0, repr=False, compare=False)  # how many of its tokens are filled in

    def known_array(self) -> np.ndarray:
        """Every known token (token_ids, then generated) as int64, without rebuilding it each step
        (prompt lookup reads it every step): both lists only grow, so the tokens appended since the
        last call are written after those already there."""
        n = len(self.token_ids) + len(self.generated)
        if self._array is None or len(self._array) < n:
            grown = np.empty(max(n + 64, 2 * n), dtype=np.int64)
            grown[:self._array_len] = self._array[:self._array_len] if self._array is not None else []
            self._array = grown
        if self._array_len < n:
            self._array[self._array_len:n] = self.known_tokens(self._array_len, n)
            self._array_len = n
        return self._array[:n]

    def known_tokens(self, start: int, end: int) -> list[int]:
        """Its tokens at positions [start, end): those sent, then those sampled since."""
        sent = len(self.token_ids)
        if end <= sent:
            return self.token_ids[start:end]
        return self.token_ids[start:] + self.generated[max(0, start - sent):end - sent]


@dataclass
class RowWork:
    """One validated row: num_tokens tokens at positions [start, start + num_tokens)."""

    slot: int
    state: SlotState
    start: int
    num_tokens: int
    token: int | None  # None: prefill from state.token_ids; an id; or USE_RESIDENT
    samples: bool  # after this row every known token is computed
    draft: list[int] | None = None  # a decode row's drafted tokens, verified after its input token

    @property
    def sample_position(self) -> int:
        """The position of the token the row samples (a decode row's first, drafts or not)."""
        return self.start + (1 if self.token is not None else self.num_tokens)

    @property
    def lookahead(self) -> int:
        """Drafts a decode row may verify (its num_tokens beyond the input token)."""
        return self.num_tokens - 1 if self.token is not None else 0

    @property
    def is_decode(self) -> bool:
        return self.token is not None


class SlotTable:
    def __init__(self, *, max_num_seqs: int, num_blocks: int, block_size: int, max_model_len: int,
                 vocab_size: int, max_num_batched_tokens: int | None = None, max_lookahead: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_lookahead = max_lookahead  # drafts a decode row may verify (speculative decoding)
        self.max_num_batched_tokens = max_num_batched_tokens  # None: no limit
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.states: dict[int, SlotState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def clear(self) -> None:
        self.states.clear()

    def apply(self, plan: StepPlan) -> list[RowWork]:
        limit = self.max_num_batched_tokens
        if limit is not None and plan.num_tokens > limit:
            raise ValueError(f"step {plan.step_id} schedules {plan.num_tokens} tokens, "
                             f"more than max_num_batched_tokens {limit}")
        dropped = set(plan.finished) | set(plan.preempted)
        admitted: dict[int, SlotState] = {}
        for req in plan.new_requests:
            if req.slot in admitted:
                raise ValueError(f"slot {req.slot} is admitted twice in step {plan.step_id}")
            admitted[req.slot] = self._check_new(req, occupied=req.slot in self.states and req.slot not in dropped)
        work = [self._check_row(row, admitted, dropped) for row in plan.rows]
        seen: set[int] = set()
        for w in work:
            if w.slot in seen:
                raise ValueError(f"slot {w.slot} is scheduled twice in step {plan.step_id}")
            seen.add(w.slot)
        # everything checked: apply
        for slot in dropped:
            self.states.pop(slot, None)
        self.states.update(admitted)
        for row, w in zip(plan.rows, work):
            w.state.block_table.extend(row.new_blocks)
            # a decode row's drafts count once verified (the runner adds the accepted ones)
            w.state.num_computed += 1 if w.is_decode else w.num_tokens
        return work

    def _check_blocks(self, slot: int, blocks) -> None:
        for b in blocks:
            if not is_int(b) or not 0 <= b < self.num_blocks:
                raise ValueError(f"slot {slot}: block id {b!r} is outside [0, {self.num_blocks})")

    def _check_new(self, req: NewRequest, occupied: bool) -> SlotState:
        slot = req.slot
        if not is_int(slot) or not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"new request slot {slot!r} is outside [0, {self.max_num_seqs})")
        if occupied:
            raise ValueError(f"new request for slot {slot}, which still holds a request")
        if not req.token_ids:
            raise ValueError(f"new request for slot {slot} has no tokens")
        if len(req.token_ids) > self.max_model_len:
            raise ValueError(f"new request for slot {slot} has {len(req.token_ids)} tokens, "
                             f"more than max_model_len {self.max_model_len}")
        if min(req.token_ids) < 0 or max(req.token_ids) >= self.vocab_size:
            bad = next(t for t in req.token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"new request for slot {slot}: token id {bad} is outside [0, {self.vocab_size})")
        if not 0 <= req.num_computed < len(req.token_ids):
            raise ValueError(f"new request for slot {slot}: num_computed {req.num_computed} must be in "
                             f"[0, {len(req.token_ids)}) (at least one token left to compute)")
        if not isinstance(req.sampling, WorkerSampling):
            raise ValueError(f"new request for slot {slot}: sampling must be a WorkerSampling")
        try:  # validated once, here, where the request arrives: never again per step
            req.sampling.check()
        except ValueError as e:
            raise ValueError(f"new request for slot {slot}: {e}") from None
        for name, ids in (("logit_bias token id", [t for t, _ in req.sampling.logit_bias]),
                          ("banned id", req.sampling.banned_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"new request for slot {slot}: {name} {bad[0]} is outside [0, {self.vocab_size})")
        num_prompt = len(req.token_ids) if req.num_prompt is None else req.num_prompt
        if not is_int(num_prompt) or not 1 <= num_prompt <= len(req.token_ids):
            raise ValueError(f"new request for slot {slot}: num_prompt {req.num_prompt!r} must be in "
                             f"[1, {len(req.token_ids)}]")
        self._check_blocks(slot, req.block_table)
        if len(req.block_table) * self.block_size < req.num_computed:
            raise ValueError(f"new request for slot {slot}: {len(req.block_table)} blocks cannot hold "
                             f"its {req.num_computed} computed tokens")
        return SlotState(list(req.token_ids), req.num_computed, list(req.block_table), req.sampling, num_prompt)

    def _check_row(self, row: ScheduledRow, admitted: dict[int, SlotState], dropped: set[int]) -> RowWork:
        slot = row.slot
        state = admitted.get(slot)
        if state is None and slot not in dropped:
            state = self.states.get(slot)
        if state is None:
            raise ValueError(f"row for slot {slot!r}, which holds no request")
        n, start, known = row.num_tokens, state.num_computed, len(state.token_ids)
        check_int(f"row for slot {slot}: num_tokens", n, 1)
        if row.token is None:
            if start + n > known:
                raise ValueError(f"prefill row for slot {slot} asks for {n} tokens but only "
                                 f"{known - start} are uncomputed")
            samples = start + n == known
        else:
            if n > 1 + self.max_lookahead:
                raise ValueError(f"decode row for slot {slot} has num_tokens {n}, expected 1"
                                 + (f" to {1 + self.max_lookahead} (speculative lookahead)" if self.max_lookahead
                                    else ""))
            if start < known:
                raise ValueError(f"decode row for slot {slot}, which has {known - start} uncomputed prompt tokens")
            if row.token == USE_RESIDENT:
                if not state.has_resident:
                    raise ValueError(f"decode row for slot {slot} uses the resident token, "
                                     "but this worker has sampled none for it")
            elif not isinstance(row.token, int) or not 0 <= row.token < self.vocab_size:
                raise ValueError(f"decode row for slot {slot}: token {row.token!r} is outside [0, {self.vocab_size})")
            samples = True
        if start + n > self.max_model_len:
            raise ValueError(f"row for slot {slot} reaches position {start + n - 1}, "
                             f"beyond max_model_len {self.max_model_len}")
        self._check_blocks(slot, row.new_blocks)
        if (len(state.block_table) + len(row.new_blocks)) * self.block_size < start + n:
            raise ValueError(f"row for slot {slot}: {len(state.block_table) + len(row.new_blocks)} blocks "
                             f"of {self.block_size} cannot hold {start + n} tokens")
        return RowWork(slot, state, start, n, row.token, samples)
