"""FakeRunner: a worker without a model, for measuring the driver (`raylm bench --driver-capacity`).

It stands where ModelRunner stands in a WorkerActor (EngineConfig.fake_step_s): the real plan bytes
arrive over the real step channel, are validated and applied to the same SlotTable, and every row
that samples gets an id, a pure function of its slot and position, once the step has taken
`fake_step_s` (a device's step time stood in for; 0: at once). No tensor is made, no KV pool
allocated, nothing computed, so what limits throughput is the engine: its scheduler, plan
encoding, result handling, detokenizer and streams.
Benchmarks only; a request with a grammar is refused (there are no logits to mask).
"""

from __future__ import annotations

import time

from scheduler.protocol import StepPlan, StepResult, pack_int32
from workers.loader import bundled_model_path, is_random_spec, load_config, parse_random_spec, random_spec_config
from workers.runner_config import RunnerConfig
from workers.slot_table import SlotTable

FAKE_KV_BLOCKS = 65536  # the pool a fake worker reports when not told: it holds nothing, so any size is free


class _NoGrammars:
    cache = None

    def check_new(self, new_requests) -> None:
        for req in new_requests:
            if req.sampling.grammar is not None:
                raise ValueError(f"slot {req.slot}: a fake worker (fake_step_s) runs no grammars")

    def prefetch(self, spec) -> str:
        return "a fake worker (fake_step_s) runs no grammars"

    def stats(self) -> dict:
        return {}


def fake_token(slot: int, position: int, vocab_size: int) -> int:
    """The id a fake worker answers for `slot`'s token at `position`: from the vocabulary's second
    quarter, ordinary tokens in Qwen3's (and the bundled tiny model's), away from the special ones
    at its end, so the detokenizer does the work it does for real text."""
    lo = vocab_size // 4
    return lo + (slot * 31 + position) % lo


class FakeRunner:
    def __init__(self, config: RunnerConfig) -> None:
        if config.device_outputs is False:
            raise ValueError("a fake worker answers ids itself: device_outputs must be on (it has no logits to return)")
        self.config = config
        model = config.model or bundled_model_path()
        mc = random_spec_config(parse_random_spec(model)) if is_random_spec(model) else load_config(model)
        self.vocab_size = mc.vocab_size
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.num_kv_blocks = config.num_kv_blocks or FAKE_KV_BLOCKS
        self.slots = SlotTable(max_num_seqs=config.max_num_seqs, num_blocks=self.num_kv_blocks,
                               block_size=config.block_size, max_model_len=self.max_model_len,
                               vocab_size=mc.vocab_size, max_num_batched_tokens=config.max_num_batched_tokens)
        self.grammars = _NoGrammars()
        self.device = "none"
        self.num_steps = 0
        self.num_tokens = 0

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.grammars.check_new(plan.new_requests)
        rows = [w for w in self.slots.apply(plan) if w.samples]
        ids = [fake_token(w.slot, w.start + w.num_tokens, self.vocab_size) for w in rows]
        result = StepResult(step_id=plan.step_id, slots=[w.slot for w in rows], token_ids=pack_int32(ids))
        for w in rows:
            w.state.has_resident = True
        if self.config.fake_step_s:  # a device's step time, stood in for
            time.sleep(max(0.0, self.config.fake_step_s - (time.perf_counter() - t0)))
        self.num_steps += 1
        self.num_tokens += plan.num_tokens
        result.step_time = time.perf_counter() - t0
        return result

    def warmup(self) -> None:
        pass

    def bind_thread(self) -> None:
        pass

    def stats(self) -> dict:
        return {"fake": True, "steps": self.num_steps, "tokens": self.num_tokens, "active_slots": len(self.slots),
                "kv_blocks": self.num_kv_blocks, "weight_bytes": 0, "device": "none", "device_outputs": True}

    def moe_report(self) -> None:
        return None

    def cpu_thread_report(self) -> None:
        return None

    def close(self) -> None:
        self.slots.clear()
