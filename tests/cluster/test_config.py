"""EngineConfig: validated once where users set it; the scheduler's and runner's settings derived from it."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import EngineConfig
from scheduler.scheduler_config import SchedulerConfig
from workers.runner_config import ENV_DEVICE_OUTPUTS, RunnerConfig


@pytest.mark.parametrize("field,value", [
    ("device", "tpu"), ("dtype", "int8"), ("num_replicas", 0), ("num_replicas", True), ("block_size", 0),
    ("block_size", 1.5), ("num_kv_blocks", 1), ("num_kv_blocks", -1), ("memory_fraction", 1.5),
    ("memory_fraction", True), ("max_num_seqs", 0), ("max_num_seqs", None), ("max_num_batched_tokens", 0),
    ("max_model_len", 1), ("max_model_len", True), ("enable_prefix_caching", 1), ("pipeline_depth", 3),
    ("pipeline_depth", True), ("device_outputs", "yes"), ("threads_per_worker", 0), ("reserved_cpus", -1), ("seed", -1),
    ("prefill_threads_per_worker", 0),
    ("accelerator_resource", ""), ("step_timeout_s", 0), ("step_timeout_s", float("inf")),
    ("max_worker_restarts", -1), ("max_waiting_requests", 0), ("start_timeout_s", -1.0), ("model", ""),
    ("enforce_eager", 1), ("generation_config", "vllm"), ("prepare_structured_output", "yes"),
    ("step_channel", "zmq"), ("step_channel", None),
    ("graph_sizes", []), ("graph_sizes", [0, 4]), ("graph_sizes", [65]), ("graph_sizes", 8),
])
def test_bad_values_raise_naming_the_field_and_the_value(field, value):
    with pytest.raises(ValueError, match=field) as err:
        EngineConfig(**{field: value})
    assert repr(value) in str(err.value)


def test_block_size_defaults_to_what_each_device_takes():
    assert EngineConfig(device="npu").block_size == 128  # the NPU's fused kernels
    assert EngineConfig(device="cuda").block_size == EngineConfig().block_size == 16
    assert EngineConfig(device="npu", block_size=64).block_size == 64
    for bad in (8, 24, 256):
        with pytest.raises(ValueError, match=f"block_size must be a multiple of 16.*got {bad}"):
            EngineConfig(device="npu", block_size=bad)
    assert EngineConfig(device="cpu", block_size=8).block_size == 8  # the CPU takes any size


def test_dtype_aliases_resolve_to_one_name():
    assert EngineConfig(dtype="bf16").dtype == "bfloat16"
    assert EngineConfig(dtype="half").dtype == "float16"
    assert EngineConfig(dtype="float32").dtype == "float32"


def test_every_runner_and_scheduler_setting_comes_from_the_engine_config(monkeypatch):
    monkeypatch.delenv(ENV_DEVICE_OUTPUTS, raising=False)
    cfg = EngineConfig(device="cpu", dtype="bf16", block_size=8, num_kv_blocks=40, memory_fraction=0.5,
                       max_num_seqs=7, max_num_batched_tokens=99, max_model_len=300, enable_prefix_caching=False,
                       seed=5, device_outputs=False, enforce_eager=True, graph_sizes=[4, 1, 4],
                       prepare_structured_output=True, step_channel="socket")
    rc = cfg.runner_config(2, model_path="/m", num_threads=3)
    assert rc == RunnerConfig(model="/m", device="cpu", dtype="bfloat16", block_size=8, num_kv_blocks=40,
                              memory_fraction=0.5, max_num_seqs=7, max_num_batched_tokens=99, max_model_len=300,
                              device_outputs=False, seed=7, num_threads=3, enforce_eager=True, graph_sizes=(1, 4),
                              prepare_structured_output=True, step_channel="socket", choose_decode_threads=True)
    # the worker measures its decode thread count only when the user left it to the engine
    assert not dataclasses.replace(cfg, threads_per_worker=3).runner_config(0, model_path="/m",
                                                                             num_threads=3).choose_decode_threads
    sc = cfg.scheduler_config(num_blocks=40, max_model_len=300)
    assert sc == SchedulerConfig(num_blocks=40, block_size=8, max_num_seqs=7, max_num_batched_tokens=99,
                                 max_model_len=300, enable_prefix_caching=False)
    # both derived configs are plain data: what the worker gets is a dict of them
    assert RunnerConfig(**dataclasses.asdict(rc)) == rc


def test_device_outputs_is_resolved_from_the_environment_once_at_derivation(monkeypatch):
    monkeypatch.setenv(ENV_DEVICE_OUTPUTS, "0")
    assert EngineConfig().runner_config(0, model_path="/m", num_threads=1).device_outputs is False
    assert EngineConfig(device_outputs=True).runner_config(0, model_path="/m", num_threads=1).device_outputs is True
    monkeypatch.setenv(ENV_DEVICE_OUTPUTS, "maybe")
    with pytest.raises(ValueError, match=f"{ENV_DEVICE_OUTPUTS}.*'maybe'"):
        EngineConfig().runner_config(0, model_path="/m", num_threads=1)


def test_accelerator_workers_get_no_cpu_thread_count():
    assert EngineConfig(device="npu").runner_config(0, model_path="/m", num_threads=4).num_threads is None
    assert EngineConfig(device="cpu").runner_config(0, model_path="/m", num_threads=4).num_threads == 4


def test_steps_go_over_the_socket_on_the_cpu_and_as_ray_calls_on_accelerators_unless_set():
    def channel(**kw):
        return EngineConfig(**kw).runner_config(0, model_path="/m", num_threads=1).step_channel
    assert channel() == "socket"
    assert channel(device="cuda") == channel(device="npu") == "ray"
    assert channel(step_channel="ray") == "ray"
    assert channel(device="npu", step_channel="socket") == "socket"


def test_host_logits_mode_runs_one_step_at_a_time():
    cfg = EngineConfig(pipeline_depth=2)
    assert cfg.pipeline_depth_for(True) == 2 and cfg.pipeline_depth_for(False) == 1
    staged = EngineConfig(pipeline_depth=2, pipeline_parallel_size=3)  # each stage's batch pipelined too
    assert staged.pipeline_depth_for(True) == 6 and staged.pipeline_depth_for(False) == 1
    assert EngineConfig(pipeline_depth=1, pipeline_parallel_size=3).pipeline_depth_for(True) == 3
