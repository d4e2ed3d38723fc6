"""Speculative decoding on the worker: the config's vLLM keys and errors, prompt lookup, and the
bundled model's outputs with speculation (n-gram, draft models, EAGLE-3 heads, trained and random)
equal to its outputs without, through prefix hits, preemption, chunked prefill, pipelining, tensor
parallelism and seeded sampling in the same batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.config import EngineConfig
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from tests.factories import drive
from tests.workers.tp_ranks import job, run_ranks
from workers.loader import bundled_draft_path, bundled_eagle3_path, bundled_model_path
from workers.ngram import propose_ngram
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig
from workers.spec_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_config_takes_vllms_keys():
    cfg = SpeculativeConfig.from_dict(NGRAM)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 1, 3)
    one = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)  # the other bound follows the one given
    old = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2})
    assert old.method == "ngram"
    draft = SpeculativeConfig.from_dict({"model": "/models/Qwen3-0.6B", "num_speculative_tokens": 2})
    assert (draft.method, draft.model) == ("draft_model", "/models/Qwen3-0.6B")  # inferred, as vLLM does
    assert EngineConfig(speculative_config=NGRAM).scheduler_config(num_blocks=8, max_model_len=64) \
        .num_lookahead_tokens == 4
    limited = EngineConfig(speculative_config={**NGRAM, "disable_by_batch_size": 16})
    assert limited.scheduler_config(num_blocks=8, max_model_len=64).lookahead_below == 16


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "method 'eagle' is not supported yet"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' needs model"),
    ({"method": "beam", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model, eagle3, got 'beam'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4 must be <= prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, "prompt_lookup_max must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "ngram", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 2}, "leave model unset"),
    ("ngram", "must be a mapping"),
])
def test_bad_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_speculation_with_pipeline_parallelism_is_refused_for_now():
    with pytest.raises(ValueError, match="pipeline_parallel_size 1 for now, got 2"):
        EngineConfig(speculative_config=NGRAM, pipeline_parallel_size=2)


def naive_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_equals_a_plain_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        for min_n, max_n, k in ((1, 3, 4), (2, 2, 1), (1, 5, 8)):
            assert propose_ngram(np.array(tokens), min_n=min_n, max_n=max_n, k=k) == \
                naive_lookup(tokens, min_n, max_n, k), tokens


PROMPTS = [[5, 100, 200, 5, 100, 200, 5, 100], list(range(10, 40)), [7] * 17, [1200, 3, 800, 44, 9, 1, 1200, 3],
           [5, 100, 200, 5, 100, 200, 5, 100, 300, 301]]


def save_random_qwen3(path, *, layers: int = 1, vocab_size: int | None = None, seed: int = 7) -> str:
    """A Qwen3 checkpoint of the bundled model's shape cut to `layers`, random weights."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    d = AutoConfig.from_pretrained(bundled_model_path()).to_dict()
    d["num_hidden_layers"] = layers
    d["layer_types"] = d["layer_types"][:layers]
    if vocab_size is not None:
        d["vocab_size"] = vocab_size
    torch.manual_seed(seed)
    Qwen3ForCausalLM(type(AutoConfig.from_pretrained(bundled_model_path()))(**d)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A one-layer draft with the bundled model's vocab and random weights: mostly wrong, so
    exactness cannot lean on draft quality."""
    return save_random_qwen3(tmp_path_factory.mktemp("draft") / "random-draft")


def run_requests(speculative, reqs: list[Request], *, num_blocks=256, budget=64, depth=1) -> tuple[dict, dict]:
    """`reqs` through a Scheduler and a ModelRunner of the bundled model, in-process: their stats."""
    runner = ModelRunner(RunnerConfig(block_size=4, num_kv_blocks=num_blocks, max_num_seqs=8,
                                      max_num_batched_tokens=budget, speculative=speculative))
    sched = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=4, max_num_seqs=8,
                                      max_num_batched_tokens=budget, max_model_len=runner.max_model_len,
                                      num_lookahead_tokens=0 if speculative is None else
                                      speculative.num_speculative_tokens))
    for r in reqs:
        sched.add_request(r)
    drive(sched, runner, depth=depth)
    return sched.stats(), runner.stats()


def generate(speculative, *, seeded=False, max_tokens=40, **kw):
    """Every prompt's greedy output (and a seeded sampled one's)."""
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    if seeded:
        reqs.append(Request("seeded", PROMPTS[0], SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=3,
                                                                 ignore_eos=True)))
    sched_stats, runner_stats = run_requests(speculative, reqs, **kw)
    generate.requests = reqs  # the last call's, for per-request figures
    return [r.output_token_ids for r in reqs], sched_stats, runner_stats


@pytest.fixture(scope="module")
def plain():
    return generate(None, seeded=True)[0]


@pytest.mark.parametrize("case", [
    {}, {"depth": 2}, {"budget": 7}, {"num_blocks": 30}, {"k": 1}, {"k": 8},
], ids=["whole", "pipelined", "chunked", "preempting", "k1", "k8"])
def test_greedy_outputs_equal_those_without_speculation(plain, case):
    case = dict(case)
    k = case.pop("k", 4)
    spec = SpeculativeConfig.from_dict({**NGRAM, "num_speculative_tokens": k})
    outputs, sched_stats, runner_stats = generate(spec, seeded=True, **case)
    assert outputs == plain
    worker = runner_stats["speculative"]
    assert worker["accepted_tokens"] > 0  # drafts were taken, so the equality above means something
    assert worker["accepted_tokens"] < worker["draft_tokens"]  # and some were refused
    assert (sched_stats["spec_draft_tokens"], sched_stats["spec_accepted_tokens"]) == \
        (worker["draft_tokens"], worker["accepted_tokens"])
    assert sched_stats["spec_mean_accepted_length"] > 1
    if case.get("num_blocks"):
        assert sched_stats["num_preemptions"] > 0
    assert sched_stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("draft", ["itself", "trained", "random"])
@pytest.mark.parametrize("case", [{}, {"depth": 2}, {"budget": 7}, {"num_blocks": 30}],
                         ids=["whole", "pipelined", "chunked", "preempting"])
def test_a_draft_models_greedy_outputs_equal_those_without_speculation(plain, random_draft, draft, case):
    model = {"itself": bundled_model_path(), "trained": bundled_draft_path(), "random": random_draft}[draft]
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    outputs, sched_stats, runner_stats = generate(spec, seeded=True, **case)
    assert outputs == plain  # the seeded sampled request's too: each position's noise is its own
    seeded = generate.requests[-1]
    assert seeded.num_draft_tokens > 0
    if draft == "itself":
        assert seeded.num_accepted_tokens > 0
    worker = runner_stats["speculative"]
    assert worker["drafter"]["passes"] > 0
    if draft == "itself":  # the target drafting for itself: nearly every draft is right
        assert worker["accepted_tokens"] > 0.9 * worker["draft_tokens"]
    elif draft == "trained":  # the bundled one-layer draft, trained on the target's corpus
        assert worker["accepted_tokens"] > 0.5 * worker["draft_tokens"]
    else:
        assert worker["accepted_tokens"] < 0.5 * worker["draft_tokens"]
    if case.get("num_blocks"):
        assert sched_stats["num_preemptions"] > 0
    assert sched_stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("head", ["trained", "random", "random-vocab"])
@pytest.mark.parametrize("case", [{}, {"depth": 2}, {"budget": 7}, {"num_blocks": 30}],
                         ids=["whole", "pipelined", "chunked", "preempting"])
def test_an_eagle3_heads_greedy_outputs_equal_those_without_speculation(plain, head, case):
    model = {"trained": bundled_eagle3_path(), "random": "random:eagle3?seed=1",
             "random-vocab": "random:eagle3?seed=2&draft_vocab=300"}[head]
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": model, "num_speculative_tokens": 3})
    outputs, sched_stats, runner_stats = generate(spec, seeded=True, **case)
    assert outputs == plain
    worker = runner_stats["speculative"]
    assert worker["drafter"]["passes"] > 0 and worker["draft_tokens"] > 0
    if head == "trained":  # the bundled head, trained on the target's greedy continuations of corpus prompts
        assert worker["accepted_tokens"] > 0.35 * worker["draft_tokens"]
    else:  # random weights: nearly every draft refused
        assert worker["accepted_tokens"] < 0.1 * worker["draft_tokens"]
    if case.get("num_blocks"):
        assert sched_stats["num_preemptions"] > 0
    assert sched_stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_logprobs_of_speculated_tokens_equal_those_without_speculation(method):
    """Requests asking for logprobs speculate too: each accepted token's logprob and top-n are its
    position's, as without speculation (greedy, and a seeded sampled request)."""
    eagle = {"method": "eagle3", "model": bundled_eagle3_path(), "num_speculative_tokens": 3}
    spec = SpeculativeConfig.from_dict(NGRAM if method == "ngram" else eagle)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, logprobs=2)]
    got = {}
    for name, s in (("plain", None), ("speculating", spec)):
        got[name] = [Request(f"r{i}-{j}", p, sp) for i, p in enumerate(PROMPTS[:3]) for j, sp in enumerate(params)]
        run_requests(s, got[name])
    for a, b in zip(got["plain"], got["speculating"]):
        assert b.output_token_ids == a.output_token_ids
        assert len(b.output_logprobs) == len(b.output_token_ids)
        for x, y in zip(a.output_logprobs, b.output_logprobs):
            assert (y.token_id, y.top_ids) == (x.token_id, x.top_ids)
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert y.top_logprobs == pytest.approx(x.top_logprobs, abs=1e-4)
    assert sum(r.num_accepted_tokens for r in got["speculating"]) > 0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_a_grammar_checks_drafted_tokens(method):
    """Structured output speculates: each verified position is masked by the grammar after the
    drafts before it, so the output is the one without speculation (greedy and seeded sampled)."""
    from scheduler.grammar_spec import GrammarSpec
    from workers.sampling.grammar import xgrammar_available

    if not xgrammar_available():
        pytest.skip("xgrammar is not installed (raylm[structured])")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    eagle = {"method": "eagle3", "model": bundled_eagle3_path(), "num_speculative_tokens": 3}
    spec = SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 1} if method == "ngram" else eagle)
    grammars = [GrammarSpec("json_schema", json.dumps(schema)), GrammarSpec("json_object")]
    params = [SamplingParams(max_tokens=40, temperature=0, grammar=g) for g in grammars] + [
        SamplingParams(max_tokens=40, temperature=0.9, seed=7, grammar=g) for g in grammars]
    got = {}
    for name, s in (("plain", None), ("speculating", spec)):
        got[name] = [Request(f"r{i}-{j}", p, sp) for i, p in enumerate(PROMPTS[:2]) for j, sp in enumerate(params)]
        run_requests(s, got[name])
    assert [r.output_token_ids for r in got["speculating"]] == [r.output_token_ids for r in got["plain"]]
    assert sum(r.num_draft_tokens for r in got["speculating"]) > 0
    assert sum(r.num_accepted_tokens for r in got["speculating"]) > 0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_penalties_count_the_drafts_before_each_position(method):
    """Requests with penalties speculate: each verified position's penalty counts include the
    drafts before it, and the kept tokens are counted after, so the output is the one without
    speculation (greedy and seeded sampled)."""
    eagle = {"method": "eagle3", "model": bundled_eagle3_path(), "num_speculative_tokens": 3}
    spec = SpeculativeConfig.from_dict(NGRAM if method == "ngram" else eagle)
    kinds = [dict(frequency_penalty=0.6), dict(presence_penalty=0.8, repetition_penalty=1.3),
             dict(repetition_penalty=1.2, logit_bias={13: 2.0})]
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, **kw) for kw in kinds] + [
        SamplingParams(max_tokens=32, temperature=0.8, seed=4, ignore_eos=True, **kinds[0])]
    got = {}
    for name, s in (("plain", None), ("speculating", spec)):
        got[name] = [Request(f"r{i}-{j}", p, sp) for i, p in enumerate(PROMPTS[:3]) for j, sp in enumerate(params)]
        run_requests(s, got[name], depth=2)
    assert [r.output_token_ids for r in got["speculating"]] == [r.output_token_ids for r in got["plain"]]
    assert sum(r.num_accepted_tokens for r in got["speculating"]) > 0


