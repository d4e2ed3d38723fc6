"""Decode graph capture: one captured decode step per batch-size bucket, replayed.

On accelerators an eager decode step of a small batch is bound by kernel launches from
Python; replaying a captured graph (torch.cuda.CUDAGraph, torch.npu.NPUGraph) launches
the whole forward at once. A graph reads and writes fixed addresses, so each bucket of N
rows owns static inputs (token ids, positions, slots, KV lengths, block tables: slices of
buffers sized for the largest bucket) and writes the resident outputs (`next_hidden`,
`logits` from ResidentOutputs, the same buffers an eager step uses). A step of B <= N
decode rows copies its inputs in, pads rows B..N with a harmless row (one key in a
reserved pad block that no request owns), lets the attention backend update what a
captured kernel cannot re-read by itself (`update_graph`: on Ascend the paged-attention
tasks' host context lengths, on CUDA FlashInfer's plan), replays, and returns logits[:B].
Sampling stays eager on those logits. Mixed and prefill steps never use a graph.

The device part (making, capturing and replaying a graph) sits behind `GraphDevice`, so
the logic runs on the CPU in tests with a fake whose replay re-runs the captured callable.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from workers.ops.base import AttentionMetadata

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

log = logging.getLogger(__name__)


def check_graph_sizes(sizes, max_num_seqs: int) -> tuple[int, ...]:
    """The bucket sizes to capture: positive ints, ascending, none above max_num_seqs."""
    if not isinstance(sizes, (list, tuple)) or not sizes:
        raise ValueError(f"graph sizes must be a non-empty list of positive integers, got {sizes!r}")
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"graph sizes must be positive integers, got {s!r} in {list(sizes)}")
        if s > max_num_seqs:
            raise ValueError(f"graph size {s} exceeds max_num_seqs {max_num_seqs}")
    return tuple(sorted(set(sizes)))


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [s for s in DEFAULT_GRAPH_SIZES if s < max_num_seqs]
    return tuple(sizes + [max_num_seqs])


class GraphDevice:
    """What capture needs from a device: make, warm up, capture and replay graphs."""

    def new_graph(self):
        raise NotImplementedError

    def warmup(self, fn) -> None:
        fn()

    def capture(self, graph, fn) -> None:
        raise NotImplementedError

    def replay(self, graph) -> None:
        graph.replay()

    def synchronize(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return 0


class _TorchGraphDevice(GraphDevice):
    """torch.cuda and torch.npu share the graph API (torch_npu mirrors torch.cuda's)."""

    def __init__(self, module, graph_class) -> None:
        self.mod, self.graph_class = module, graph_class
        pool = getattr(module, "graph_pool_handle", None)
        self.pool = pool() if pool else None  # one memory pool shared by every bucket's graph

    def new_graph(self):
        return self.graph_class()

    def warmup(self, fn) -> None:  # on a side stream, as capture requires of lazy inits
        stream = self.mod.Stream()
        stream.wait_stream(self.mod.current_stream())
        with self.mod.stream(stream):
            fn()
        self.mod.current_stream().wait_stream(stream)

    def capture(self, graph, fn) -> None:
        with self.mod.graph(graph, pool=self.pool):
            fn()

    def synchronize(self) -> None:
        self.mod.synchronize()

    def memory_allocated(self) -> int:
        return int(self.mod.memory_allocated())


def graph_device_for(device: torch.device) -> GraphDevice | None:
    """CUDA graphs on cuda, ACL graphs on npu (torch_npu already imported), none on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return _TorchGraphDevice(torch.cuda, torch.cuda.CUDAGraph)
    if device.type == "npu":
        return _TorchGraphDevice(torch.npu, torch.npu.NPUGraph)  # type: ignore[attr-defined]
    return None


@dataclass
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int  # device memory the graphs and their pool took

    def __str__(self) -> str:
        return (f"captured decode graphs for batch sizes {list(self.sizes)} in {self.seconds:.2f} s, "
                f"{self.memory_bytes / 2**20:.1f} MiB")


@dataclass
class _Bucket:
    size: int
    meta: AttentionMetadata  # static: its tensors are slices of the shared buffers
    hidden: torch.Tensor  # [N, hidden] resident next_hidden rows
    logits: torch.Tensor  # [N, V] resident logits rows
    state: object  # the attention backend's graph state (None if it keeps none)
    graph: object = None


class DecodeGraphs:
    def __init__(self, *, model, attention, kv_cache, outputs, sizes, max_blocks: int, pad_block: int,
                 vocab_size: int, graph_device: GraphDevice) -> None:
        if not getattr(attention, "supports_graphs", False):
            raise ValueError(f"the {getattr(attention, 'name', type(attention).__name__)} attention backend "
                             "cannot run in a captured graph; set enforce_eager=True")
        if not 0 <= pad_block < kv_cache.num_blocks:
            raise ValueError(f"pad_block must be a block of the cache (0..{kv_cache.num_blocks - 1}), got {pad_block}")
        self.model, self.attention, self.kv_cache, self.outputs = model, attention, kv_cache, outputs
        self.sizes = tuple(sorted(set(sizes)))  # ascending: bucket_for takes the first that fits
        self.graph_device = graph_device
        self.pad_block, self.pad_slot = pad_block, pad_block * kv_cache.block_size
        self.vocab_size = vocab_size
        self.report: CaptureReport | None = None
        self.num_replays = 0
        m, dev = max(self.sizes), kv_cache.data.device
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=dev)  # [M]
        self.positions = torch.zeros(m, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((m,), self.pad_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(m, max_blocks, dtype=torch.int32, device=dev)  # [M, max_blocks]
        self.block_tables[:, 0] = pad_block
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self._buckets: dict[int, _Bucket] = {}

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest captured size holding num_rows, or None (run eagerly)."""
        for s in self.sizes:
            if s >= num_rows:
                return s
        return None

    def _make_bucket(self, n: int) -> _Bucket:
        mc = self.model.config
        meta = AttentionMetadata(
            num_tokens=n, num_decode=n, block_size=self.kv_cache.block_size, slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n], query_lens_host=[1] * n, seq_lens_host=[1] * n)
        new_state = getattr(self.attention, "new_graph_state", None)
        state = None if new_state is None else new_state(
            n, max_blocks=self.block_tables.shape[1], device=self.block_tables.device,
            num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
            dtype=self.model.dtype)
        meta.extra["graph"] = state
        hidden = self.outputs.get_rows("next_hidden", n, (mc.hidden_size,), self.model.dtype)
        logits = self.outputs.get_rows("logits", n, (self.vocab_size,), torch.float32)
        return _Bucket(size=n, meta=meta, hidden=hidden, logits=logits, state=state)

    def _step(self, b: _Bucket) -> None:
        """The captured work: embed the static ids, the forward (which prepares the attention
        metadata), logits into the resident rows."""
        self.model.embed(self.input_ids[:b.size], out=b.hidden)
        h = self.model(b.hidden, self.positions[:b.size], self.kv_cache, b.meta)
        self.model.compute_logits(h, out=b.logits)

    def _update(self, b: _Bucket) -> None:
        update = getattr(self.attention, "update_graph", None)
        if update is not None and b.state is not None:
            update(b.state, b.meta)

    def capture(self) -> CaptureReport:
        dev = self.graph_device
        dev.synchronize()
        t0, mem0 = time.perf_counter(), dev.memory_allocated()
        with torch.inference_mode():
            for n in sorted(self.sizes, reverse=True):  # largest first: the pool serves the smaller ones
                b = self._make_bucket(n)
                self._update(b)
                step = functools.partial(self._step, b)
                dev.warmup(step)
                b.graph = dev.new_graph()
                if b.state is not None:
                    b.state.capturing = True
                try:
                    dev.capture(b.graph, step)
                finally:
                    if b.state is not None:
                        b.state.capturing = False
                self._buckets[n] = b
        dev.synchronize()
        self.report = CaptureReport(sizes=self.sizes, seconds=time.perf_counter() - t0,
                                    memory_bytes=dev.memory_allocated() - mem0)
        log.info("%s", self.report)
        return self.report

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step (B rows, B <= the largest bucket): replay -> logits [B, V]."""
        rows = meta.num_tokens
        if meta.num_decode != meta.num_seqs or rows != meta.num_seqs:
            raise ValueError(f"decode graphs run decode-only steps, got {meta.num_decode} decode rows "
                             f"of {meta.num_seqs} sequences")
        n = self.bucket_for(rows)
        if n is None or n not in self._buckets:
            raise ValueError(f"no captured decode graph holds {rows} rows (sizes {list(self.sizes)})")
        b = self._buckets[n]
        cols = meta.block_tables.shape[1]
        if cols > self.block_tables.shape[1]:
            raise ValueError(f"block table of {cols} blocks exceeds the graphs' {self.block_tables.shape[1]}")
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:rows].copy_(meta.seq_lens)
        self.block_tables[:rows, :cols].copy_(meta.block_tables)
        if n > rows:  # padding rows: one key each, in the pad block
            self.input_ids[rows:n].zero_()
            self.positions[rows:n].zero_()
            self.slot_mapping[rows:n].fill_(self.pad_slot)
            self.seq_lens[rows:n].fill_(1)
            self.block_tables[rows:n, 0].fill_(self.pad_block)
        b.meta.seq_lens_host[:] = list(meta.seq_lens_host) + [1] * (n - rows)
        self._update(b)
        self.graph_device.replay(b.graph)
        self.num_replays += 1
        return b.logits[:rows]
