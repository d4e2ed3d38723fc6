"""Scheduler: continuous batching over a paged KV pool, driven by StepPlans and StepResults.

Each schedule() builds one StepPlan: running decode rows first (in arrival order), then
chunks of running prefills, then admissions from the waiting queue, all within
max_num_seqs rows and max_num_batched_tokens tokens. A decode row that finds no free block
preempts the newest running request (possibly itself): its blocks and slot are freed and
it waits at the front of the queue to be recomputed from prompt + outputs.

Prefix sharing in flight: a full block being computed by a running request is claimed under
its chain hash until the step that fills it is confirmed and the block is published. An
admission whose next uncached block is claimed waits (the requests behind it may pass) and
then hits the published block, so requests arriving together with the same prompt, such as
the n choices of one request, compute its full blocks once.

num_computed_tokens advances when a row is dispatched, so schedule() may run again
before the previous step's update() (pipelining). A decode row whose input token is
still in flight carries USE_RESIDENT. In-flight bookkeeping names each sampling row's
Request at dispatch time, so slot reuse is safe and tokens for requests that finished
meanwhile are discarded. Results must arrive in step order.

With max_concurrent_batches B > 1 (pipeline stages) any B consecutive steps hold disjoint
requests: a request sampled by one of the last B - 1 steps planned gets no decode row, a step
takes at most 1/B of the running decodes and admits at most its share of the running and
waiting requests, so B steps of about equal size keep B stages busy. With more than B steps
in flight, a request re-enters with USE_RESIDENT while its token is still in flight, as with
one stage: the first stage takes that token from the last directly.

With speculative decoding (num_lookahead_tokens k > 0) a request's decode row may verify up
to k tokens the worker drafts: the row is budgeted and given blocks for 1 + k positions (fewer
where max_tokens, max_model_len, the budget or the free blocks say so; never by preempting), and
its result brings 1 to k + 1 ids. Only then are the next positions known, so such a request sits
out the steps dispatched while its row is in flight (others fill them); the K/V of its rejected
positions is simply overwritten later. With lookahead_below n, no row gets lookahead while n or
more requests run, and rows pipeline as without speculation.
"""

from __future__ import annotations

import time
from bisect import insort
from collections import deque

from scheduler.blocks import BlockManager, extend_chain
from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, StepResult, WorkerSampling
from scheduler.request import FinishReason, Request, RequestStatus, RequestUpdate, SampleLogprobs
from scheduler.scheduler_config import SchedulerConfig
from scheduler.slot_pool import SlotPool
from scheduler.step import Step
from scheduler.waiting import WaitingQueue

RUNNING, WAITING, FINISHED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.FINISHED


def _arrival(req: Request) -> int:
    return req.arrival_seq