def test_an_eagle3_head_for_another_target_is_refused_by_name(tmp_path):
    from tests.workers.test_eagle3 import PUBLISHED

    path = tmp_path / "qwen3-8b-head"
    path.mkdir()
    for change, message in (({}, "has vocab_size 151936; the target's is 2048"),
                            ({"vocab_size": 2048, "draft_vocab_size": 1024},
                             "reads features of width 4096; the target's hidden_size is 128")):
        (path / "config.json").write_text(json.dumps({**PUBLISHED, **change}))
        spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(path), "num_speculative_tokens": 2})
        with pytest.raises(ValueError, match=message):
            ModelRunner(RunnerConfig(num_kv_blocks=16, speculative=spec))


def test_a_draft_model_with_another_vocab_is_refused_by_name(tmp_path):
    path = save_random_qwen3(tmp_path / "other-vocab", vocab_size=1024)
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocab_size 1024; the target's is 2048"):
        ModelRunner(RunnerConfig(num_kv_blocks=16, speculative=spec))


def test_speculation_needs_device_outputs():
    with pytest.raises(ValueError, match="device outputs must be on"):
        ModelRunner(RunnerConfig(num_kv_blocks=16, device_outputs=False,
                                 speculative=SpeculativeConfig.from_dict(NGRAM)))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_draft_alike_and_equal_one_rank_without_speculation():
    """Prompt lookup, the draft model and the EAGLE-3 head (each rank runs the whole draft or head,
    the head on the all-reduced features)."""
    runner_kw = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    specs = [SpeculativeConfig.from_dict(NGRAM), SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": bundled_draft_path(), "num_speculative_tokens": 3}),
        SpeculativeConfig.from_dict({"method": "eagle3", "model": bundled_eagle3_path(), "num_speculative_tokens": 3})]
    ((plain, _),) = run_ranks(1, [job(runner_kw, PROMPTS, 24, scheduler={})])
    results = run_ranks(2, [job(dict(runner_kw, speculative=spec), PROMPTS, 24,
                                scheduler={"num_lookahead_tokens": spec.num_speculative_tokens}) for spec in specs])
    for got, stats in results:
        assert got == plain
        assert stats["tensor_parallel_size"] == 2
        assert 0 < stats["speculative"]["accepted_tokens"] < stats["speculative"]["draft_tokens"]


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile z (3.09: p = 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_speculative_sampling_keeps_the_targets_distribution():
    """Unseeded draws at temperature 1 with the target drafting for itself (its greedy tokens, so
    drafts are often kept and often replaced): the distribution of the tokens at the third and
    fourth output positions is the same as without speculation (two-sample chi-square, p > 0.001)."""
    from collections import Counter

    prompt = PROMPTS[0]
    n = 600
    draws = {}
    for name, spec in (("plain", None), ("speculating", SpeculativeConfig.from_dict(
            {"method": "draft_model", "model": bundled_model_path(), "num_speculative_tokens": 3}))):
        runner = ModelRunner(RunnerConfig(block_size=4, num_kv_blocks=512, max_num_seqs=32,
                                          max_num_batched_tokens=512, speculative=spec, seed=11))
        sched = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=4, max_num_seqs=32,
                                          max_num_batched_tokens=512, max_model_len=runner.max_model_len,
                                          num_lookahead_tokens=0 if spec is None else 3, enable_prefix_caching=False))
        reqs = [Request(f"d{i}", prompt, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
                for i in range(n)]
        for r in reqs:
            sched.add_request(r)
        drive(sched, runner)
        draws[name] = [tuple(r.output_token_ids[2:4]) for r in reqs]
        if spec is not None:
            stats = sched.stats()
            assert 0.2 < stats["spec_acceptance_rate"] < 0.95  # drafts both kept and replaced
    a, b = Counter(draws["plain"]), Counter(draws["speculating"])
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rare = sum(a[t] + b[t] for t in set(a) | set(b) if t not in common)
    stat, cells = 0.0, [(a[t], b[t]) for t in common] + [(n - sum(a[t] for t in common), n - sum(b[t] for t in common))]
    for x, y in cells:
        if x + y:
            e = (x + y) / 2
            stat += (x - e) ** 2 / e + (y - e) ** 2 / e
    df = len([c for c in cells if sum(c)]) - 1
    assert df >= 3, (common, rare)
    assert stat < chi_square_critical(df), (stat, df)
