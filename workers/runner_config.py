"""RunnerConfig: one worker's settings, and the RAYLM_DEVICE_OUTPUTS switch."""

from __future__ import annotations

import os
from dataclasses import dataclass

from workers.device import KINDS
from workers.loader import DTYPES, is_random_spec, parse_random_spec

ENV_DEVICE_OUTPUTS = "RAYLM_DEVICE_OUTPUTS"


def device_outputs_enabled(flag: bool | None = None) -> bool:
    """Whether workers sample on the device: `flag` if given, else RAYLM_DEVICE_OUTPUTS.

    Unset, "1" or "true" -> True; "0" or "false" -> False (case-insensitive);
    any other value raises ValueError naming the variable and the value.
    """
    if flag is not None:
        if not isinstance(flag, bool):
            raise ValueError(f"device_outputs must be a bool or None, got {flag!r}")
        return flag
    raw = os.environ.get(ENV_DEVICE_OUTPUTS)
    if raw is None:
        return True
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise ValueError(f"{ENV_DEVICE_OUTPUTS} must be one of 1, true, 0, false; got {raw!r}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class RunnerConfig:
    model: str | None = None  # checkpoint dir or "random:qwen3-0.6b?layers=N&seed=S"; None -> the bundled tiny model
    device: str = "cpu"  # "cpu" | "cuda" | "npu"
    device_index: int | None = None
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None -> device.compute_dtype (the weights'
    # own, except bf16/fp16 weights on a CPU without native half matmuls: float32)
    block_size: int = 16
    num_kv_blocks: int | None = None  # CPU: the pool size (default 512); accelerators: None -> memory_fraction
    memory_fraction: float = 0.9
    max_num_seqs: int = 64  # number of slots
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None -> the model's max_position_embeddings
    device_outputs: bool | None = None  # None -> RAYLM_DEVICE_OUTPUTS (default on)
    seed: int = 0  # for unseeded sampling
    num_threads: int | None = None  # torch.set_num_threads on the CPU when given

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a checkpoint directory or None, got {self.model!r}")
        if is_random_spec(self.model):
            parse_random_spec(self.model)  # raises ValueError naming what is wrong
        if self.device not in KINDS:
            raise ValueError(f"device must be one of {', '.join(KINDS)}, got {self.device!r}")
        if self.device_index is not None and (not isinstance(self.device_index, int)
                                              or isinstance(self.device_index, bool) or self.device_index < 0):
            raise ValueError(f"device_index must be an integer >= 0 or None, got {self.device_index!r}")
        if self.dtype is not None and str(self.dtype).lower() not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16, float16 or None, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        f = self.memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {f!r}")
        if self.device_outputs is not None and not isinstance(self.device_outputs, bool):
            raise ValueError(f"device_outputs must be a bool or None, got {self.device_outputs!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
