"""`raylm bench` end to end on tiny runs (in this process, on the session's Ray), and the
random-weights model spec it benchmarks. Figures are checked for consistency, never timing."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

import cluster
from cluster.bench.figures import percentile
from cluster.bench.workload import make_workload
from cluster.cli import main as cli_main
from scheduler.request import SamplingParams
from workers.device import compute_dtype
from workers.loader import bundled_model_path, parse_random_spec, random_model, weights_fingerprint

pytestmark = pytest.mark.ray

RANDOM_1L = "random:qwen3-0.6b?layers=1"


def _load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _runs(doc) -> dict:
    return {r["name"]: r for r in doc["runs"]}


def _check_figures(fig: dict, wl: dict) -> None:
    assert fig["num_requests"] == wl["num_requests"]
    assert fig["output_tokens"] == wl["output_tokens"]
    assert fig["prompt_tokens"] == wl["prompt_tokens"]
    assert fig["lengths_ok"] is True  # every request got exactly the tokens it asked for
    assert fig["generated_tokens"] >= fig["output_tokens"]
    assert math.isclose(fig["output_tok_s"], fig["output_tokens"] / fig["elapsed_s"])
    assert math.isclose(fig["total_tok_s"], (fig["output_tokens"] + fig["prompt_tokens"]) / fig["elapsed_s"])
    assert 0 <= fig["ttft_p50_ms"] <= fig["ttft_p99_ms"]
    assert 0 <= fig["tpot_p50_ms"] <= fig["tpot_p99_ms"]


@pytest.mark.timeout(900)  # seven contenders, each loading the model
def test_offline_compare_and_device_outputs_ab(ray_session, tmp_path):
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", "--model", RANDOM_1L, "--num-requests", "3", "--input-len", "4:12", "--output-len", "2:5",
                     "--batch-size", "2", "--compare", "hf,bare", "--ab", "device-outputs",
                     "--hf-dtypes", "bfloat16,float32", "--json", str(out)])
    assert rc == 0
    doc = _load(out)
    wl = doc["workload"]
    assert wl["num_requests"] == 3 and 2 <= wl["output_len_min"] <= wl["output_len_max"] <= 5
    runs = _runs(doc)
    assert set(runs) == {"raylm", "raylm host-logits", "bare", "hf-cb", "hf-generate", "hf-cb float32",
                         "hf-generate float32"}
    for r in runs.values():
        _check_figures(r["rounds"][0], wl)
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


@pytest.mark.timeout(900)  # four engines started one after another
def test_replica_scaling_and_serving_on_the_tiny_model(ray_session, tmp_path):
    out = tmp_path / "scale.json"
    common = ["--model", bundled_model_path(), "--num-requests", "4", "--input-len", "4:16", "--output-len", "3:6"]
    assert cli_main(["bench", *common, "--replicas", "1,2", "--json", str(out)]) == 0
    doc = _load(out)
    runs = _runs(doc)
    assert set(runs) == {"raylm", "raylm 2x1t", "raylm 1x1t"}  # 2 cores: 1x2 threads, 2x1, and 1x1
    assert runs["raylm"]["params"] == {"dtype": "auto", "replicas": 1, "threads_per_worker": 2,
                                       "device_outputs": True, "batch_size": 64}
    for r in runs.values():
        _check_figures(r["rounds"][0], doc["workload"])
    assert "2 replicas x 1 threads / 1 replica x 2 threads" in doc["ratios"]
    scaling = doc["ratios"]["2 replicas x 1 threads / 1 replica x 1 threads"]
    assert doc["targets"]["2 replicas >= 1.6x 1 replica (1 threads each)"]["value"] == scaling

    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []  # the `plot` extra
    assert cli_main(["bench", *common, "--serve", "--rate", "inf,40", "--json", str(out), *plot]) == 0
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = _load(out)
    assert [r["name"] for r in doc["serve"]] == ["serve rate=inf", "serve rate=40"]
    for r in doc["serve"]:
        fig = r["rounds"][0]
        assert fig["output_tokens"] == fig["generated_tokens"]
        assert fig["num_requests"] == 4 and fig["request_throughput"] > 0
        assert fig["compute_dtype"] == "float32"  # the tiny model's own dtype
        assert 0 <= fig["itl_p50_ms"] <= fig["itl_p99_ms"]
        assert fig["e2e_p50_ms"] >= fig["ttft_p50_ms"]


@pytest.mark.parametrize("argv, message", [
    (["--serve", "--compare", "hf"], "--serve runs alone"),
    (["--model", "/nonexistent", "--layers", "2"], "--layers applies to a random model"),
    (["--model", "random:qwen3-7b"], "unknown random model"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys):
    assert cli_main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isclose(percentile(list(range(101)), 99), 99.0)


def test_workload_is_seeded_and_in_range():
    a = make_workload(20, (3, 9), (2, 4), 100, seed=7)
    assert a == make_workload(20, (3, 9), (2, 4), 100, seed=7)
    assert a != make_workload(20, (3, 9), (2, 4), 100, seed=8)
    assert all(3 <= len(p) <= 9 and all(0 <= t < 100 for t in p) for p in a.prompts)
    assert all(2 <= o <= 4 for o in a.output_lens) and a.output_tokens == sum(a.output_lens)


# ---- the random model spec and an engine without a tokenizer ----

def test_random_spec_parses_and_refuses_what_it_cannot_build():
    spec = parse_random_spec("random:qwen3-0.6b?layers=4&seed=3")
    assert (spec.name, spec.layers, spec.seed) == ("qwen3-0.6b", 4, 3)
    assert parse_random_spec(str(spec)) == spec
    assert parse_random_spec("random:qwen3-0.6b") == parse_random_spec("random:qwen3-0.6b?seed=0")
    for bad, msg in [("random:qwen3-0.6b?layers=0", "layers must be"), ("random:qwen3-0.6b?depth=2", "unknown option"),
                     ("random:qwen3-0.6b?layers", "key=value"), ("random:qwen3-0.6b?seed=1&seed=2", "twice"),
                     ("random:llama", "unknown random model")]:
        with pytest.raises(ValueError, match=msg):
            parse_random_spec(bad)


def test_random_model_is_a_function_of_its_spec():
    a = random_model("random:qwen3-0.6b?layers=1&seed=1")
    assert a.config.num_hidden_layers == 1 and a.config.hidden_size == 1024 and a.dtype.is_floating_point
    assert weights_fingerprint(a) == weights_fingerprint(random_model("random:qwen3-0.6b?layers=1&seed=1"))
    assert weights_fingerprint(a) != weights_fingerprint(random_model("random:qwen3-0.6b?layers=1&seed=2"))


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
