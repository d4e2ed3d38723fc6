"""Structured output and the worker actors: a worker that fails mid-request is replaced;
its structured-output requests are recomputed from their prompt and the tokens they already
have, and the rebuilt grammar matchers continue exactly as the lost ones would have (seeded
sampling: the mask decides what can be drawn). Workers without xgrammar say so when they
start, and the engine refuses a grammar for them instead of sending it to fail a step."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

import cluster
from cluster import SamplingParams
from scheduler.grammar_spec import GrammarSpec
from tests.cluster.faults import arm_fault
from workers.actor import WORKER_ACTOR_ENV, WorkerActor
from workers.sampling.grammar import xgrammar_available

pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed (raylm[structured])")]

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Berlin"]},
                                           "degrees": {"type": "integer", "minimum": -40, "maximum": 50},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "degrees", "sunny"]}
QUESTIONS = ["What is the weather in Tokyo?", "Tell me about Paris.", "hi"]


@pytest.mark.parametrize("kind", ["exit", "raise"])
def test_structured_requests_survive_a_worker_restart_unchanged(ray_session, faulty_workers, kind):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, grammar=GrammarSpec("json_schema",
                                                                                        json.dumps(SCHEMA)))
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}], None, {"enable_thinking": False})
                   for q in QUESTIONS]
        clean = llm.generate(prompts, params)
        arm_fault(llm, kind, after_steps=8)  # mid-way through the JSON
        again = llm.generate(prompts, params)
        stats = llm.stats()
        llm.generate(prompts[:1], params)
        new_worker = llm.worker_stats()[0]["grammars"]
    assert stats["worker_restarts"] == 1
    assert new_worker["prefetches"] == 1  # the restarted worker had compiled nothing: the spec went ahead again
    assert [o.token_ids for o in again] == [o.token_ids for o in clean]
    for o in again:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)


class WorkerWithoutXgrammar(WorkerActor):
    """Reports what a worker on a node without raylm[structured] reports."""

    def start(self, config: dict, parallel: dict | None = None) -> dict:
        return {**super().start(config, parallel), "structured_output": False}


def test_a_grammar_is_refused_when_the_workers_lack_xgrammar(ray_session, monkeypatch):
    monkeypatch.setenv(WORKER_ACTOR_ENV, f"{__name__}:{WorkerWithoutXgrammar.__name__}")
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1) as llm:
        with pytest.raises(ValueError, match=r"needs xgrammar where the workers run.*raylm\[structured\]"):
            llm.generate("hi", SamplingParams(max_tokens=4, grammar=GrammarSpec("json_object")))
        out = llm.generate("hi", SamplingParams(max_tokens=4, temperature=0))  # the replica keeps serving
        stats = llm.stats()
    assert out.token_ids and out.finish_reason in ("stop", "length") and stats["worker_restarts"] == 0


def test_the_engine_sends_each_grammar_to_its_worker_ahead_of_the_step_once(ray_session):
    params = SamplingParams(max_tokens=24, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}], None, {"enable_thinking": False})
                   for q in QUESTIONS]
        outs = llm.generate(prompts, params)
        grammars = llm.worker_stats()[0]["grammars"]
        other = GrammarSpec("json_schema", json.dumps({**SCHEMA, "required": ["city"]}))
        outs += llm.generate(prompts, dataclasses.replace(params, grammar=other))
        outs += llm.generate(prompts[:1], params)  # the first schema again: still compiled there
        later = llm.worker_stats()[0]["grammars"]
    assert grammars["ready"] and grammars["prefetches"] == 1  # sent once for the three requests
    assert grammars["compiled"] == 1  # the one schema, compiled once between prefetch and step
    assert later["prefetches"] == 2 and later["compiled"] == 2
    assert all(o.finish_reason in ("stop", "length") for o in outs)
