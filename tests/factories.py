"""Factories for scheduler tests: no torch, no ray.

FakeRunner consumes StepPlans the way a worker does (per-slot state from NewRequest, rows,
finished and preempted) over a fake paged KV cache. Its "model" is a hash chain: the K/V
entry at position p is mix(entry at p-1, token p), read through the slot's block table,
and the token sampled at position p is a function of entry p-1. So each token is a pure
function of (prompt, position) exactly when the scheduler hands out correct block
tables, prefix-cache hits and input tokens; `reference` computes the same sequence with
no scheduler, blocks or slots at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.protocol import USE_RESIDENT, RowLogprobs, StepPlan, StepResult, pack_int32
from scheduler.request import FinishReason, Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig

VOCAB = 64
EOS = 7
MASK = (1 << 64) - 1


def mix(state: int, token: int) -> int:
    x = (state ^ (token + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9 & MASK
    return (x ^ (x >> 31)) * 0x94D049BB133111EB & MASK


def model_token(state: int, position: int, ban_until: int, banned) -> int:
    """The fake model's choice for `position` given the K/V entry of position-1."""
    token = (state >> 17) % VOCAB
    while position < ban_until and token in banned:
        token = (token + 1) % VOCAB
    return token


def reference(prompt, params: SamplingParams, eos=frozenset({EOS}), max_total: int = 10**9):
    """(outputs, finish reason) of an uninterrupted run, from the rules of SamplingParams."""
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    ban_until = len(prompt) + params.min_tokens
    state = 0
    for t in prompt:
        state = mix(state, t)
    out = []
    while True:
        token = model_token(state, len(prompt) + len(out), ban_until, banned)
        out.append(token)
        if len(out) > params.min_tokens and token in banned:
            return out, FinishReason.STOP
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= max_total:
            return out, FinishReason.LENGTH
        state = mix(state, token)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=256, enable_prefix_caching=True, requests=(), max_concurrent_batches=1,
                   num_lookahead_tokens=0, lookahead_below=None) -> Scheduler:
    """A scheduler of this shape, with `requests` added in order."""
    sched = Scheduler(SchedulerConfig(num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                                      max_model_len, enable_prefix_caching, max_concurrent_batches,
                                      num_lookahead_tokens, lookahead_below))
    for r in requests:
        sched.add_request(r)
    return sched


def make_requests(n, prompt_len=10, max_tokens=8, prefix=(), seed=0, eos=frozenset({EOS}), id_prefix="r",
                  **params) -> list[Request]:
    """n requests with distinct pseudo-random prompts (after a shared `prefix`)."""
    reqs = []
    for i in range(n):
        length = prompt_len(i) if callable(prompt_len) else prompt_len
        body = [(seed * 7919 + i * 104729 + j * 31 + 1) % 997 + VOCAB for j in range(length)]
        params.setdefault("temperature", 0.0)
        reqs.append(Request(f"{id_prefix}{i}", list(prefix) + body, SamplingParams(max_tokens=max_tokens, **params),
                            eos_token_ids=eos))
    return reqs


@dataclass
class _Slot:
    tokens: list[int]  # every token the worker knows: sent ones, then its own samples
    computed: int
    table: list[int]
    sampling: object


