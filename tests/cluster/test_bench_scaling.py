"""`raylm bench --replicas` and `--serve` end to end on the bundled tiny model (engines started
one after another on the session's Ray). Its own file so that xdist runs it beside test_bench.py."""

from __future__ import annotations

import importlib.util

import pytest

from cluster.cli import main as cli_main
from tests.cluster.bench_figures import check_figures, load_report, runs_by_name
from workers.loader import bundled_model_path

pytestmark = pytest.mark.ray


@pytest.mark.heavy
@pytest.mark.timeout(900)  # four engines started one after another
def test_replica_scaling_and_serving_on_the_tiny_model(ray_session, tmp_path):
    out = tmp_path / "scale.json"
    common = ["--model", bundled_model_path(), "--num-requests", "4", "--input-len", "4:16", "--output-len", "3:6"]
    assert cli_main(["bench", *common, "--replicas", "1,2", "--json", str(out)]) == 0
    doc = load_report(out)
    runs = runs_by_name(doc)
    assert set(runs) == {"raylm", "raylm 2x1t", "raylm 1x1t"}  # 2 cores: 1x2 threads, 2x1, and 1x1
    assert runs["raylm"]["params"] == {"dtype": "auto", "replicas": 1, "threads_per_worker": 2,
                                       "device_outputs": True, "batch_size": 64}
    for r in runs.values():
        check_figures(r["rounds"][0], doc["workload"])
    assert "2 replicas x 1 threads / 1 replica x 2 threads" in doc["ratios"]
    scaling = doc["ratios"]["2 replicas x 1 threads / 1 replica x 1 threads"]
    assert doc["targets"]["2 replicas >= 1.6x 1 replica (1 threads each)"]["value"] == scaling

    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []  # the `plot` extra
    assert cli_main(["bench", *common, "--serve", "--rate", "inf,40", "--json", str(out), *plot]) == 0
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = load_report(out)
    assert [r["name"] for r in doc["serve"]] == ["serve rate=inf", "serve rate=40"]
    for r in doc["serve"]:
        fig = r["rounds"][0]
        assert fig["output_tokens"] == fig["generated_tokens"]
        assert fig["num_requests"] == 4 and fig["request_throughput"] > 0
        assert fig["compute_dtype"] == "float32"  # the tiny model's own dtype
        assert 0 <= fig["itl_p50_ms"] <= fig["itl_p99_ms"]
        assert fig["e2e_p50_ms"] >= fig["ttft_p50_ms"]
