"""`raylm bench` offline end to end on a tiny run (in this process, on the session's Ray), and
an engine on the random model it benchmarks. Figures are checked for consistency, never timing."""

from __future__ import annotations

import json
import math

import pytest
import torch

import cluster
from cluster.cli import main as cli_main
from scheduler.request import SamplingParams
from tests.cluster.bench_figures import RANDOM_1L, check_figures, load_report, runs_by_name
from workers.device import compute_dtype
from workers.loader import random_model, weights_fingerprint

pytestmark = pytest.mark.ray


@pytest.mark.heavy
@pytest.mark.timeout(900)  # seven contenders, each loading the model
def test_offline_compare_and_device_outputs_ab(ray_session, tmp_path):
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", "--model", RANDOM_1L, "--num-requests", "3", "--input-len", "4:12", "--output-len", "2:5",
                     "--batch-size", "2", "--compare", "hf,bare", "--ab", "device-outputs",
                     "--hf-dtypes", "bfloat16,float32", "--json", str(out)])
    assert rc == 0
    doc = load_report(out)
    wl = doc["workload"]
    assert wl["num_requests"] == 3 and 2 <= wl["output_len_min"] <= wl["output_len_max"] <= 5
    runs = runs_by_name(doc)
    assert set(runs) == {"raylm", "raylm host-logits", "bare", "hf-cb", "hf-generate", "hf-cb float32",
                         "hf-generate float32"}
    for r in runs.values():
        check_figures(r["rounds"][0], wl)
        assert r["params"]["batch_size"] == 2
    # raylm and the bare loop compute as raylm serves the bf16 weights here; HF as asked
    auto = str(compute_dtype(torch.device("cpu"), torch.bfloat16)).removeprefix("torch.")
    for name, dtype in (("raylm", auto), ("bare", auto), ("hf-cb", "bfloat16"), ("hf-cb float32", "float32")):
        assert runs[name]["rounds"][0]["compute_dtype"] == dtype
    assert runs["raylm"]["params"]["dtype"] == "auto" and runs["hf-cb float32"]["params"]["dtype"] == "float32"
    for name in ("raylm", "raylm host-logits", "bare", "hf-cb"):  # these stop each request at its own length
        assert runs[name]["rounds"][0]["generated_tokens"] == wl["output_tokens"]
    for name in ("raylm", "raylm host-logits"):
        fig = runs[name]["rounds"][0]
        assert fig["weights_match_driver"] is True  # the workers built the driver's weights
        assert fig["steps"] > 0 and fig["worker_time_s"] > 0
    assert runs["raylm"]["params"]["device_outputs"] is True
    assert runs["raylm host-logits"]["params"]["device_outputs"] is False
    # ids back vs logits back: a decode step pulls a few bytes per row against a vocab of floats per row
    assert runs["raylm"]["summary"]["bytes_per_decode_step"] < 1000
    assert runs["raylm host-logits"]["summary"]["bytes_per_decode_step"] > 151936 * 4
    # greedy on the same weights: the bare loop computes the engine's tokens
    assert runs["bare"]["rounds"][0]["sequence_agreement"] == 1.0
    assert runs["hf-generate"]["rounds"][0]["generated_tokens"] >= wl["output_tokens"]
    ratios = doc["ratios"]
    best = max((n for n in runs if n.startswith("hf-")), key=lambda n: runs[n]["summary"]["output_tok_s"])
    assert ratios[f"raylm / best hf ({best})"] == ratios[f"raylm / {best}"]
    for key in ("raylm / hf-cb", "raylm / hf-generate", "raylm / hf-cb float32", "device outputs / host logits",
                "engine / bare step loop"):
        assert ratios[key] > 0
    assert {t["met"] for t in doc["targets"].values()} <= {True, False}
    assert doc["machine"]["cores"] >= 1


@pytest.mark.heavy
def test_engine_without_tokenizer_takes_token_ids_only(ray_session):
    with cluster.launch(RANDOM_1L, num_kv_blocks=32, threads_per_worker=1) as llm:
        assert llm.tokenizer is None
        outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
                                                   SamplingParams(max_tokens=2, temperature=0, logprobs=1)])
        assert [len(o.token_ids) for o in outs] == [4, 2]
        assert [o.text for o in outs] == ["", ""] and outs[1].logprobs[0].token == ""
        assert all(0 <= t < 151936 for o in outs for t in o.token_ids)
        for call, what in [(lambda: llm.generate("hello"), "text prompts"),
                           (lambda: llm.chat([{"role": "user", "content": "hi"}]), "chat messages"),
                           (lambda: llm.generate([1, 2], SamplingParams(stop=["x"])), "stop strings")]:
            with pytest.raises(ValueError, match=f"no tokenizer: {what}"):
                call()
        (worker,) = llm.worker_stats()
    assert worker["pid"] > 0 and worker["device"] == "cpu" and worker["kv_blocks"] == 32  # where and what it runs
    fp = worker["weights_fingerprint"]
    assert math.isclose(fp, weights_fingerprint(random_model(RANDOM_1L)), rel_tol=1e-9)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_bench_reports_speculative_acceptance(ray_session, tmp_path):
    out = tmp_path / "bench.json"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    rc = cli_main(["bench", "--model", RANDOM_1L, "--num-requests", "3", "--input-len", "4:12", "--output-len",
                   "12:16", "--batch-size", "2", "--speculative-config", json.dumps(spec), "--json", str(out)])
    assert rc == 0
    fig = runs_by_name(load_report(out))["raylm"]
    assert fig["params"]["speculative_config"] == spec
    first = fig["rounds"][0]
    assert first["spec_draft_tokens"] > 0
    assert first["spec_acceptance_rate"] == first["spec_accepted_tokens"] / first["spec_draft_tokens"]