class Scheduler:
    """One replica's scheduler. Not thread-safe: one driver loop calls it."""

    def __init__(self, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"config must be a SchedulerConfig, got {config!r}")
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._max_len = config.max_total_tokens
        self._requests: dict[str, Request] = {}  # unfinished only, in arrival order
        self._waiting = WaitingQueue(self._max_len)
        self._running: list[Request] = []  # sorted by arrival_seq
        self._inflight: deque[Step] = deque()
        self._next_step_id = 0
        self._num_arrivals = 0
        self._num_admissions = 0
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_preemptions = 0
        self._num_draft_tokens = 0  # speculative decoding: tokens drafted, accepted, rows that had drafts
        self._num_accepted_tokens = 0
        self._num_verify_rows = 0
        self._slots = SlotPool(config.max_num_seqs)
        # chain hash -> the running request computing that full block (not yet published)
        self._claims: dict[bytes, Request] = {}
        self._num_prefix_waits = 0
        self._num_suspects = 0  # unfinished requests with num_failures > 0 (admitted one at a time)
        self._num_poisoned = 0  # requests failed as the likely cause of repeated worker failures

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.check_request(request)
        request.arrival_seq = self._num_arrivals
        self._num_arrivals += 1
        self._reset_bookkeeping(request)
        self._requests[request.request_id] = request
        self._waiting.push(request)

    def check_request(self, request: Request) -> None:
        """ValueError when add_request would refuse `request`: a duplicate id, no room in
        max_model_len or in the pool, sampling a worker would refuse. Builds its WorkerSampling."""
        rid, cfg = request.request_id, self.config
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already scheduled")
        if request.status is not WAITING:
            raise ValueError(f"request {rid!r} must be waiting to be added, got status {request.status.value}")
        n = request.num_tokens
        if n >= cfg.max_model_len:
            raise ValueError(f"request {rid!r} has {n} tokens; max_model_len {cfg.max_model_len} "
                             "leaves no room to generate")
        if -(-(n + 1) // cfg.block_size) > cfg.num_blocks:
            raise ValueError(
                f"request {rid!r} has {n} tokens: {n + 1} tokens need {-(-(n + 1) // cfg.block_size)} blocks "
                f"of {cfg.block_size}, the pool has {cfg.num_blocks}"
            )
        if request.worker_sampling is None:
            request.worker_sampling = WorkerSampling.from_params(
                request.params, request.num_prompt_tokens, request.eos_token_ids)
            request.worker_sampling.check()  # what a worker would refuse, refused here, naming the field

    # ---- planning -----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to compute and nothing to free."""
        cfg, bm = self.config, self.block_manager
        bs = cfg.block_size
        step = Step(self._next_step_id, cfg.max_num_batched_tokens, bs, cfg.enable_prefix_caching)
        prefilling: list[Request] = []

        # 1. decode rows of running requests, oldest first
        preempted = self._schedule_decodes(step, prefilling)

        # 2. next chunks of running prefills, shrunk to the free blocks; one with no room at
        #    all preempts the newest running request if that has no row in this plan yet
        running = self._running
        for req in prefilling:
            if not step.budget:
                break
            if req.status is not RUNNING:
                continue  # preempted just now for an older prefill
            c, held = req.num_computed_tokens, len(req.block_ids)
            n = min(req.num_sent_tokens - c, step.budget, (held + bm.num_free) * bs - c)
            while n <= 0 and running[-1] is not req and not step.has_row_for(running[-1].slot):
                self._preempt(running[-1])
                preempted = True
                n = min(req.num_sent_tokens - c, step.budget, (held + bm.num_free) * bs - c)
            if n > 0:
                new_blocks = bm.allocate(max(0, -(-(c + n) // bs) - held))
                req.block_ids += new_blocks
                step.add_prefill_row(req, n, new_blocks)

        # 3. admissions in queue order, unless this step had to preempt
        if not preempted:
            self._admit(step)

        if not step.rows and not self._slots.has_drops:
            return None
        plan = step.plan(*self._slots.take_drops())
        self._inflight.append(step)
        self._next_step_id += 1
        self._num_steps += 1
        self._num_prompt_tokens += step.prefill_tokens
        return plan

    def _schedule_decodes(self, step: Step, prefilling: list[Request]) -> bool:
        """One decode row per running request that has finished its prefill (the hot loop:
        inlined). Collects the others into `prefilling`. Returns whether it preempted."""
        bm, bs, max_len = self.block_manager, self.config.block_size, self._max_len
        caching = self.config.enable_prefix_caching
        rows, samples, slots, confirms = step.rows, step.samples, step.slots, step.confirms
        running = self._running
        budget = step.budget
        preempted = False
        batches, lookahead = self.config.max_concurrent_batches, self.config.num_lookahead_tokens
        step_id = step.step_id
        below = self.config.lookahead_below
        drafting = lookahead and (below is None or len(running) < below)  # a large batch gains little from it
        max_rows = -(-len(running) // batches) if batches > 1 else len(running)
        for req in list(running):
            if not budget or len(rows) >= max_rows:
                break
            if req.status is not RUNNING:
                break  # preempted for an older request's block: so is everything after it
            c = req.num_computed_tokens
            if c < req.num_sent_tokens:
                prefilling.append(req)
                continue
            outputs, pending = req.output_token_ids, req.num_inflight_samples
            if pending and (step_id - req.last_sample_step < batches or drafting or req.num_inflight_drafting):
                # in one of the last B steps planned: the B - 1 after it take other requests (B stages
                # kept busy by disjoint batches). A row that verifies drafts brings a run of ids, so
                # nothing after it can be planned; while drafting is off, a plain row pipelines as
                # without speculation, and while it is on, a request waits to draft again
                continue
            n_out = len(outputs)
            n_known = len(req.prompt_token_ids) + n_out
            if n_out + pending >= req.params.max_tokens or n_known + pending >= max_len:
                continue  # its last token is already in flight
            new_blocks = []
            if c >= len(req.block_ids) * bs:
                while not bm.num_free:
                    victim = running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status is not RUNNING:
                    break  # it was the newest: nothing after it
                new_blocks = bm.allocate(1)
                req.block_ids += new_blocks
            drafts = self._lookahead(req, c, n_out, n_known, budget, new_blocks) if drafting else 0
            if drafts:
                step.lookahead[len(samples)] = drafts
                req.num_inflight_drafting += 1
                budget -= drafts
            # the input is the last known token, or the one still in flight
            slot = req.slot
            rows.append(ScheduledRow(slot, 1 + drafts, new_blocks,
                                     outputs[c - n_known] if c < n_known else USE_RESIDENT))
            req.num_computed_tokens = c + 1
            req.num_inflight_samples = pending + 1
            req.last_sample_step = step_id
            if req.params.logprobs is not None:
                step.logprob_rows.append(len(samples))
            samples.append((req, c + 1))
            slots.append(slot)
            if caching and (c + 1) % bs == 0:
                confirms.append((req, req.admission, c + 1))
            budget -= 1
        step.budget = budget
        return preempted

    def _lookahead(self, req: Request, c: int, n_out: int, n_known: int, budget: int, new_blocks: list[int]) -> int:
        """How many drafted tokens the decode row of `req` (input at position c) may verify: at most
        num_lookahead_tokens, what max_tokens, max_model_len and the step's budget leave, and what
        the blocks it holds or can take without preempting hold. Takes those blocks."""
        bs, bm = self.config.block_size, self.block_manager
        n = min(self.config.num_lookahead_tokens, req.params.max_tokens - n_out - 1, self._max_len - n_known - 1,
                budget - 1)
        if n <= 0:
            return 0
        held = len(req.block_ids)
        more = min(-(-(c + n + 1) // bs) - held, bm.num_free)
        if more > 0:
            taken = bm.allocate(more)
            req.block_ids += taken
            new_blocks += taken
        return min(n, len(req.block_ids) * bs - c - 1)

    def _admit(self, step: Step) -> None:
        bm, bs = self.block_manager, self.config.block_size
        waiting = self._waiting
        passed: list[Request] = []  # waiting for a claimed block or its turn: back to the queue's front after
        suspect_running = self._num_suspects > 0 and any(r.num_failures for r in self._running)
        batches = self.config.max_concurrent_batches
        # B batches in turn: a step admits up to its share of every request, so a burst of arrivals
        # spreads over B steps (B stages prefilling at once) rather than filling one
        max_rows = -(-(len(self._running) + len(waiting)) // batches) if batches > 1 else None
        while waiting and step.budget and self._slots.num_free and (max_rows is None or len(step.rows) < max_rows):
            req = waiting.peek()
            if req.num_inflight_samples:
                break  # preempted with tokens in flight: its token list is not complete yet
            if req.num_failures and suspect_running:
                waiting.remove(req)  # on the worker at a failure: one such request at a time, to tell who it was
                passed.append(req)
                continue
            tokens = req.all_token_ids
            total = len(tokens)
            max_hits = (total - 1) // bs
            hits = bm.match_prefix(tokens, req.block_hashes, max_hits)
            if self._claims and len(hits) < max_hits and req.block_hashes[len(hits)] in self._claims:
                waiting.remove(req)  # another request is computing its next block: hit it later
                passed.append(req)
                self._num_prefix_waits += 1
                continue
            hit_tokens = len(hits) * bs
            n = min(total - hit_tokens, step.budget)
            num_new = -(-(hit_tokens + n) // bs) - len(hits)
            if not bm.can_allocate(num_new, hits):
                break
            waiting.remove(req)
            bm.record_lookup(total, hit_tokens)
            bm.acquire(hits)
            req.block_ids = hits + bm.allocate(num_new)
            req.slot = self._slots.take()
            req.status = RUNNING
            self._num_admissions += 1
            req.admission = self._num_admissions
            req.num_sent_tokens = total
            req.num_computed_tokens = req.num_cached_tokens = hit_tokens
            req.num_published_blocks = len(hits)
            self._claim(req, total // bs)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            insort(self._running, req, key=_arrival)
            suspect_running = suspect_running or req.num_failures > 0
            step.new_requests.append(NewRequest(req.slot, tokens, hit_tokens, list(req.block_ids), req.worker_sampling,
                                                req.num_prompt_tokens))
            step.add_prefill_row(req, n, [])
        for req in reversed(passed):
            waiting.push(req, front=True)

    def _claim(self, req: Request, num_full: int) -> None:
        """Claim the full blocks the admitted request will compute, up to num_full."""
        if not self.config.enable_prefix_caching or num_full <= req.num_published_blocks:
            return
        extend_chain(req.block_hashes, req.prompt_token_ids, req.output_token_ids, num_full, self.config.block_size)
        claims = self._claims
        for h in req.block_hashes[req.num_published_blocks:num_full]:
            claims.setdefault(h, req)
        req.num_claimed_blocks = num_full

    def _unclaim(self, req: Request, start: int, end: int) -> None:
        claims = self._claims
        for h in req.block_hashes[start:min(end, req.num_claimed_blocks)]:
            if claims.get(h) is req:
                del claims[h]

    # ---- results ------------------------------------------------------------------------
    def update(self, result: StepResult) -> list[RequestUpdate]:
        if not self._inflight:
            raise ValueError(f"result for step {result.step_id} but no step is in flight")
        step = self._inflight[0]
        ids, counts, drafted = step.check(result)
        self._inflight.popleft()

        for req, admission, computed in step.confirms:
            if req.admission == admission and req.status is RUNNING:
                self._publish(req, computed)

        logprobs: dict[int, list] = {}  # result row -> its tokens' logprobs (a verified run's, in order)
        for lp in result.logprobs or ():
            logprobs.setdefault(lp.row, []).append(lp)
        updates = []
        now = time.monotonic()
        max_len = self._max_len
        start = 0
        for k, (req, position) in enumerate(step.samples):
            n = 1 if counts is None else counts[k]
            if drafted is not None and drafted[k]:
                self._count_speculation(req, drafted[k], n - 1)
            start += n
            if req.status is FINISHED:
                continue  # finished meanwhile: the extra token is discarded
            if position != len(req.prompt_token_ids) + len(req.output_token_ids):
                raise RuntimeError(f"request {req.request_id!r}: token for position {position} arrived out of order")
            req.num_inflight_samples -= 1
            if k in step.lookahead:
                req.num_inflight_drafting -= 1
            if req.num_failures:  # it was sampled: it did not take the worker down
                req.num_failures = 0
                self._num_suspects -= 1
            new_logprobs = []
            if n == 1:
                token = ids[start - 1]
                if req.params.logprobs is not None:
                    lp = logprobs[k][0]
                    new_logprobs = [SampleLogprobs(token, lp.sampled, lp.top_ids, lp.top_logprobs)]
                reason = req.append_output(token, new_logprobs, now, max_len)
                new_ids = [token]
            else:  # a verified run: its drafts' K/V stay, up to the first token that stops it
                new_ids = []
                run_lps = logprobs.get(k, [])
                for j, token in enumerate(ids[start - n:start]):
                    new_ids.append(token)
                    lps = []
                    if req.params.logprobs is not None:
                        lp = run_lps[j]
                        lps = [SampleLogprobs(token, lp.sampled, lp.top_ids, lp.top_logprobs)]
                        new_logprobs += lps
                    reason = req.append_output(token, lps, now, max_len)
                    if reason is not None:
                        break
                if reason is None and req.status is RUNNING:
                    req.num_computed_tokens += n - 1
                    if self.config.enable_prefix_caching:
                        self._publish(req, req.num_computed_tokens)
            if reason is not None:
                self._finish(req, reason, now)
            updates.append(RequestUpdate(req, new_ids, new_logprobs, reason is not None))
            self._num_generated_tokens += len(new_ids)
        return updates

    def _count_speculation(self, req: Request, drafted: int, accepted: int) -> None:
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        self._num_draft_tokens += drafted
        self._num_accepted_tokens += accepted
        self._num_verify_rows += 1

    def sampling_rows(self, step_id: int) -> list[tuple[WorkerSampling, int]]:
        """Each sampling row of an in-flight step (plan order): its params and the position it samples."""
        for step in self._inflight:
            if step.step_id == step_id:
                return [(req.worker_sampling, position) for req, position in step.samples]
        raise ValueError(f"step {step_id} is not in flight")

    def sampling_histories(self, step_id: int) -> list[tuple[list[int], list[int]] | None]:
        """Each sampling row's (prompt ids, output ids before its position) when its params
        have penalties, else None: what host-logits mode counts (one step in flight there)."""
        for step in self._inflight:
            if step.step_id == step_id:
                return [(req.prompt_token_ids, req.output_token_ids[:position - req.num_prompt_tokens])
                        if req.worker_sampling.has_penalties else None for req, position in step.samples]
        raise ValueError(f"step {step_id} is not in flight")

    def _publish(self, req: Request, computed: int) -> None:
        """Offer the request's blocks that the confirmed `computed` tokens filled to the cache."""
        n_full = computed // self.config.block_size
        if n_full > req.num_published_blocks:
            self.block_manager.publish_chain(req.block_ids, req.block_hashes, req.prompt_token_ids,
                                             req.output_token_ids, req.num_published_blocks, n_full)
            self._unclaim(req, req.num_published_blocks, n_full)
            req.num_published_blocks = n_full

    # ---- ending requests ----------------------------------------------------------------
    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish a request the driver decided is done (a stop string): frees its blocks."""
        if not isinstance(reason, FinishReason):
            raise ValueError(f"reason must be a FinishReason, got {reason!r}")
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._finish(req, reason, time.monotonic())
        return req

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, FinishReason.ABORT)

    def fail_all(self, message: str) -> list[Request]:
        """Finish every unfinished request with ERROR. In-flight steps stay in flight
        (their tokens will be discarded); call recover() too if the worker lost its state."""
        failed = list(self._requests.values())
        now = time.monotonic()
        for req in failed:
            req.error = message
            self._finish(req, FinishReason.ERROR, now)
        return failed

    def recover(self, max_failures: int = 0) -> list[Request]:
        """The worker lost all its state: forget in-flight steps, the pool, the cache and the
        slots; every unfinished request waits again, in arrival order, to be recomputed.

        With `max_failures` > 0 the failure counts against the requests that were on the worker:
        one that reaches `max_failures` failures in a row (no token of it sampled in between) is
        finished with ERROR and returned, so a request that kills every worker it reaches is not
        replayed forever; the others wait again, and those with a failure on their record are
        admitted one at a time, so an innocent one is not on the worker when the culprit strikes."""
        failed = []
        if max_failures > 0:
            now = time.monotonic()
            for req in list(self._running):
                if not req.num_failures:
                    self._num_suspects += 1
                req.num_failures += 1
                if req.num_failures >= max_failures:
                    req.error = (f"request {req.request_id!r} was on the worker at {req.num_failures} failures of "
                                 "it in a row; failed as their likely cause (max_request_failures)")
                    self._finish(req, FinishReason.ERROR, now)
                    self._num_poisoned += 1
                    failed.append(req)
        self._recover_state()
        return failed

    def _recover_state(self) -> None:
        self._inflight.clear()
        self.block_manager.reset()
        self._claims.clear()
        self._slots.reset()
        self._running = []
        self._waiting.clear()
        for req in self._requests.values():  # dict order is arrival order
            req.status = WAITING
            self._reset_bookkeeping(req)
            self._waiting.push(req)

    def _finish(self, req: Request, reason: FinishReason, now: float) -> None:
        if req.num_failures:
            self._num_suspects -= 1
        if req.status is RUNNING:
            self._running.remove(req)
            self._release(req, preempted=False)
        elif req.status is WAITING:
            self._waiting.remove(req)
        req.status = FINISHED
        req.finish_reason = reason
        req.finish_time = now
        del self._requests[req.request_id]

    def _preempt(self, req: Request) -> None:
        if self._running[-1] is req:
            self._running.pop()
        else:
            self._running.remove(req)
        self._release(req, preempted=True)
        req.status = WAITING
        req.num_computed_tokens = 0
        req.num_sent_tokens = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.push(req, front=True)

    def _release(self, req: Request, preempted: bool) -> None:
        self._unclaim(req, req.num_published_blocks, req.num_claimed_blocks)
        req.num_claimed_blocks = 0
        self.block_manager.free(req.block_ids)
        req.block_ids = []
        self._slots.release(req.slot, preempted)
        req.slot = None

    @staticmethod
    def _reset_bookkeeping(req: Request) -> None:
        req.slot = None
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_sent_tokens = 0
        req.num_inflight_samples = 0
        req.num_inflight_drafting = 0
        req.num_published_blocks = 0
        req.num_claimed_blocks = 0

    # ---- introspection ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def requests(self) -> list[Request]:
        """The unfinished requests, in arrival order."""
        return list(self._requests.values())

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are not kept)."""
        return self._requests.get(request_id)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def outstanding_tokens(self) -> int:
        """Tokens still to compute or generate over unfinished requests (routing among replicas)."""
        max_len = self._max_len
        return self._waiting.outstanding_tokens + sum(r.num_outstanding_tokens(max_len) for r in self._running)

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Read-only prefix-cache lookup (routing): leading tokens an admission would hit."""
        return self.block_manager.cached_prefix_tokens(token_ids)

    def stats(self) -> dict:
        """Counters since start. prompt_tokens: tokens computed by prefill rows (recomputation
        included, prefix-cache hits not); generated_tokens: tokens appended by update();
        prefix_waits: times an admission waited for a block another request was computing;
        poisoned_requests: failed by recover() as the likely cause of repeated worker failures;
        suspect_requests: unfinished ones with a worker failure on their record; spec_*: speculative
        decoding's drafted and accepted tokens and the rows that verified drafts."""
        bm = self.block_manager
        return {
            "steps": self._num_steps,
            "prompt_tokens": self._num_prompt_tokens,
            "generated_tokens": self._num_generated_tokens,
            "prefix_queried_tokens": bm.queried_tokens,
            "prefix_hit_tokens": bm.hit_tokens,
            "prefix_hit_rate": bm.hit_tokens / bm.queried_tokens if bm.queried_tokens else 0.0,
            "kv_blocks_used": bm.num_used,
            "kv_blocks_total": bm.num_blocks,
            "num_preemptions": self._num_preemptions,
            "prefix_waits": self._num_prefix_waits,
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "poisoned_requests": self._num_poisoned,
            "suspect_requests": self._num_suspects,
            "spec_draft_tokens": self._num_draft_tokens,
            "spec_accepted_tokens": self._num_accepted_tokens,
            "spec_verify_rows": self._num_verify_rows,
            "spec_acceptance_rate": self._num_accepted_tokens / self._num_draft_tokens if self._num_draft_tokens
            else 0.0,
            # tokens each verifying row produced: its accepted drafts and the one after them
            "spec_mean_accepted_length": 1 + self._num_accepted_tokens / self._num_verify_rows
            if self._num_verify_rows else 0.0,
        }
