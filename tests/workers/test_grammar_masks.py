"""Structured output on the worker: the bitmask sets exactly the disallowed logits of the
constrained rows to -inf, a constrained request's output matches its grammar and ends at
EOS, host-logits mode masks the same way, and a matcher rebuilt from the known tokens
(preemption, worker restart) continues exactly as the original would have."""

from __future__ import annotations

import json

import pytest
import torch

from scheduler.grammar_spec import GrammarSpec
from scheduler.protocol import WorkerSampling
from tests.plans import PlanDriver
from workers.loader import bundled_model_path, eos_token_ids, load_tokenizer
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig
from workers.sampling.grammar import xgrammar_available
from workers.sampling.grammar_masks import GrammarMasks, apply_bitmask

pytestmark = pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed (raylm[structured])")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}
N = 48


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="module")
def eos():
    return eos_token_ids(bundled_model_path())


def _prompt(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False))


def _runner(**kw):
    return ModelRunner(RunnerConfig(block_size=4, num_kv_blocks=256, max_num_seqs=4, **kw))


def _until_eos(tokens, eos):
    n = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if n is None else tokens[:n + 1]


def _generate(driver, eos, n=N, ids_from_logits=None):
    """Step until every request has said EOS or has n outputs (a request past EOS is unconstrained)."""
    reqs = list(driver.running)
    while any(len(r.outputs) < n and not set(r.outputs) & eos for r in reqs):
        driver.step(ids_from_logits)


def _schema_sampling(prompt, **kw):
    return WorkerSampling(grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)), grammar_start=len(prompt), **kw)


