"""A minimal plan builder for runner tests: allocates blocks and slots, chunks prefills,
sends decode rows with explicit ids or USE_RESIDENT, and collects sampled tokens.

It stands in for the real Scheduler (written elsewhere) so runner tests depend only on
scheduler/protocol.py. Greedy sampling unless a request says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, StepResult, WorkerSampling


@dataclass
class Req:
    slot: int
    tokens: list[int]  # prompt + outputs known to the driver
    num_prompt: int  # tokens to prefill: the prompt, plus outputs when recomputing
    sampling: WorkerSampling
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    sent: bool = False
    outputs: list[int] = field(default_factory=list)
    prompt_len: int | None = None  # NewRequest.num_prompt: None when every prefilled token is prompt

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_prompt


class PlanDriver:
    def __init__(self, runner, *, chunk_size: int | None = None, resident: bool = True) -> None:
        self.runner = runner
        self.block_size = runner.config.block_size
        self.free_blocks = list(range(runner.num_kv_blocks))
        self.free_slots = list(range(runner.config.max_num_seqs))
        self.chunk_size = chunk_size
        self.resident = resident
        self.running: list[Req] = []
        self.finished: list[int] = []
        self.step_id = 0
        self.plans: list[StepPlan] = []
        self.results: list[StepResult] = []

    def add(self, prompt: list[int], sampling: WorkerSampling | None = None, *,
            cached_blocks: list[int] = (), generated: list[int] = ()) -> Req:
        """cached_blocks: full blocks (of another request) holding this prompt's first tokens;
        generated: outputs it already has (recomputed as after a preemption or a restart)."""
        tokens = list(prompt) + list(generated)
        req = Req(self.free_slots.pop(0), tokens, len(tokens), sampling or WorkerSampling(),
                  num_computed=len(cached_blocks) * self.block_size, block_table=list(cached_blocks),
                  prompt_len=len(prompt) if generated else None)
        self.running.append(req)
        return req

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        self.finished.append(req.slot)
        self.free_slots.append(req.slot)

    def _grow(self, req: Req, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size) - len(req.block_table)
        new = [self.free_blocks.pop(0) for _ in range(max(0, need))]
        req.block_table.extend(new)
        return new

    def plan(self) -> StepPlan:
        plan = StepPlan(step_id=self.step_id, finished=self.finished)
        self.finished = []
        self.step_id += 1
        for req in self.running:
            if req.prefilling:
                n = len(req.tokens) - req.num_computed
                n = min(n, self.chunk_size or n)
                new = self._grow(req, req.num_computed + n)
                token = None
            else:
                n = 1
                new = self._grow(req, req.num_computed + 1)
                token = USE_RESIDENT if self.resident else req.tokens[-1]
            if not req.sent:
                plan.new_requests.append(NewRequest(req.slot, list(req.tokens), req.num_computed,
                                                    list(req.block_table), req.sampling, req.prompt_len))
                req.sent = True
                new = []
            plan.rows.append(ScheduledRow(req.slot, n, new, token))
            req.num_computed += n
        return plan

    def step(self, ids_from_logits=None) -> StepResult:
        """Run one plan; sampled ids come from the result, or from `ids_from_logits(result)`."""
        plan = self.plan()
        result = self.runner.execute(plan)
        self.plans.append(plan)
        self.results.append(result)
        ids = ids_from_logits(result) if ids_from_logits else result.sampled_ids()
        by_slot = {r.slot: r for r in self.running}
        for slot, token in zip(result.slots, ids):
            req = by_slot[slot]
            req.tokens.append(token)
            req.outputs.append(token)
        return result

    def generate(self, max_new_tokens: int, ids_from_logits=None) -> list[list[int]]:
        """Step until every running request has max_new_tokens outputs."""
        reqs = list(self.running)
        while any(len(r.outputs) < max_new_tokens for r in reqs):
            self.step(ids_from_logits)
        return [r.outputs[:max_new_tokens] for r in reqs]
