"""`raylm serve` as a separate process joining the cluster, as on a head node."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

import cluster
from cluster.cli import build_parser
from tests.cluster.conftest import log_tail, start_raylm_serve, wait_healthy
from workers.sampling.grammar import xgrammar_available

pytestmark = pytest.mark.ray


def test_tensor_parallel_size_flag_reaches_the_engine_config():
    from cluster.cli import _engine_kwargs

    for argv, tp in ((["serve"], 1), (["serve", "--tensor-parallel-size", "4", "--replicas", "2"], 4)):
        cfg = cluster.EngineConfig.from_kwargs(**_engine_kwargs(build_parser().parse_args(argv)))
        assert cfg.tensor_parallel_size == tp
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        cluster.EngineConfig(tensor_parallel_size=0)


def test_serve_leaves_a_core_to_its_frontend_unless_the_threads_are_given(ray_session):
    from cluster.core.placement import default_threads

    a = build_parser().parse_args(["serve"])
    assert a.reserved_cpus == 1
    assert build_parser().parse_args(["serve", "--reserved-cpus", "0"]).reserved_cpus == 0
    cpus = int(ray_session.cluster_resources()["CPU"])  # the session's Ray: 2
    assert default_threads(1, 1, 0) == cpus and default_threads(1, 1, 1) == cpus - 1
    assert default_threads(1, 1, cpus + 4) == 1  # never below one thread
    assert default_threads(2, 1, 1) == max(1, (cpus - 1) // 2)
    with pytest.raises(ValueError, match="reserved_cpus .*-1"):
        cluster.EngineConfig(reserved_cpus=-1)


def test_prefill_steps_get_the_reserved_cores_back_unless_the_threads_are_given(ray_session):
    from cluster.cli import _engine_kwargs
    from cluster.core.placement import cpu_worker_threads

    cpus = int(ray_session.cluster_resources()["CPU"])  # the session's Ray: 2
    assert cpu_worker_threads(1, 1, None, 1, None) == (max(1, cpus - 1), cpus)  # raylm serve's default
    assert cpu_worker_threads(1, 1, None, 0, None) == (cpus, cpus)
    assert cpu_worker_threads(1, 1, 1, 1, None) == (1, 1)  # given threads are kept for every step
    assert cpu_worker_threads(1, 1, 1, 1, 3) == (1, 3)
    assert cpu_worker_threads(1, 1, 2, 0, 1) == (2, 2)  # never fewer for prefill than for steps
    a = build_parser().parse_args(["serve", "--prefill-threads-per-worker", "3", "--threads-per-worker", "2"])
    cfg = cluster.EngineConfig.from_kwargs(**_engine_kwargs(a))
    assert (cfg.threads_per_worker, cfg.prefill_threads_per_worker) == (2, 3)
    with pytest.raises(ValueError, match="prefill_threads_per_worker must be >= threads_per_worker 2, got 1"):
        cluster.EngineConfig(threads_per_worker=2, prefill_threads_per_worker=1)
    runner = cfg.runner_config(0, model_path="m", num_threads=2, prefill_threads=3)
    assert (runner.num_threads, runner.prefill_threads) == (2, 3)


@pytest.mark.parametrize("value", ["0", "-1", "101", "nan"])
def test_serve_refuses_a_gil_switch_interval_out_of_range(capsys, value):
    from cluster.cli import main

    assert main(["serve", "--gil-switch-interval-ms", value]) == 2
    assert f"gil_switch_interval_ms must be a number in (0, 100] or None, got {float(value)}" in capsys.readouterr().err


def test_serve_in_engine_refuses_a_ray_client_address(capsys):
    from cluster.cli import main

    assert main(["serve", "--address", "ray://head:10001"]) == 2
    assert "use --frontend process" in capsys.readouterr().err


def test_serve_defaults_bind_loopback_and_take_the_key_from_the_environment(monkeypatch):
    a = build_parser().parse_args(["serve"])
    assert a.host == "127.0.0.1"
    from cluster.cli import resolve_api_key

    monkeypatch.setenv("RAYLM_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("flag") == "flag"
    monkeypatch.delenv("RAYLM_API_KEY")
    assert resolve_api_key(None) is None


@pytest.mark.parametrize("frontend", ["engine", "process"])
def test_raylm_serve_process_joins_ray_serves_and_cleans_up(ray_session, tmp_path, frontend):
    proc, log, base = start_raylm_serve(ray_session, tmp_path / "serve.log", "cli-engine", frontend,
                                        extra=["--gil-switch-interval-ms", "2.5"])
    try:
        wait_healthy(proc, log, base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="k-cli", max_retries=0)
        r = client.completions.create(model="tiny-qwen3", prompt="Hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert ray_session.get_actor("cli-engine", namespace="raylm") is not None
        other = cluster.connect("cli-engine")  # another frontend, over the channel, beside the HTTP one
        assert other.generate("Hello", cluster.SamplingParams(max_tokens=5, temperature=0)).text == r.choices[0].text
        assert other.engine.info["gil_switch_interval_ms"] == pytest.approx(2.5)  # the engine process's own
        # raylm serve loads the tokenizer and xgrammar into its workers while they start
        assert other.stats()["replicas"][0]["info"]["structured_output_ready"] is xgrammar_available()
        other.shutdown()
        assert "loaded; serving on" in log_tail(log) and "POST /v1/completions" not in log_tail(log)  # no access log
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_tail(log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray_session.get_actor("cli-engine", namespace="raylm")
        except ValueError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the engine actor outlived `raylm serve`")


def test_accelerator_resource_flag_reaches_the_engine_config():
    import cluster
    from cluster.cli import _engine_kwargs

    a = build_parser().parse_args(["serve", "--device", "cpu", "--accelerator-resource", "NPU"])
    assert cluster.EngineConfig.from_kwargs(**_engine_kwargs(a)).accelerator_resource == "NPU"
    a = build_parser().parse_args(["serve"])
    assert cluster.EngineConfig.from_kwargs(**_engine_kwargs(a)).accelerator_resource is None
    with pytest.raises(ValueError, match="accelerator_resource"):
        cluster.EngineConfig.from_kwargs(**_engine_kwargs(build_parser().parse_args(
            ["serve", "--accelerator-resource", ""])))


def test_graph_flags_reach_the_engine_config():
    import cluster
    from cluster.cli import _engine_kwargs

    a = build_parser().parse_args(["serve", "--device", "npu", "--enforce-eager", "--graph-sizes", "8,1,2"])
    cfg = cluster.EngineConfig.from_kwargs(**_engine_kwargs(a))
    assert (cfg.enforce_eager, cfg.graph_sizes, cfg.block_size) == (True, [1, 2, 8], 128)
    cfg = cluster.EngineConfig.from_kwargs(**_engine_kwargs(build_parser().parse_args(["serve"])))
    assert (cfg.enforce_eager, cfg.graph_sizes) == (False, None)


def test_generation_config_flag_reaches_the_engine_config():
    from cluster.cli import _engine_kwargs

    def cfg(*argv):
        return cluster.EngineConfig.from_kwargs(**_engine_kwargs(build_parser().parse_args(list(argv))))

    assert cfg("serve", "--generation-config", "none").generation_config == "none"
    assert cfg("serve").generation_config == "auto"
    assert cfg("generate", "hi").generation_config == "auto"  # not a generate flag: the config's default
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--generation-config", "vllm"])