@dataclass
class FakeRunner:
    num_blocks: int
    block_size: int
    codec: bool = True  # send plans and results through to_bytes/from_bytes
    slots: dict = field(default_factory=dict)
    kv: dict = field(default_factory=dict)  # (block, offset) -> (token, state)
    plans: list = field(default_factory=list)
    num_sampled: int = 0
    # speculative decoding: whether the draft for position p is the model's own token (else a wrong
    # one); a decode row of n tokens drafts n - 1 and verifies them like a worker
    draft_right: object = None

    @classmethod
    def for_scheduler(cls, sched: Scheduler, **kw) -> FakeRunner:
        return cls(sched.config.num_blocks, sched.config.block_size, **kw)

    def _holders(self, block: int) -> list[int]:
        return [s for s, st in self.slots.items() if block in st.table]

    def _entry(self, st: _Slot, p: int):
        return self.kv[(st.table[p // self.block_size], p % self.block_size)]

    def execute(self, plan: StepPlan) -> StepResult:
        if self.codec:
            plan = StepPlan.from_bytes(plan.to_bytes())
        self.plans.append(plan)
        bs = self.block_size
        for slot in plan.finished + plan.preempted:
            assert slot in self.slots, f"step {plan.step_id}: dropping unknown slot {slot}"
            del self.slots[slot]
        for nr in plan.new_requests:
            assert nr.slot not in self.slots, f"slot {nr.slot} reused while live"
            assert nr.num_computed % bs == 0 and nr.num_computed < len(nr.token_ids)
            assert all(0 <= b < self.num_blocks for b in nr.block_table)
            st = _Slot(list(nr.token_ids), nr.num_computed, list(nr.block_table), nr.sampling)
            for p in range(nr.num_computed):  # prefix-cache hits must hold exactly these tokens
                assert self._entry(st, p)[0] == nr.token_ids[p], f"cached block holds wrong token at {p}"
            self.slots[nr.slot] = st
        ids, slots, logprobs, counts, drafts = [], [], [], [], []
        seen = set()
        for row in plan.rows:
            assert row.slot not in seen, "two rows for one slot"
            seen.add(row.slot)
            st = self.slots[row.slot]
            assert all(0 <= b < self.num_blocks for b in row.new_blocks)
            st.table += row.new_blocks
            c, n = st.computed, row.num_tokens
            assert n >= 1 and len(st.table) * bs >= c + n, "block table does not cover the row"
            if row.token is None:
                assert c + n <= len(st.tokens), "prefill row beyond the known tokens"
            else:
                assert n == 1 or self.draft_right is not None, "a decode row with lookahead, not speculating"
                assert c == len(st.tokens) - 1, "decode row is not at the last sampled token"
                assert row.token == USE_RESIDENT or row.token == st.tokens[c], "decode input is not the last token"
                if n > 1:
                    run, drafted = self._verify(row.slot, st, c, n)
                    if st.sampling.logprobs is not None:  # one entry per token of the run, in order
                        logprobs += [self._logprobs(len(slots), t, st.sampling.logprobs) for t in run]
                    ids += run
                    counts.append(len(run))
                    drafts.append(drafted)
                    slots.append(row.slot)
                    continue
            for p in range(c, c + n):
                block = st.table[p // bs]
                assert self._holders(block) == [row.slot], f"block {block} written while shared"
                state = self._entry(st, p - 1)[1] if p else 0
                self.kv[(block, p % bs)] = (st.tokens[p], mix(state, st.tokens[p]))
            st.computed = c + n
            if st.computed == len(st.tokens):
                ws = st.sampling
                token = model_token(self._entry(st, c + n - 1)[1], c + n, ws.ban_until, set(ws.banned_ids))
                if ws.logprobs is not None:
                    logprobs.append(self._logprobs(len(slots), token, ws.logprobs))
                st.tokens.append(token)
                self.num_sampled += 1
                ids.append(token)
                slots.append(row.slot)
                counts.append(1)
                drafts.append(0)
        result = StepResult(plan.step_id, slots, pack_int32(ids), logprobs, logits_shape=(len(slots), 0))
        if self.draft_right is not None:
            result.num_ids, result.num_drafted = pack_int32(counts), pack_int32(drafts)
        return StepResult.from_bytes(result.to_bytes()) if self.codec else result

    @staticmethod
    def _logprobs(row: int, token: int, n: int) -> RowLogprobs:
        """The fake model's logprobs of a sampled token: a function of the token alone."""
        return RowLogprobs(row, -token / 100, [token] * n, [-token / 100] * n)

    def _verify(self, slot: int, st: _Slot, c: int, n: int) -> tuple[list[int], int]:
        """A decode row of n tokens: its input and n - 1 drafts (right where draft_right says), each
        position's K/V written and its token chosen; the drafts are accepted up to the first wrong one."""
        bs = self.block_size
        state = self._entry(st, c - 1)[1] if c else 0
        inputs, outs = [st.tokens[c]], []
        for j in range(n):
            p = c + j
            block = st.table[p // bs]
            assert self._holders(block) == [slot], f"block {block} written while shared"
            state = mix(state, inputs[j])
            self.kv[(block, p % bs)] = (inputs[j], state)
            ws = st.sampling
            outs.append(model_token(state, p + 1, ws.ban_until, set(ws.banned_ids)))
            if j < n - 1:
                inputs.append(outs[j] if self.draft_right(p + 1) else (outs[j] + 1) % VOCAB)
        accepted = 0
        while accepted < n - 1 and inputs[accepted + 1] == outs[accepted]:
            accepted += 1
        run = outs[:accepted + 1]
        st.tokens += run
        st.computed = c + accepted + 1
        self.num_sampled += len(run)
        return run, n - 1


def check_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    refs = [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert min(refs) >= 0
    assert bm.num_used == sum(1 for r in refs if r > 0)
    assert bm.num_free + bm.num_used == bm.num_blocks
    held = [0] * bm.num_blocks
    slots = set()
    for req in sched.running:
        assert len(req.block_ids) * sched.config.block_size >= req.num_computed_tokens
        assert req.num_computed_tokens <= req.num_tokens + req.num_inflight_samples
        assert req.slot is not None and req.slot not in slots and 0 <= req.slot < sched.config.max_num_seqs
        slots.add(req.slot)
        for b in req.block_ids:
            held[b] += 1
    assert held == refs, "reference counts differ from the running requests' block tables"
    if not sched.has_unfinished() and not sched.num_inflight_steps:
        assert bm.num_used == 0


def drive(sched: Scheduler, runner: FakeRunner, depth: int = 1, max_steps: int = 100_000,
          on_step=None, check: bool = True) -> list:
    """Run until nothing is left, keeping up to `depth` steps in flight. Returns every RequestUpdate."""
    inflight: deque = deque()
    updates = []
    for _ in range(max_steps):
        if not sched.has_unfinished() and not inflight:
            break
        plan = sched.schedule() if len(inflight) < depth else None
        if plan is not None:
            assert plan.num_tokens <= sched.config.max_num_batched_tokens
            assert len(plan.rows) <= sched.config.max_num_seqs
            inflight.append(runner.execute(plan))
        elif inflight:
            updates += sched.update(inflight.popleft())
        else:
            raise AssertionError("stalled: unfinished requests, nothing in flight, nothing scheduled")
        if check:
            check_invariants(sched)
        if on_step:
            on_step(sched, inflight)
    else:
        raise AssertionError("did not finish")
    return updates


def assert_matches_reference(reqs, max_total: int = 10**9, cut_short=()) -> None:
    """Each request's outputs equal an uninterrupted run's; those aborted, failed or finished by
    the driver (ids in cut_short) need only be a prefix of it."""
    for req in reqs:
        want, reason = reference(req.prompt_token_ids, req.params, req.eos_token_ids, max_total)
        if req.request_id in cut_short or req.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            assert req.output_token_ids == want[:len(req.output_token_ids)], req.request_id
        else:
            assert (req.output_token_ids, req.finish_reason) == (want, reason), req.request_id
