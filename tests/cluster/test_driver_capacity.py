"""Fake workers (EngineConfig.fake_step_s: no model, ids answered at once or after a stood-in step
time) through the real engine, and `raylm bench --driver-capacity` end to end on them."""

from __future__ import annotations

import gc
import json
import random

import pytest

import cluster
from cluster import EngineConfig, SamplingParams
from cluster.bench.driver_capacity import text_prompts
from cluster.cli import main as cli_main
from cluster.errors import RequestRefused
from scheduler.grammar_spec import GrammarSpec
from workers.fake_runner import FakeRunner
from workers.runner_config import RunnerConfig


@pytest.mark.parametrize("value", [-0.01, 11, float("nan"), "0.1", True])
def test_fake_step_s_refuses_what_is_not_seconds(value):
    with pytest.raises(ValueError, match=f"fake_step_s must be seconds.*{value!r}"):
        EngineConfig(fake_step_s=value)


def test_fake_workers_run_no_device():
    with pytest.raises(ValueError, match="fake workers .* device must be 'cpu', got 'npu'"):
        EngineConfig(fake_step_s=0.0, device="npu")


def test_a_fake_runner_without_device_outputs_is_refused():
    with pytest.raises(ValueError, match="device_outputs must be on"):
        FakeRunner(RunnerConfig(fake_step_s=0.0, device_outputs=False))


def test_fake_workers_answer_every_token_asked_through_the_real_engine(ray_session):
    h = cluster.launch(fake_step_s=0.0, num_replicas=2, max_num_seqs=4, num_kv_blocks=64)
    try:
        prompts = [[5, 6, 7, 8]] * 9 + [list(range(10, 50))]  # more requests than slots: they queue
        outs = h.generate(prompts, SamplingParams(max_tokens=17, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [17] * len(prompts)
        assert all(o.outputs[0].text for o in outs)  # the ids went through the detokenizer
        stats = h.stats()
        assert stats["generated_tokens"] == 17 * len(prompts)
        assert stats["kv_blocks_used"] == 0 and stats["open_requests"] == 0
        assert [w["weight_bytes"] for w in h.worker_stats()] == [0, 0]  # no model was loaded
        with pytest.raises(RequestRefused, match="grammar: a fake worker .* runs no grammars"):  # not ignored
            h.generate([[5, 6]], SamplingParams(max_tokens=3, grammar=GrammarSpec("json_object")))
        again = h.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))  # and it keeps serving
        assert len(again[0].outputs[0].token_ids) == 3
    finally:
        h.shutdown()


def test_the_engine_keeps_its_startup_heap_out_of_collections_while_it_serves(ray_session):
    h = cluster.launch(fake_step_s=0.0, max_num_seqs=2, num_kv_blocks=16)
    try:
        assert gc.get_freeze_count() > 0  # what the process held at start: frozen, not walked by each collection
        out = h.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        h.shutdown()
    assert gc.get_freeze_count() == 0  # given back to the collector: what the engine held may be garbage now


def test_the_capacity_prompts_are_text_cut_at_whole_characters():
    from workers.loader import bundled_model_path, load_tokenizer

    tokenizer = load_tokenizer(bundled_model_path())
    prompts = text_prompts(random.Random(3), 12, 16)
    assert prompts == text_prompts(random.Random(3), 12, 16)  # seeded
    assert len({tuple(p) for p in prompts}) > 1 and all(len(p) == 16 for p in prompts)
    for p in prompts:  # the detokenizer's prompt context decodes whole, as a text prompt's does
        assert "\ufffd" not in tokenizer.decode(p[-4:])


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_the_driver_capacity_bench_prints_and_writes_both_sweeps(ray_session, tmp_path, capsys):
    out = tmp_path / "capacity.json"
    assert cli_main(["bench", "--driver-capacity", "--rows", "2,4", "--replicas", "2", "--output-len", "100:100",
                     "--input-len", "8:8", "--fake-step-ms", "10", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["replicas"], r["rows"], r["step_ms"]) for r in doc["rows"]] == [(1, 2, 0.0), (1, 4, 0.0)]
    assert [(r["replicas"], r["rows"], r["step_ms"]) for r in doc["replicas"]] == [(2, 2, 10.0)]
    for r in doc["rows"] + doc["replicas"]:
        assert r["steps"] > 0 and r["cpu_ms_per_replica_step"] > 0
        assert r["out_tok_per_s"] == pytest.approx(r["steps_per_s"] * r["rows"], rel=0.5)
    share = doc["replicas"][0]["of_ideal"]
    assert 0 < share <= 1.05  # two 10 ms workers allow 200 steps a second; an engine cannot beat them
    assert "CPU ms / replica-step" in capsys.readouterr().out
