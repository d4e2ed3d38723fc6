"""Tensor parallelism inside one replica: the rank's process group and how weights split.

A replica of `world_size` ranks runs one process (one Ray actor) per device. The ranks
join one torch.distributed group (gloo on the CPU, nccl on CUDA, hccl on NPU:
`workers.device.dist_backend`), rendezvousing over TCP at rank 0's address. The model
holds only its rank's slice of each weight (Megatron-style):

- column-parallel (output dim split): q/k/v and gate/up. Each rank owns whole heads:
  num_attention_heads / world query heads and num_key_value_heads / world KV heads, so
  its KV pool holds only its heads, and block tables are the same on every rank;
- row-parallel (input dim split): o and down, followed by one all-reduce each; a bias is
  added by rank 0 only (the others hold zeros), so the sum adds it once;
- vocab-parallel: embedding and lm_head rows, the vocab padded up to a multiple of the
  world size (padding rows are zeros); embed sums the ranks' masked lookups, logits are
  gathered to rank 0, which samples.

`SINGLE` is the one-rank group: every collective is the identity, so the model's TP hooks
cost nothing when tensor parallelism is off.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch

from workers.device import dist_backend
from workers.pipeline import NO_PIPELINE, Pipeline


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Where one rank sits in its replica's group and how the group meets."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"  # rank 0's address: the TCP rendezvous
    master_port: int = 0
    timeout_s: float = 600.0  # a collective waiting this long raises (the driver's step timeout fires first)
    expert_parallel: bool = False  # MoE: each rank holds whole experts, not a slice of every expert
    # pipeline stages (workers/pipeline.py): rank = stage * (world_size / stages) + tensor rank
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None  # layers per stage; None: balanced by layer count

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.world_size % self.pipeline_parallel_size:
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size} must divide world_size "
                             f"{self.world_size}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if self.world_size > 1 and not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise ValueError(f"master_port must be a TCP port in (0, 65536), got {self.master_port!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")


def rendezvous_store(host: str, world_size: int, timeout_s: float):
    """Rank 0's rendezvous: a TCPStore listening from now on, on a port the OS picked. Asking for a
    free port and binding it later, when the group starts, left a window in which another process
    (a Ray node, a step channel) could take it: the group's start then failed with EADDRINUSE."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True)


