"""EngineConfig: every knob of a launched engine, validated once, and the settings derived from it.

Users set EngineConfig (Python kwargs, CLI flags, `raylm serve`). The scheduler's
settings (SchedulerConfig) and each worker's (RunnerConfig) are derived here and nowhere
else: `scheduler_config()` and `runner_config()`. Those two are plain dataclasses that
trust what they are given. Adding a knob means a field here, its line in the derivation,
and its consumer.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from scheduler.checks import check_bool, check_fraction, check_int, check_positive, is_int, is_number
from scheduler.scheduler_config import SchedulerConfig
from workers.block_sizes import check_npu_block_size, default_block_size
from workers.runner_config import (
    DEVICE_KINDS,
    STEP_CHANNELS,
    RunnerConfig,
    canonical_dtype,
    check_quantization,
    device_outputs_enabled,
)
from workers.spec_config import SpeculativeConfig
from workers.stage_layers import check_partition

GENERATION_CONFIG_MODES = ("auto", "none")
# the engine actor's sys.setswitchinterval, in ms (cluster/remote/engine_actor.py says why); None: Python's 5 ms
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.5


def check_gil_switch_interval_ms(value) -> None:
    if value is None:
        return
    if not is_number(value) or not 0 < value <= 100:
        raise ValueError(f"gil_switch_interval_ms must be a number in (0, 100] or None, got {value!r}")


@dataclass
class EngineConfig:
    """How to run one engine: which model, on what, and how to batch.

    The fields come in groups: the model and where it runs; batching and the KV pool;
    parallelism; reliability (timeouts, healing, hostile input); and an advanced group of
    performance knobs and placement overrides whose defaults are chosen for the device, which a
    user touches only to measure (each says when). The notes below go field by field.

    model None serves the bundled tiny Qwen3. `dtype` None computes in the checkpoint's
    dtype, except bf16/fp16 weights on a CPU without half-precision matmul instructions
    (no AVX512-BF16 or AMX), which are upcast to float32 once at load: batched steps run
    several times faster there, single-stream decode somewhat slower (it reads twice the
    bytes); pass dtype="bfloat16" to keep bf16. A quantized checkpoint (compressed-tensors W8A8,
    msmodelslim W8A8 / W8A8_DYNAMIC, AWQ W4A16) is read as such; `quantization="int8"` quantizes
    an unquantized one's decoder linears at load (workers/quant/formats.py). On the CPU the KV pool is `num_kv_blocks`
    blocks (None: room for max_num_seqs sequences of max_model_len within 1 GiB, at least
    512 blocks; workers/device.py default_cpu_blocks); on accelerators it is
    `memory_fraction` of the device's free memory.
    On the CPU each worker computes with `threads_per_worker` torch threads (None: the
    cluster's CPUs less `reserved_cpus`, split over every replica's ranks, and for decode steps
    one thread instead where the worker measures that clearly faster while it warms up: a small
    model's decode can be, by CPU; stats() reports the choice and the timings). `raylm serve`
    reserves 1: its HTTP server and the engine actor then keep a core of their own (as vLLM's
    CPU build reserves one for its API server) instead of stalling the worker's threads.
    Steps of 256 tokens or more (prefill chunks) compute with `prefill_threads_per_worker`
    (None: the reserved cores lent back, i.e. the split without reserved_cpus, when
    threads_per_worker is None; else threads_per_worker): such a step streams one token per
    running request over a long compute, so the frontend's core is nearly idle meanwhile.
    `pipeline_depth` 2 dispatches step N+1 before step N returns (each of P pipeline stages'
    batches likewise: 2 x P steps in flight); 1 turns that off.
    `device_outputs` None reads RAYLM_DEVICE_OUTPUTS (unset or 1: sample on the
    worker; 0: return full logits and sample on the driver, for A/B benchmarks).
    `tensor_parallel_size` ranks (one worker actor per device) make up each replica;
    `num_replicas` such groups serve in data parallel. A MoE model's experts are split across the
    ranks whole with `enable_expert_parallel` (vLLM's --enable-expert-parallel), else each
    expert's intermediate dim is. `pipeline_parallel_size` stages (each a TP group) split a
    replica's layers, balanced by layer count or by `pp_layer_partition` (layers per stage, vLLM's
    VLLM_PP_LAYER_PARTITION, e.g. "5,3": the last stage also holds the lm_head); stages go on
    different nodes when no node holds the whole replica, pass activations worker to worker, and
    keep as many steps in flight as there are stages, over disjoint requests.
    `speculative_config` (vLLM's keys: method "ngram" or "draft_model", model, num_speculative_tokens,
    prompt_lookup_min / _max) lets a request's decode row verify up to num_speculative_tokens
    drafted tokens in one step (not a request's with penalties, a grammar or logprobs); greedy and
    seeded requests produce the same tokens as without it, others the same distribution.
    `fake_step_s` (benchmarks only: `raylm bench --driver-capacity`) starts workers that load no
    model and answer each step's sampling rows with ids of their own after that many seconds, a
    device's step time stood in for (0: at once; workers/fake_runner.py), through the real step
    channel, plan and scheduler, each asking Ray for a hundredth of a CPU: what limits throughput
    is then the engine itself.
    `accelerator_resource` overrides the Ray resource each worker asks one of
    (default: "NPU" for npu, "GPU" for cuda, none for cpu); tests set "NPU" with device
    "cpu" to exercise NPU placement on a machine without NPUs. `block_size` None: 128 on
    the NPU (what its fused kernels take; they refuse sizes that are not multiples of 16
    up to 128), 16 elsewhere. On accelerators decode-only steps replay captured graphs,
    one per batch bucket in `graph_sizes` (None: powers of two up to max_num_seqs);
    `enforce_eager` turns that off.
    Healing (docs/reliability.md): a replica restarts a failed worker at most
    `max_worker_restarts` times within any `restart_window_s` seconds, waiting
    `restart_backoff_s` (doubling, at most `max_restart_backoff_s`) between failures in
    a row; beyond that it gives up, fails its requests, and tries again after
    `replica_cooldown_s`, rejoining the router once its worker is up. A request that was on
    the worker at `max_request_failures` failures in a row (none of its tokens sampled in
    between) is failed as their likely cause, so one request cannot take a replica down
    over and over; the others are recomputed. Workers that cannot be placed within
    `placement_timeout_s` (raise it for a cluster that autoscales) fail the start, saying what
    they asked for and what the cluster has free; `start_timeout_s` bounds their loading.
    A request's grammar (structured output, forced tool calls) is compiled by the workers
    before the request is scheduled, never inside a step: a spec longer than
    `max_grammar_bytes`, or one not compiled within `grammar_compile_timeout_s`, is refused
    (a 400), and only that request waits for its grammar.
    `generation_config` "auto" takes the checkpoint's generation_config.json sampling values
    (temperature, top_p, top_k, min_p, the repetition, presence and frequency penalties,
    max_new_tokens as max_tokens) as the defaults of requests that leave them unset, as vLLM
    does; "none" ignores them (vLLM's `--generation-config vllm`).
    `prepare_structured_output` loads the tokenizer and xgrammar into each worker while it
    starts (a second or two: the tokenizer and xgrammar's vocab tables), where xgrammar is installed and the model has a
    tokenizer, instead of in the step of the first request with a grammar, which held every
    request of the replica meanwhile. `raylm serve` turns it on; off by default here.
    `step_channel` is how each step reaches a worker: "socket" over a TCP connection to the
    worker (workers/step_channel.py: one frame each way, ~7x less CPU per step than a Ray
    call at either end), "ray" as one actor call per step; "auto" picks "socket" on the CPU
    and "ray" on accelerators (the socket path runs steps on a thread of the worker, not
    yet verified on CUDA or NPU devices). Workers on other nodes must accept connections
    on an ephemeral port from the driver's node, as Ray's own worker ports do.
    `trust_request_chat_template` lets a request bring its own chat template (the
    chat_template field, or chat_template_kwargs.chat_template), as vLLM's
    --trust-request-chat-template does; off, such a request is refused (a 400). A request's
    template is the client's code: it renders in a bounded sandbox (cluster/core/template_sandbox.py).
    """

    # ---- the model and where it runs ----
    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    quantization: str | None = None  # "int8": quantize at load; None: the checkpoint's own format, if any
    max_model_len: int | None = None
    generation_config: str = "auto"
    seed: int = 0
    # ---- batching and the KV pool ----
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None
    memory_fraction: float = 0.9
    block_size: int | None = None
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096
    # ---- parallelism ----
    num_replicas: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE under TP: whole experts per rank, not a slice of each
    pipeline_parallel_size: int = 1
    pp_layer_partition: list[int] | str | None = None  # layers per stage; None: balanced by layer count
    speculative_config: dict | SpeculativeConfig | None = None  # vLLM's keys (workers/spec_config.py)
    # ---- reliability: timeouts, healing, hostile input ----
    step_timeout_s: float = 120.0
    max_worker_restarts: int = 3
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    replica_cooldown_s: float = 60.0
    max_request_failures: int = 2
    grammar_compile_timeout_s: float = 10.0
    max_grammar_bytes: int = 64 * 1024
    trust_request_chat_template: bool = False
    start_timeout_s: float = 600.0
    placement_timeout_s: float = 60.0
    # ---- advanced: performance tuning and placement overrides, chosen well by default ----
    threads_per_worker: int | None = None  # a CPU worker's threads; default: the cores split, decode's measured
    reserved_cpus: int = 0  # cores left out of that split for the HTTP server (raylm serve leaves 1)
    prefill_threads_per_worker: int | None = None  # threads of steps of 256+ tokens; default: lend reserved back
    pipeline_depth: int = 2  # steps in flight per replica (per stage); 1 only to measure what pipelining buys
    device_outputs: bool | None = None  # False: return logits and sample on the driver (the A/B baseline)
    step_channel: str = "auto"  # "socket" / "ray"; auto picks socket on the CPU (a Ray call costs more CPU)
    enforce_eager: bool = False  # no captured decode graphs on accelerators (debugging)
    graph_sizes: list[int] | None = None  # decode graph buckets; default: powers of two up to max_num_seqs
    prepare_structured_output: bool = False  # load xgrammar at worker start (raylm serve does)
    accelerator_resource: str | None = None  # a cluster naming its accelerators otherwise; "NPU" + cpu: a dry run
    fake_step_s: float | None = None  # benchmarks: workers with no model whose steps take this long (0: none)

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a checkpoint directory path or None, got {self.model!r}")
        if self.model is not None:
            self.model = os.path.expanduser(self.model)
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"device must be one of {DEVICE_KINDS}, got {self.device!r}")
        if self.dtype is not None:
            self.dtype = canonical_dtype(self.dtype)
        check_quantization(self.quantization)
        check_int("num_replicas", self.num_replicas, 1)
        if self.block_size is None:
            self.block_size = default_block_size(self.device)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_bool("enable_expert_parallel", self.enable_expert_parallel)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        partition = check_partition(self.pp_layer_partition, self.pipeline_parallel_size)
        self.pp_layer_partition = None if partition is None else list(partition)
        if self.fake_step_s is not None:
            if not is_number(self.fake_step_s) or not 0 <= self.fake_step_s <= 10:
                raise ValueError(f"fake_step_s must be seconds in [0, 10] or None, got {self.fake_step_s!r}")
            if self.device != "cpu":
                raise ValueError(f"fake workers (fake_step_s) run no device: device must be 'cpu', got {self.device!r}")
        check_int("block_size", self.block_size, 1)
        if self.device == "npu":
            check_npu_block_size(self.block_size)
        check_int("num_kv_blocks", self.num_kv_blocks, 2, optional=True)
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative_config is not None:
            if self.pipeline_parallel_size != 1:
                raise ValueError(f"speculative_config runs with pipeline_parallel_size 1 for now, "
                                 f"got {self.pipeline_parallel_size}")
            if self.fake_step_s is not None:
                raise ValueError("speculative_config needs a model: fake workers (fake_step_s) draft nothing")
            if self.device_outputs is False:
                raise ValueError("speculative_config verifies drafts on the worker: device_outputs must not be False")
        check_fraction("memory_fraction", self.memory_fraction)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_model_len", self.max_model_len, 2, optional=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("pipeline_depth", self.pipeline_depth, 1, 2)
        check_bool("device_outputs", self.device_outputs, optional=True)
        check_int("threads_per_worker", self.threads_per_worker, 1, optional=True)
        check_int("reserved_cpus", self.reserved_cpus, 0)
        check_int("prefill_threads_per_worker", self.prefill_threads_per_worker, 1, optional=True)
        if (self.prefill_threads_per_worker is not None and self.threads_per_worker is not None
                and self.prefill_threads_per_worker < self.threads_per_worker):
            raise ValueError(f"prefill_threads_per_worker must be >= threads_per_worker {self.threads_per_worker}, "
                             f"got {self.prefill_threads_per_worker}")
        check_int("seed", self.seed, 0)
        if self.accelerator_resource is not None and (
                not isinstance(self.accelerator_resource, str) or not self.accelerator_resource):
            raise ValueError(f"accelerator_resource must be a resource name or None, got {self.accelerator_resource!r}")
        check_positive("step_timeout_s", self.step_timeout_s)
        check_int("max_worker_restarts", self.max_worker_restarts, 0)
        check_positive("restart_window_s", self.restart_window_s)
        check_positive("restart_backoff_s", self.restart_backoff_s)
        check_positive("max_restart_backoff_s", self.max_restart_backoff_s)
        check_positive("replica_cooldown_s", self.replica_cooldown_s)
        check_int("max_request_failures", self.max_request_failures, 1)
        check_positive("grammar_compile_timeout_s", self.grammar_compile_timeout_s)
        check_int("max_grammar_bytes", self.max_grammar_bytes, 1)
        check_int("max_waiting_requests", self.max_waiting_requests, 1)
        check_positive("start_timeout_s", self.start_timeout_s)
        check_positive("placement_timeout_s", self.placement_timeout_s)
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("prepare_structured_output", self.prepare_structured_output)
        check_bool("trust_request_chat_template", self.trust_request_chat_template)
        if self.step_channel not in ("auto", *STEP_CHANNELS):
            raise ValueError(f"step_channel must be one of auto, {', '.join(STEP_CHANNELS)}; got {self.step_channel!r}")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_MODES}, "
                             f"got {self.generation_config!r}")
        sizes = self.graph_sizes
        if sizes is not None:
            if (not isinstance(sizes, (list, tuple)) or not sizes
                    or not all(is_int(n) and 1 <= n <= self.max_num_seqs for n in sizes)):
                raise ValueError(f"graph_sizes must be batch sizes in [1, max_num_seqs={self.max_num_seqs}] "
                                 f"or None, got {sizes!r}")
            self.graph_sizes = sorted(set(sizes))

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown config option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- derived settings: the one place they are mapped ----
    def runner_config(self, replica_index: int, *, model_path: str, num_threads: int,
                      prefill_threads: int | None = None) -> RunnerConfig:
        """Replica `replica_index`'s worker settings. `model_path` is the resolved model
        (the bundled one when `model` is None), `num_threads` the torch threads of a CPU
        worker, `prefill_threads` those of its big steps (None: num_threads).
        RAYLM_DEVICE_OUTPUTS is read here, once."""
        return RunnerConfig(
            model=model_path, device=self.device, dtype=self.dtype, quantization=self.quantization,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, memory_fraction=self.memory_fraction,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, device_outputs=device_outputs_enabled(self.device_outputs),
            seed=self.seed + replica_index, num_threads=num_threads if self.device == "cpu" else None,
            prefill_threads=prefill_threads if self.device == "cpu" else None,
            choose_decode_threads=self.device == "cpu" and self.threads_per_worker is None
            and self.tensor_parallel_size == self.pipeline_parallel_size == 1,
            enforce_eager=self.enforce_eager, graph_sizes=None if self.graph_sizes is None else tuple(self.graph_sizes),
            prepare_structured_output=self.prepare_structured_output, step_channel=self.resolved_step_channel,
            fake_step_s=self.fake_step_s, speculative=self.speculative_config,
        )

    @property
    def resolved_step_channel(self) -> str:
        """"socket" or "ray": what `step_channel` "auto" means on this device."""
        if self.step_channel != "auto":
            return self.step_channel
        return "socket" if self.device == "cpu" else "ray"

    def scheduler_config(self, *, num_blocks: int, max_model_len: int) -> SchedulerConfig:
        """A replica's scheduling limits, given what its worker reported at start: the KV
        pool it allocated and the max_model_len it resolved."""
        return SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, max_concurrent_batches=self.pipeline_parallel_size,
            num_lookahead_tokens=self.num_lookahead_tokens,
            lookahead_below=None if self.speculative_config is None else self.speculative_config.disable_by_batch_size,
        )

    @property
    def num_lookahead_tokens(self) -> int:
        """Drafted tokens a decode row may verify (speculative decoding); 0 without it."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def pipeline_depth_for(self, device_outputs: bool) -> int:
        """Steps in flight per replica: host-logits mode needs each step's ids before the next;
        P pipeline stages keep pipeline_depth x P in flight, P batches of disjoint requests in turn
        (the scheduler keeps them apart), each pipelined as one stage's steps are: the first stage
        embeds a batch's next step from the ids the last sent it, not from the driver's plan."""
        if not device_outputs:
            return 1
        return self.pipeline_depth * self.pipeline_parallel_size
