"""Speculative decoding's own cost and its speed-up by each method, in-process (ModelRunner + Scheduler).

    PYTHONPATH=. python benchmarks/bench_spec.py [--model random:qwen3-0.6b?layers=8] [--batches 1]
        [--prompt-len 32] [--new-tokens 128] [--k 4] [--repeats 2] [--tiny-batches 1,16] [--vllm]

Part 1, the machinery: at each batch size, greedy decoding without speculation against a
bench-only proposer that drafts the request's known greedy continuation (taken from the run
without speculation), every draft right (acceptance 100%) or the third of every four wrong
(acceptance 50%), k drafts a row: what verifying k + 1 positions in one pass and accepting on the
worker cost, apart from draft quality. Part 2: the bundled tiny model with method ngram
(prompt lookup), its draft model and its EAGLE-3 head on short English prompts, at the
`--tiny-batches` sizes. Part 3 (`--vllm`, after `make peers`): each method with the same k in
raylm and in vLLM's CPU build (a subprocess, cluster/bench/vllm_peer.py), whole requests timed
turn about. Contenders run in rotating order, `repeats` times each; prints their median output
tokens/s, the ratio to no speculation (or to vLLM), the acceptance and whether greedy output is the
same.
The model computes in fp32. A script, not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from workers.loader import bundled_draft_path, bundled_eagle3_path, bundled_model_path, load_tokenizer
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig
from workers.spec_config import SpeculativeConfig


class KnownContinuation(ModelRunner):
    """Drafts each row's known greedy continuation; with `wrong_every` n, the draft at every n-th
    position is made wrong (bench only: the machinery's cost apart from draft quality)."""

    continuations: dict[tuple[int, ...], list[int]] = {}
    wrong_every = 0

    def _draft(self, rows) -> None:
        for w in rows:
            if not w.lookahead:
                continue
            st = w.state
            prompt = tuple(st.token_ids[:st.num_prompt])
            done = w.start + 1 - st.num_prompt  # outputs known so far
            draft = list(self.continuations[prompt][done:done + w.lookahead])
            if self.wrong_every:
                for j in range(len(draft)):
                    if (j + 1) % self.wrong_every == 0:
                        draft[j] = (draft[j] + 1) % self.vocab_size
            w.draft = draft or None


def run(model: str, prompts: list[list[int]], new_tokens: int, spec: SpeculativeConfig | None,
        runner_cls=ModelRunner, threads: int = 2, with_prefill: bool = False) -> tuple[float, list[list[int]], dict]:
    k = 0 if spec is None else spec.num_speculative_tokens
    runner = runner_cls(RunnerConfig(model=model, dtype="float32", block_size=16, num_kv_blocks=2048,
                                     max_num_seqs=len(prompts), max_num_batched_tokens=4096, num_threads=threads,
                                     speculative=spec))
    try:
        runner.warmup()
        sched = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=16, max_num_seqs=len(prompts),
                                          max_num_batched_tokens=4096, max_model_len=runner.max_model_len,
                                          num_lookahead_tokens=k))
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        reqs = [Request(f"b{i}", list(p), params) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add_request(r)
        t0 = time.perf_counter()
        if not with_prefill:
            sched.update(runner.execute(sched.schedule()))  # the prefills, untimed: decode is measured
            t0 = time.perf_counter()
        while sched.has_unfinished():
            sched.update(runner.execute(sched.schedule()))
        wall = time.perf_counter() - t0
        stats = sched.stats()
    finally:
        runner.close()
    decoded = sum(len(r.output_token_ids) - (not with_prefill) for r in reqs)
    return decoded / wall, [r.output_token_ids for r in reqs], stats


def line(name: str, tok_s: float, base: float, same: bool, stats: dict) -> str:
    acc = (f"acceptance {stats['spec_acceptance_rate']:.2f}, {stats['spec_mean_accepted_length']:.2f} tokens/row"
           if stats["spec_draft_tokens"] else "")
    return f"  {name:<34} {tok_s:8.1f} tok/s  x{tok_s / base:.2f}  greedy same: {same}  {acc}"


def alternate(repeats: int, contenders: dict[str, tuple]) -> dict[str, tuple[float, list, dict]]:
    """Each contender's run(*args) `repeats` times, in rotating order (this machine's speed drifts
    within minutes: alternating keeps the ratios of one run honest): its median tok/s, its first
    run's outputs and stats."""
    runs: dict[str, list] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run(*contenders[name]))
    return {name: (statistics.median(x[0] for x in rs), rs[0][1], rs[0][2]) for name, rs in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b?layers=8")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny-batches", default="1,16")
    ap.add_argument("--vllm", action="store_true", help="part 3: against vLLM's CPU build (make peers)")
    ap.add_argument("--peers-venv", default=None)
    a = ap.parse_args()
    rng = random.Random(0)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": a.k})
    print(f"part 1: {a.model}, prompts of {a.prompt_len} random ids, {a.new_tokens} greedy tokens, k={a.k}, "
          f"decode only, median of {a.repeats}")
    for batch in (int(b) for b in a.batches.split(",")):
        prompts = [[rng.randrange(100, 50000) for _ in range(a.prompt_len)] for _ in range(batch)]
        _, want, _ = run(a.model, prompts, a.new_tokens, None)  # the continuation the proposer drafts
        KnownContinuation.continuations = {tuple(p): out for p, out in zip(prompts, want)}
        right = type("AllRight", (KnownContinuation,), {"wrong_every": 0})
        half = type("ThirdWrong", (KnownContinuation,), {"wrong_every": 3})
        figs = alternate(a.repeats, {"no speculation": (a.model, prompts, a.new_tokens, None),
                                     "known continuation, all right": (a.model, prompts, a.new_tokens, spec, right),
                                     "known continuation, 3rd of 4 wrong": (a.model, prompts, a.new_tokens, spec,
                                                                            half)})
        base = figs["no speculation"][0]
        print(f" batch {batch}")
        for name, (tok_s, got, stats) in figs.items():
            print(line(name, tok_s, base, got == want, stats))
    tok = load_tokenizer(bundled_model_path())
    texts = ["The cat sat on the mat. The dog sat on the log. The cat sat on the",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
             "one two three four five, one two three four five, one two three",
             "Hello, how are you today? I am fine. Hello, how are"]
    print(f"part 2: the bundled tiny model, method ngram (prompt_lookup 1..3), its draft model and its "
          f"EAGLE-3 head, k={a.k}, {a.new_tokens} tokens")
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": a.k,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    draft = SpeculativeConfig.from_dict({"method": "draft_model", "model": bundled_draft_path(),
                                         "num_speculative_tokens": a.k})
    eagle = SpeculativeConfig.from_dict({"method": "eagle3", "model": bundled_eagle3_path(),
                                         "num_speculative_tokens": a.k})
    for batch in (int(b) for b in a.tiny_batches.split(",")):
        prompts = [tok.encode(texts[i % len(texts)]) for i in range(batch)]
        figs = alternate(a.repeats, {"no speculation": (None, prompts, a.new_tokens, None),
                                     "ngram": (None, prompts, a.new_tokens, ngram),
                                     "draft model (1 layer)": (None, prompts, a.new_tokens, draft),
                                     "EAGLE-3 head": (None, prompts, a.new_tokens, eagle)})
        base, want = figs["no speculation"][0], figs["no speculation"][1]
        print(f" batch {batch}")
        for name, (tok_s, got, stats) in figs.items():
            print(line(name, tok_s, base, got == want, stats))
    if a.vllm:
        against_vllm(a, [tok.encode(texts[i % len(texts)]) for i in range(max(map(int, a.tiny_batches.split(","))))],
                     {"ngram": ngram, "draft_model": draft, "eagle3": eagle})


