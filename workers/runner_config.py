"""RunnerConfig: one worker's settings, derived from EngineConfig (cluster/config.py).

A plain dataclass: it trusts its input, which EngineConfig validated once. Tests and
benchmarks that build one by hand get the same defaults. Also the choices a worker
accepts (device kinds, dtype names) and the RAYLM_DEVICE_OUTPUTS switch; no torch here,
so the driver's config module can import it cheaply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from scheduler.checks import NO_WORDS, YES_WORDS, check_bool, flag_word
from workers.spec_config import SpeculativeConfig

DEVICE_KINDS = ("cpu", "cuda", "npu")
STEP_CHANNELS = ("socket", "ray")  # how a worker gets its steps (workers/step_channel.py)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
ENV_DEVICE_OUTPUTS = "RAYLM_DEVICE_OUTPUTS"
# what `quantization` may name (workers/quant/formats.py): "int8" quantizes an unquantized checkpoint at
# load; the others (vLLM's names; "ascend" is vllm-ascend's for msmodelslim) assert the checkpoint's own
QUANTIZATIONS = ("int8", "compressed-tensors", "awq", "ascend")


def canonical_dtype(name: str) -> str:
    """"bf16" -> "bfloat16" (any case, an optional "torch." prefix); ValueError for others."""
    key = name.removeprefix("torch.").lower() if isinstance(name, str) else name
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)} (or {', '.join(DTYPE_ALIASES)}), "
                         f"got {name!r}")
    return key


def check_quantization(value) -> str | None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {value!r}")
    return value


def device_outputs_enabled(flag: bool | None = None) -> bool:
    """Whether workers sample on the device: `flag` if given, else RAYLM_DEVICE_OUTPUTS.

    Unset or a yes (1, true, yes, on) -> True; a no (0, false, no, off) -> False (any case);
    any other value raises ValueError naming the variable and the value.
    """
    if flag is not None:
        check_bool("device_outputs", flag)
        return flag
    raw = os.environ.get(ENV_DEVICE_OUTPUTS)
    if raw is None:
        return True
    value = flag_word(raw)
    if value is None:
        raise ValueError(f"{ENV_DEVICE_OUTPUTS} must be one of {', '.join(YES_WORDS + NO_WORDS)}; got {raw!r}")
    return value


@dataclass
class RunnerConfig:
    model: str | None = None  # checkpoint dir or "random:qwen3-0.6b?layers=N&seed=S"; None -> the bundled tiny model
    device: str = "cpu"  # one of DEVICE_KINDS
    device_index: int | None = None
    dtype: str | None = None  # one of DTYPE_NAMES; None -> device.compute_dtype (the weights'
    # own, except bf16/fp16 weights on a CPU without native half matmuls: float32)
    quantization: str | None = None  # one of QUANTIZATIONS; None: the checkpoint's own, if any
    block_size: int = 16
    num_kv_blocks: int | None = None  # CPU: the pool size (default 512); accelerators: None -> memory_fraction
    memory_fraction: float = 0.9
    max_num_seqs: int = 64  # number of slots
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None -> the model's max_position_embeddings (scaled RoPE: its length)
    device_outputs: bool | None = None  # None -> RAYLM_DEVICE_OUTPUTS (default on)
    seed: int = 0  # for unseeded sampling
    num_threads: int | None = None  # torch.set_num_threads on the CPU when given
    # CPU: torch threads for a step of at least prefill_thread_tokens tokens (prefill chunks);
    # None -> num_threads. More than num_threads borrows cores a frontend keeps during decode.
    prefill_threads: int | None = None
    prefill_thread_tokens: int = 256
    # CPU: while warming up, time decode-sized steps on one thread and on num_threads, and keep the
    # faster for steps below prefill_thread_tokens (a small model's decode can be faster on one core
    # than split over two, by CPU); the engine asks for it when the user left the thread count to it
    choose_decode_threads: bool = False
    ops: str | None = None  # op table: "reference" | "cpu" | "cuda" | "npu"; None -> RAYLM_OPS or the device's own
    enforce_eager: bool = False  # True: no decode graphs on accelerators (workers/graphs.py)
    # load the tokenizer and xgrammar at start (where installed), not in the first grammar's step
    prepare_structured_output: bool = False
    step_channel: str = "ray"  # "socket": steps over the worker's StepServer; "ray": one actor call each
    graph_sizes: tuple[int, ...] | None = None  # decode graph buckets; None -> powers of two up to max_num_seqs
    # benchmarks: no model; each step answers its sampling rows after this many seconds (workers/fake_runner.py)
    fake_step_s: float | None = None
    speculative: SpeculativeConfig | None = None  # speculative decoding (workers/spec_config.py); None: off

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):  # as it travels to the worker actor (dataclasses.asdict)
            self.speculative = SpeculativeConfig.from_dict(self.speculative)
