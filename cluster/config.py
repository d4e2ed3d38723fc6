"""EngineConfig: every knob of a launched engine, validated in one place."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

DEVICES = ("cpu", "cuda", "npu")
DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def _int_at_least(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass
class EngineConfig:
    """How to run one engine: which model, on what, and how to batch.

    model None serves the bundled tiny Qwen3. `dtype` None computes in the checkpoint's
    dtype, except bf16/fp16 weights on a CPU without half-precision matmul instructions
    (no AVX512-BF16 or AMX), which are upcast to float32 once at load: batched steps run
    several times faster there, single-stream decode somewhat slower (it reads twice the
    bytes); pass dtype="bfloat16" to keep bf16. On the CPU the KV pool is `num_kv_blocks`
    blocks; on accelerators it is `memory_fraction` of the device's free memory.
    `pipeline_depth` 2 dispatches step N+1 before step N returns; 1 turns that off.
    `device_outputs` None reads RAYLM_DEVICE_OUTPUTS (unset or 1: sample on the
    worker; 0: return full logits and sample on the driver, for A/B benchmarks).
    `tensor_parallel_size` ranks (one worker actor per device) make up each replica;
    `num_replicas` such groups serve in data parallel.
    `accelerator_resource` overrides the Ray resource each worker asks one of
    (default: "NPU" for npu, "GPU" for cuda, none for cpu); tests set "NPU" with device
    "cpu" to exercise NPU placement on a machine without NPUs.
    """

    model: str | None = None
    device: str = "cpu"
    num_replicas: int = 1
    tensor_parallel_size: int = 1
    dtype: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    memory_fraction: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    pipeline_depth: int = 2
    device_outputs: bool | None = None
    threads_per_worker: int | None = None
    seed: int = 0
    accelerator_resource: str | None = None
    step_timeout_s: float = 120.0
    max_worker_restarts: int = 3
    max_waiting_requests: int = 4096
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a checkpoint directory path or None, got {self.model!r}")
        if self.model is not None:
            self.model = os.path.expanduser(self.model)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None:
            dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {DTYPES} or None, got {self.dtype!r}")
            self.dtype = dtype
        _int_at_least("num_replicas", self.num_replicas, 1)
        _int_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _int_at_least("block_size", self.block_size, 1)
        if self.num_kv_blocks is not None:
            _int_at_least("num_kv_blocks", self.num_kv_blocks, 2)
        if isinstance(self.memory_fraction, bool) or not isinstance(self.memory_fraction, (int, float)) \
                or not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        _int_at_least("max_num_seqs", self.max_num_seqs, 1)
        _int_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 2)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.pipeline_depth not in (1, 2) or isinstance(self.pipeline_depth, bool):
            raise ValueError(f"pipeline_depth must be 1 (off) or 2, got {self.pipeline_depth!r}")
        if self.device_outputs is not None and not isinstance(self.device_outputs, bool):
            raise ValueError(f"device_outputs must be a bool or None, got {self.device_outputs!r}")
        if self.threads_per_worker is not None:
            _int_at_least("threads_per_worker", self.threads_per_worker, 1)
        _int_at_least("seed", self.seed, 0)
        if self.accelerator_resource is not None and (
                not isinstance(self.accelerator_resource, str) or not self.accelerator_resource):
            raise ValueError(f"accelerator_resource must be a resource name or None, got {self.accelerator_resource!r}")
        _positive_number("step_timeout_s", self.step_timeout_s)
        _int_at_least("max_worker_restarts", self.max_worker_restarts, 0)
        _int_at_least("max_waiting_requests", self.max_waiting_requests, 1)
        _positive_number("start_timeout_s", self.start_timeout_s)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown config option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return asdict(self)