def against_vllm(a, prompts: list[list[int]], specs: dict[str, SpeculativeConfig]) -> None:
    """Part 3: the same method and k in vLLM's CPU build and in raylm, whole requests timed
    (prefill included, as `LLM.generate` is), turn about, median of `repeats`."""
    from cluster.bench.vllm_peer import VLLMPeer

    print(f"part 3: the bundled tiny model against vLLM's CPU build, fp32, k={a.k}, {a.new_tokens} tokens, "
          f"whole requests, median of {a.repeats}")
    for method, spec in {"none": None, **specs}.items():
        vspec = None if spec is None else {"method": method, "num_speculative_tokens": a.k, **(
            {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {"model": spec.model})}
        try:
            peer = VLLMPeer(bundled_model_path(), dtype="float32", max_num_seqs=len(prompts),
                            max_num_batched_tokens=4096, block_size=None, threads=2, venv=a.peers_venv,
                            log_path=f"/tmp/bench_spec_vllm_{method}.log", speculative_config=vspec)
        except RuntimeError as e:
            print(f"  {method:<12} vLLM refused it: {str(e)[:300]}")
            continue
        with peer:
            for batch in (int(b) for b in a.tiny_batches.split(",")):
                ours, theirs, same = [], [], True
                for _ in range(a.repeats):
                    tok_s, got, stats = run(None, prompts[:batch], a.new_tokens, spec, with_prefill=True)
                    elapsed, outs = peer.run(prompts[:batch], [a.new_tokens] * batch)
                    ours.append(tok_s)
                    theirs.append(sum(map(len, outs)) / elapsed)
                    same = same and outs == got
                r, v = statistics.median(ours), statistics.median(theirs)
                print(f"  {method:<12} batch {batch:>2}: raylm {r:8.1f} tok/s  vLLM {v:8.1f}  x{r / v:.2f}  "
                      f"greedy same: {same}")


if __name__ == "__main__":
    main()
