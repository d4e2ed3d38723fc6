"""Speculative decoding through the engine (Ray workers) and the CLI: the same greedy text as
without it, acceptance in stats(), /metrics and each request's metrics."""

from __future__ import annotations

import pytest

import cluster
from cluster import SamplingParams

pytestmark = pytest.mark.ray

PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on", "1 2 3 4 5 1 2 3 4 5 1 2 3",
           "Hello world"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.timeout(600)
def test_speculating_engine_gives_the_same_greedy_text(ray_session):
    greedy = SamplingParams(max_tokens=40, temperature=0)
    common = dict(num_kv_blocks=128, block_size=4, threads_per_worker=1)
    with cluster.launch(**common) as llm:
        plain = llm.generate(PROMPTS, greedy)
        want = [o.outputs[0].token_ids for o in plain]
        # a stop string from the middle of each output: the text, ids and logprobs end where it completes
        stops = [SamplingParams(max_tokens=40, temperature=0, stop=[o.outputs[0].text[12:15]], logprobs=2)
                 for o in plain]
        want_stopped = [(o.outputs[0].text, o.outputs[0].token_ids) for o in llm.generate(PROMPTS, stops)]
    with cluster.launch(speculative_config=NGRAM, **common) as llm:
        outs = llm.generate(PROMPTS, greedy)
        stopped_outs = llm.generate(PROMPTS, stops)
        stopped = [(o.outputs[0].text, o.outputs[0].token_ids) for o in stopped_outs]
        stats = llm.stats()
        metrics = llm.metrics_text().decode()
        (worker,) = llm.worker_stats()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert stopped == want_stopped
    for o in stopped_outs:  # the logprobs of a run cut by a stop string are cut with it
        assert [lp.token_id for lp in o.outputs[0].logprobs] == o.outputs[0].token_ids
    assert all(len(ids) < len(w) for (_, ids), w in zip(want_stopped, want))  # each stop string did cut
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["spec_acceptance_rate"] == stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    assert worker["speculative"]["accepted_tokens"] == stats["spec_accepted_tokens"]
    assert sum(o.metrics.num_accepted_tokens for o in outs + stopped_outs) == stats["spec_accepted_tokens"]
    assert f"raylm_spec_decode_num_accepted_tokens_total {float(stats['spec_accepted_tokens'])}" in metrics


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_a_speculating_worker_killed_mid_run_recomputes_to_the_same_greedy_text(ray_session, faulty_workers, method):
    from tests.cluster.faults import arm_fault
    from workers.loader import bundled_eagle3_path

    spec = NGRAM if method == "ngram" else {"method": "eagle3", "model": bundled_eagle3_path(),
                                            "num_speculative_tokens": 3}
    greedy = SamplingParams(max_tokens=40, temperature=0)
    with cluster.launch(num_kv_blocks=128, block_size=4, threads_per_worker=1) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    with cluster.launch(speculative_config=spec, num_kv_blocks=128, block_size=4, threads_per_worker=1) as llm:
        arm_fault(llm, "exit", after_steps=6)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        stats = llm.stats()
    assert got == want
    assert stats["worker_restarts"] == 1
    assert stats["spec_accepted_tokens"] > 0


def test_the_cli_passes_the_speculative_config(capsys):
    from cluster.cli import _engine_kwargs, build_parser
    from cluster.config import EngineConfig

    for command in ("serve", "generate"):
        args = [command] + (["hi"] if command == "generate" else []) + [
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
        spec = EngineConfig(**_engine_kwargs(build_parser().parse_args(args))).speculative_config
        assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "[1, 2]"])
    assert "must be a JSON object" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_a_model_without_a_tokenizer_takes_verified_runs_whole(ray_session):
    """A random model (ids only, no text) drafting for itself: every run is accepted whole."""
    model = "random:qwen3-0.6b?layers=1&seed=0"
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    common = dict(model=model, num_kv_blocks=32, block_size=16, threads_per_worker=1)
    with cluster.launch(**common) as llm:
        want = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], greedy)]
    with cluster.launch(speculative_config=spec, **common) as llm:
        got = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], greedy)]
        stats = llm.stats()
    assert got == want
    assert stats["spec_accepted_tokens"] > 0
