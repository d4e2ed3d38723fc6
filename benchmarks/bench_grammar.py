"""What structured output costs a decode step: the bundled tiny model, B requests decoding
side by side, with no grammar and with a JSON schema on every row (fill the bitmask on the
host, one copy, mask the logits, advance the matchers).

    PYTHONPATH=. python benchmarks/bench_grammar.py [--batches 1,8,32] [--steps 24] [--repeats 3]

Prints the median decode step time of each and their ratio. A script, not a test. The
tiny model's vocab is 2048 ids; a real Qwen3 vocab (151936) makes the bitmask 74x wider.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from scheduler.grammar_spec import GrammarSpec
from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling
from workers.loader import bundled_model_path, load_tokenizer
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def decode_step_times(batch: int, steps: int, grammar: GrammarSpec | None, prompt: list[int]) -> list[float]:
    bs = 16
    per_seq = -(-(len(prompt) + steps + 2) // bs)
    runner = ModelRunner(RunnerConfig(block_size=bs, num_kv_blocks=batch * per_seq, max_num_seqs=batch,
                                      num_threads=1))
    sampling = WorkerSampling(grammar=grammar, grammar_start=len(prompt))
    new = [NewRequest(i, list(prompt), 0, list(range(i * per_seq, (i + 1) * per_seq)), sampling)
           for i in range(batch)]
    runner.execute(StepPlan(0, new_requests=new, rows=[ScheduledRow(i, len(prompt)) for i in range(batch)]))
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        runner.execute(StepPlan(step, rows=[ScheduledRow(i, 1, [], USE_RESIDENT) for i in range(batch)]))
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = load_tokenizer(bundled_model_path())
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about Paris."}],
                                                tokenize=False, add_generation_prompt=True, enable_thinking=False))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    print(f"{'batch':>5} {'plain ms':>9} {'schema ms':>10} {'ratio':>6}")
    for b in (int(x) for x in args.batches.split(",")):
        plain, constrained = [], []
        for _ in range(args.repeats):  # interleaved, so load on a shared machine hits both alike
            plain += decode_step_times(b, args.steps, None, prompt)
            constrained += decode_step_times(b, args.steps, spec, prompt)
        p, c = statistics.median(plain) * 1e3, statistics.median(constrained) * 1e3
        print(f"{b:>5} {p:>9.2f} {c:>10.2f} {c / p:>6.2f}")


if __name__ == "__main__":
    main()