class TensorParallel:
    """One rank's view of its tensor-parallel group (its pipeline stage's ranks): rank, world
    size and the collectives the model uses; `pipeline`: its place among the stages."""

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, expert_parallel: bool = False,
                 pipeline: Pipeline = NO_PIPELINE) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group  # a torch.distributed ProcessGroup; None for the single rank
        self.expert_parallel = expert_parallel and world_size > 1  # how MoE experts split (ShardedShape)
        self.pipeline = pipeline
        # host time inside collectives (on the CPU the wait and the transfer; on accelerators,
        # whose collectives are queued, only the launch): what bench_tp.py reports
        self.collective_s = 0.0
        self.num_collectives = 0

    def _timed(self, op, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        op(*args, group=self.group, **kwargs)
        self.collective_s += time.perf_counter() - t0
        self.num_collectives += 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def samples(self) -> bool:
        """Whether this rank samples (and masks grammars, and returns the step's result): tensor
        rank 0 of the last pipeline stage."""
        return self.rank == 0 and self.pipeline.is_last

    @classmethod
    def join(cls, config: ParallelConfig, device_kind: str, store=None) -> TensorParallel:
        """Join the group `config` describes (blocks until every rank has joined): the whole
        replica's group, and under pipeline parallelism one tensor-parallel group per stage.
        store: rank 0's rendezvous_store (the others connect to master_addr:master_port)."""
        if config.world_size == 1:
            return SINGLE
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        timeout = datetime.timedelta(seconds=config.timeout_s)
        if store is not None:  # under the prefix init_method's rendezvous gives the other ranks' view of it
            dist.init_process_group(backend=dist_backend(device_kind), store=dist.PrefixStore("default_pg", store),
                                    rank=config.rank, world_size=config.world_size, timeout=timeout)
        else:
            dist.init_process_group(
                backend=dist_backend(device_kind), init_method=f"tcp://{config.master_addr}:{config.master_port}",
                rank=config.rank, world_size=config.world_size, timeout=timeout)
        stages = config.pipeline_parallel_size
        tp = config.world_size // stages
        stage, tp_rank = divmod(config.rank, tp)
        if stages == 1:
            return cls(config.rank, config.world_size, dist.group.WORLD, config.expert_parallel)
        # every rank creates every stage's group, in stage order (torch.distributed's rule)
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if tp > 1 else None for s in range(stages)]
        pipeline = Pipeline(stage, stages, tp_rank, tp, config.pp_layer_partition, dist.group.WORLD)
        return cls(tp_rank, tp, groups[stage], config.expert_parallel, pipeline)

    def close(self) -> None:
        if self.group is not None or self.pipeline.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.group = None

    # -- collectives (identity on one rank) --------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.enabled:
            self._timed(torch.distributed.all_reduce, x)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest of each rank's `value` (e.g. KV blocks that fit on every rank)."""
        return self._int_collective(value, lambda t: torch.distributed.all_reduce(
            t, op=torch.distributed.ReduceOp.MIN, group=self.group))

    def first_rank_value(self, value: int) -> int:
        """Rank 0's `value` on every rank (OpTable.agree: one measured kernel choice for all)."""
        return self._int_collective(value, lambda t: torch.distributed.broadcast(t, group_src=0, group=self.group))

    def every_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (OpTable.agree_all)."""
        return bool(self.all_reduce_min(int(flag)))

    def share_choices(self, ops) -> None:
        """Make `ops`' measured kernel choices the group's: rank 0's choice on every rank, and a
        path that weight values qualify for only where every rank's shard does. Every rank must
        then prepare the same weights in the same order (their collectives pair up)."""
        if self.enabled:
            ops.agree, ops.agree_all = self.first_rank_value, self.every_rank

    def _int_collective(self, value: int, op) -> int:
        """op over a one-int tensor on the group's device (a host one for gloo); identity on one rank."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        if self.group is not None and torch.distributed.get_backend(self.group) != "gloo":
            t = t.to(_group_device())
        op(t)
        return int(t.item())

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, on every rank."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._timed(torch.distributed.all_gather, parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x, in rank order, on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        self._timed(torch.distributed.gather, x, parts, group_dst=0)
        return parts

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s x into x on every rank, in place; returns x."""
        if self.enabled:
            self._timed(torch.distributed.broadcast, x, group_src=src)
        return x


def _group_device() -> torch.device:
    """The device of this rank's accelerator (nccl and hccl reduce device tensors)."""
    from workers.device import torch_device

    backend = torch.distributed.get_backend()
    return torch_device("cuda" if backend == "nccl" else "npu")


SINGLE = TensorParallel()


# -- how the model splits -------------------------------------------------------------