def test_the_bitmask_masks_exactly_the_disallowed_tokens_of_its_rows():
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=gen)  # covers 96 >= 70 ids
    rows = [1, 3]
    got = logits.clone()
    apply_bitmask(got, bitmask, torch.tensor(rows))
    for r in range(5):
        if r not in rows:
            assert torch.equal(got[r], logits[r])  # unconstrained rows are untouched
    for j, r in enumerate(rows):
        allowed = [(int(bitmask[j, t // 32]) >> (t % 32)) & 1 == 1 for t in range(70)]
        assert torch.equal(torch.isinf(got[r]), torch.tensor([not a for a in allowed]))
        assert torch.equal(got[r][torch.tensor(allowed)], logits[r][torch.tensor(allowed)])
    ref = logits[rows].clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, backend="cpu")  # xgrammar's own kernel agrees
    assert torch.equal(got[rows], ref)
    whole = logits[rows].clone()
    apply_bitmask(whole, bitmask, None)
    assert torch.equal(whole, ref)


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "explicit"])
def test_json_schema_output_validates_and_ends_at_eos(tok, eos, resident):
    import jsonschema

    driver = PlanDriver(_runner(), resident=resident)
    prompt = _prompt(tok, "Tell me about Paris.")
    req = driver.add(prompt, _schema_sampling(prompt))
    free = driver.add(prompt)  # the same prompt, unconstrained, in the same batch
    _generate(driver, eos)
    out = _until_eos(req.outputs, eos)
    assert out[-1] in eos
    jsonschema.validate(json.loads(tok.decode(out[:-1])), SCHEMA)
    assert _until_eos(free.outputs, eos) != out  # the mask made the difference


def test_host_logits_mode_masks_the_same_way(tok, eos):
    from workers.sampling.sampler import Sampler, sample_host

    prompt = _prompt(tok, "Tell me about Paris.")
    device = PlanDriver(_runner())
    on_device = device.add(prompt, _schema_sampling(prompt))
    _generate(device, eos)
    host = PlanDriver(_runner(device_outputs=False), resident=False)
    on_host = host.add(prompt, _schema_sampling(prompt))
    sampler = Sampler(torch.device("cpu"))
    _generate(host, eos, ids_from_logits=lambda result: sample_host(
        result, [(on_host.sampling, 0)] * len(result.slots), sampler)[0])
    assert _until_eos(on_host.outputs, eos) == _until_eos(on_device.outputs, eos)


@pytest.mark.parametrize("k", [1, 7])
def test_a_matcher_rebuilt_after_a_restart_continues_the_same_way(tok, eos, k):
    prompt = _prompt(tok, "What is the weather in Tokyo?")
    sampling = _schema_sampling(prompt, temperature=1.0, seed=3)  # seeded: the mask decides what can be drawn
    whole = PlanDriver(_runner())
    full = whole.add(prompt, sampling)
    _generate(whole, eos)
    restarted = PlanDriver(_runner())  # a fresh worker: the request arrives with its first k outputs
    again = restarted.add(prompt + full.outputs[:k], sampling)
    _generate(restarted, eos, N - k)
    assert _until_eos(full.outputs[:k] + again.outputs, eos) == _until_eos(full.outputs, eos)
    out = _until_eos(full.outputs, eos)
    assert out[-1] in eos and isinstance(json.loads(tok.decode(out[:-1])), dict)


def test_the_same_grammar_compiles_once_per_worker(tok):
    prompt = _prompt(tok, "Tell me about Paris.")
    runner = _runner()
    driver = PlanDriver(runner)
    for _ in range(3):
        driver.add(prompt, _schema_sampling(prompt))
    driver.add(prompt, WorkerSampling(grammar=GrammarSpec("json_object"), grammar_start=len(prompt)))
    driver.step()
    assert runner.grammars.cache.num_compiled == 2


def test_a_bad_grammar_is_refused_before_the_plan_changes_anything(tok):
    runner = _runner()
    driver = PlanDriver(runner)
    prompt = _prompt(tok, "hi")
    driver.add(prompt, WorkerSampling(grammar=GrammarSpec("json_schema", '{"type": "strin"}'),
                                      grammar_start=len(prompt)))
    with pytest.raises(ValueError, match="slot 0: invalid json_schema grammar: .*strin"):
        runner.execute(driver.plan())
    assert len(runner.slots) == 0


def test_prepare_at_start_builds_the_compiler_before_any_grammar_arrives(tok):
    lazy = _runner()
    assert lazy.grammars.cache is None  # built by the first request with a grammar
    runner = _runner(prepare_structured_output=True)
    cache = runner.grammars.cache
    assert cache is not None and cache.num_compiled == 0
    driver = PlanDriver(runner)
    prompt = _prompt(tok, "Tell me about Paris.")
    driver.add(prompt, _schema_sampling(prompt))
    driver.step()
    assert runner.grammars.cache is cache and cache.num_compiled == 1  # the one built at start serves it
    no_tokenizer = GrammarMasks(max_num_seqs=1, vocab_size=64, device=torch.device("cpu"), checkpoint=None)
    assert no_tokenizer.prepare() is False and no_tokenizer.cache is None  # a grammar request then says why


def test_a_prefetched_grammar_is_the_one_its_step_uses(tok):
    runner = _runner(prepare_structured_output=True)
    prompt = _prompt(tok, "Tell me about Paris.")
    sampling = _schema_sampling(prompt)
    assert runner.grammars.prefetch(sampling.grammar) is None  # compiled
    cache = runner.grammars.cache
    assert cache.num_compiled == 1
    driver = PlanDriver(runner)
    driver.add(prompt, sampling)
    driver.step()
    assert cache.num_compiled == 1  # the step found it compiled
    bad = GrammarSpec("json_schema", '{"type": "strin"}')
    assert "invalid json_schema grammar" in runner.grammars.prefetch(bad)  # the reason the driver refuses it with
    lazy = _runner()
    assert lazy.grammars.prefetch(sampling.grammar) is None  # builds the compiler itself, off the step path
    assert lazy.grammars.cache.num_compiled == 1


def test_threads_asking_for_one_grammar_at_once_compile_it_once(tok):
    import threading

    runner = _runner(prepare_structured_output=True)
    cache = runner.grammars.cache
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    got, start = [], threading.Barrier(4)

    def ask():
        start.wait()
        got.append(cache.compiled(spec))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.num_compiled == 1 and len(got) == 4 and all(g is got[0] for g in got)