def padded_vocab(vocab_size: int, world_size: int) -> int:
    """The vocab rounded up to a multiple of world_size (each rank holds the same rows)."""
    return -(-vocab_size // world_size) * world_size


def check_shardable(config, world_size: int, expert_parallel: bool = False) -> None:
    """ValueError naming each shape that does not split evenly over `world_size` ranks (MoE:
    the experts under expert parallelism, else each expert's intermediate dim)."""
    _positive_int("tensor_parallel_size", world_size)
    names = ["num_attention_heads", "num_key_value_heads"]
    if getattr(config, "has_dense_layers", True):
        names.append("intermediate_size")
    if getattr(config, "is_moe", False):
        names.append("num_experts" if expert_parallel else "moe_intermediate_size")
    bad = [f"{name} ({getattr(config, name)})" for name in names if getattr(config, name) % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size {world_size} must divide {', '.join(bad)}")


@dataclass(frozen=True)
class ShardedShape:
    """The sizes one rank's modules hold (world_size 1: the full model)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_rows: int  # this rank's rows of the (padded) vocab
    vocab_start: int  # the first vocab id this rank holds
    # MoE (zeros for a dense model): this rank's experts and their intermediate dim
    num_local_experts: int = 0
    first_expert: int = 0
    moe_intermediate_size: int = 0

    @classmethod
    def of(cls, config, parallel: TensorParallel) -> ShardedShape:
        w, r = parallel.world_size, parallel.rank
        experts, inter = getattr(config, "num_experts", 0), getattr(config, "moe_intermediate_size", 0)
        if w == 1:
            return cls(config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
                       config.vocab_size, 0, experts, 0, inter)
        ep = parallel.expert_parallel
        check_shardable(config, w, ep)
        rows = padded_vocab(config.vocab_size, w) // w
        local = experts // w if ep else experts
        return cls(config.num_attention_heads // w, config.num_key_value_heads // w,
                   config.intermediate_size // w, rows, r * rows,
                   local, r * local if ep else 0, inter if ep else inter // w)


# A linear's tensors by the linear's kind and the tensor's name (its full-precision weight and bias,
# and the quantized formats' tensors, workers/quant) -> the dim split across ranks; "first": whole on
# rank 0 and zeros elsewhere (a row-parallel linear's output bias, added once after the sum); absent:
# every rank holds it whole (per-output scales of a row-parallel linear, per-tensor input scales).
_COLUMN_LINEARS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_LINEARS = ("o_proj", "down_proj")
_COLUMN_SPLIT = {"weight": 0, "bias": 0, "weight_scale": 0, "weight_offset": 0, "quant_bias": 0, "deq_scale": 0,
                 "qweight": 1, "qzeros": 1, "scales": 1}  # AWQ's are [in, out] (packed along out)
_ROW_SPLIT = {"weight": 1, "bias": "first", "quant_bias": "first", "qweight": 0, "qzeros": 0, "scales": 0}
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # a MoE layer's stacked experts


def _split_of(name: str):
    """How tensor `name` is split across ranks: a dim, "first", "vocab", "experts" or None (whole)."""
    if name.endswith(_VOCAB):
        return "vocab"
    if name.endswith(_EXPERTS):
        return "experts"
    module, _, tensor = name.rpartition(".")
    kind = module.rpartition(".")[2]
    if kind in _COLUMN_LINEARS:
        return _COLUMN_SPLIT.get(tensor)
    if kind in _ROW_LINEARS:
        return _ROW_SPLIT.get(tensor)
    return None


def shard_of(name: str, source, full_shape: tuple[int, ...], parallel: TensorParallel,
             vocab_size: int) -> torch.Tensor:
    """This rank's part of weight `name` read from `source`, which slices like a tensor
    (a tensor, or safetensors' get_slice: only the slice is read from disk)."""
    w, r = parallel.world_size, parallel.rank
    split = _split_of(name)
    if w == 1 or split is None:
        return source[:]
    if split == "experts":
        return _expert_shard(name, source, full_shape, parallel)
    if split == "first":  # added once, by rank 0
        return source[:] if r == 0 else torch.zeros_like(source[:])
    if split == "vocab":
        rows = padded_vocab(vocab_size, w) // w
        start, stop = r * rows, min((r + 1) * rows, full_shape[0])
        part = source[start:max(start, stop)] if start < full_shape[0] else source[0:0]
        if part.shape[0] == rows:
            return part
        out = torch.zeros((rows, *full_shape[1:]), dtype=part.dtype)  # the padding rows
        out[: part.shape[0]].copy_(part)
        return out
    size = full_shape[split] // w
    return source[r * size:(r + 1) * size] if split == 0 else source[:, r * size:(r + 1) * size]


def _expert_shard(name: str, source, full_shape: tuple[int, ...], parallel: TensorParallel) -> torch.Tensor:
    """This rank's part of a layer's stacked experts (gate_up_proj [E, 2I, hidden], down_proj
    [E, hidden, I]): whole experts under expert parallelism, else every expert's slice of I
    (the same slice of its gate rows and of its up rows)."""
    w, r = parallel.world_size, parallel.rank
    if parallel.expert_parallel:
        n = full_shape[0] // w
        return source[r * n:(r + 1) * n]
    if name.endswith("gate_up_proj"):
        inter = full_shape[1] // 2
        n = inter // w
        return torch.cat([source[:, r * n:(r + 1) * n], source[:, inter + r * n:inter + (r + 1) * n]], dim=1)
    n = full_shape[2] // w
    return source[:, :, r * n:(r + 1) * n]
