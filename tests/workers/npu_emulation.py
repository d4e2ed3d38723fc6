"""A plain-torch emulation of the torch_npu ops raylm's NPU table calls, for CPU tests.

Each op follows the documented semantics of torch_npu / CANN (argument names, layouts,
dtypes, the compressed causal mask of sparse_mode 3, TND's cumulative actual_seq_lengths)
and refuses what the real op refuses, so layout, mask and argument mistakes in
workers/ops/npu.py fail here instead of on an Ascend machine. It is not torch_npu: it
knows nothing of NZ formats, quantization or the many arguments raylm never passes (a
non-default one raises).

ACL graph tasks are emulated too: a `_npu_paged_attention` captured inside
graph_task_group_begin/end keeps the host arguments (context_lens) it was captured with,
as the real task does; graph_task_update_begin/end replaces them; a replay uses them,
whatever the re-run Python passes. So a missing or wrong task update shows up as a wrong
result. `install` puts the fake in sys.modules["torch_npu"] and at torch.npu.
"""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass, field

import torch

MASK_SIZE = 2048  # sparse_mode 2/3/4 take the causal mask compressed to 2048 x 2048
HALF = (torch.float16, torch.bfloat16)


class EmulationError(RuntimeError):
    """What the real op would reject (it raises an ACL error there)."""


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise EmulationError(message)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int) -> torch.Tensor:
    """q [n, N, D], k/v [kv, KVH, D]: query i sees keys j <= q_offset + i. fp32 math -> [n, N, D]."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [kv, N, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [N, n, kv]
    allowed = torch.arange(k.shape[0])[None, :] <= (q_offset + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vf)


def _gather_blocks(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, ...] -> its first `length` slots along table_row."""
    bs = cache.shape[1]
    n = (length + bs - 1) // bs
    return cache.index_select(0, table_row[:n].long()).flatten(0, 1)[:length]


@dataclass
class TaskHandle:
    """A captured ACL graph task group holding one _npu_paged_attention."""
    static: dict  # the device tensors captured (by data_ptr): a replay must see the same ones
    context_lens: torch.Tensor  # the host argument baked into the task
    updates: int = 0


@dataclass
class EmulatedNpu:
    """The fake's state: which ops ran, and the graph being captured or replayed."""
    calls: list[str] = field(default_factory=list)
    mode: str = "eager"  # eager | capture | replay
    group_open: bool = False
    pending: list = field(default_factory=list)  # tasks recorded in the open group
    captured: list[TaskHandle] | None = None  # the capture target's task list
    replay_tasks: list[TaskHandle] = field(default_factory=list)
    replay_cursor: int = 0
    updating: TaskHandle | None = None
    external_event_records: int = 0

    # -- hooks the fake graph device calls --
    def begin_capture(self, tasks: list) -> None:
        self.mode, self.captured = "capture", tasks

    def end_capture(self) -> None:
        _need(not self.group_open, "graph capture ended inside an open task group")
        self.mode, self.captured = "eager", None

    def begin_replay(self, tasks: list) -> None:
        self.mode, self.replay_tasks, self.replay_cursor = "replay", tasks, 0

    def end_replay(self) -> None:
        _need(self.replay_cursor == len(self.replay_tasks),
              f"replay ran {self.replay_cursor} of {len(self.replay_tasks)} captured paged-attention tasks")
        self.mode = "eager"


def _ptrs(**tensors) -> dict:
    return {k: t.data_ptr() for k, t in tensors.items()}


def build(emu: EmulatedNpu, without: tuple[str, ...] = ()) -> tuple[types.ModuleType, types.ModuleType]:
    """The fake torch_npu module and its torch.npu submodule, recording into `emu`."""
    npu_mod = types.ModuleType("torch_npu")
    tnpu = types.ModuleType("torch.npu")

    def op(fn):
        def wrapped(*args, **kwargs):
            emu.calls.append(fn.__name__)
            return fn(*args, **kwargs)
        wrapped.__name__ = fn.__name__
        if fn.__name__ not in without:
            setattr(npu_mod, fn.__name__, wrapped)
        return wrapped

    def check_cache_write(key, value, key_cache, value_cache, slots, name):
        _need(key.dim() == 3 and key_cache.dim() == 4, f"{name}: key [T, KVH, D] and key_cache "
              f"[num_blocks, block_size, KVH, D] expected, got {tuple(key.shape)} and {tuple(key_cache.shape)}")
        _need(key.shape == value.shape and key_cache.shape == value_cache.shape, f"{name}: key/value shapes differ")
        _need(key.shape[1:] == key_cache.shape[2:], f"{name}: key heads/dim {tuple(key.shape[1:])} "
              f"do not match the cache's {tuple(key_cache.shape[2:])}")
        _need(key.is_contiguous() and value.is_contiguous(), f"{name}: key and value must be contiguous")
        _need(key.dtype == key_cache.dtype, f"{name}: key dtype {key.dtype} differs from the cache's {key_cache.dtype}")
        _need(slots.dtype == torch.int32 and slots.shape == (key.shape[0],),
              f"{name}: slot mapping must be int32 [T], got {slots.dtype} {tuple(slots.shape)}")
        total = key_cache.shape[0] * key_cache.shape[1]
        _need(bool(((slots >= 0) & (slots < total)).all()), f"{name}: slot out of range [0, {total})")
        kvh, d = key.shape[1:]
        key_cache.view(total, kvh, d).index_copy_(0, slots.long(), key)
        value_cache.view(total, kvh, d).index_copy_(0, slots.long(), value)

    @op
    def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, cache_mode="Norm", **rest):
        _need(cache_mode == "Norm", f"npu_scatter_pa_kv_cache: only cache_mode 'Norm' is emulated, got {cache_mode!r}")
        _need(all(v is None for v in rest.values()), f"npu_scatter_pa_kv_cache: unemulated arguments {sorted(rest)}")
        check_cache_write(key, value, key_cache, value_cache, slot_mapping, "npu_scatter_pa_kv_cache")

    @op
    def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        check_cache_write(key, value, key_cache, value_cache, slot_indices, "_npu_reshape_and_cache")

    @op
    def npu_fused_infer_attention_score(query, key, value, *, atten_mask=None, actual_seq_lengths=None,
                                        actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                        pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                        num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                        softmax_lse_flag=False, **rest):
        name = "npu_fused_infer_attention_score"
        _need(all(v is None for v in rest.values()), f"{name}: unemulated arguments {sorted(rest)}")
        _need(input_layout == "TND" and block_table is not None,
              f"{name}: only paged TND is emulated, got layout {input_layout!r}, block_table {block_table is not None}")
        _need(query.dtype in HALF, f"{name}: query must be float16/bfloat16, got {query.dtype}")
        _need(query.is_contiguous(), f"{name}: query must be contiguous")
        t, n, d = query.shape
        _need(n == num_heads, f"{name}: num_heads {num_heads} but query has {n} heads")
        kvh = num_key_value_heads or num_heads
        _need(num_heads % kvh == 0, f"{name}: num_heads {num_heads} not a multiple of num_key_value_heads {kvh}")
        _need(key.dim() == 3 and key.shape == value.shape,
              f"{name}: paged key/value must be [num_blocks, block_size, KVH * D], got {tuple(key.shape)}")
        _need(key.shape[1] == block_size, f"{name}: block_size {block_size} but the cache has {key.shape[1]}")
        _need(block_size % 16 == 0 and 0 < block_size <= 512, f"{name}: block_size must be a multiple of 16 <= 512")
        _need(key.shape[2] == kvh * d, f"{name}: cache rows of {key.shape[2]} are not KVH * D = {kvh * d}")
        _need(key.dtype == query.dtype, f"{name}: cache dtype {key.dtype} differs from query {query.dtype}")
        _need(block_table.dtype == torch.int32 and block_table.dim() == 2,
              f"{name}: block_table must be int32 [B, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
        ends, kv_lens = list(actual_seq_lengths), list(actual_seq_lengths_kv)
        b = block_table.shape[0]
        _need(len(ends) == b and len(kv_lens) == b, f"{name}: {len(ends)} query ends and {len(kv_lens)} kv lengths "
              f"for a block table of {b} rows")
        _need(all(isinstance(x, int) for x in ends + kv_lens), f"{name}: actual lengths must be Python ints")
        _need(ends == sorted(ends) and ends[-1] == t,
              f"{name}: TND actual_seq_lengths are cumulative query ends ending at T={t}, got {ends}")
        _need(pre_tokens == 2147483647 and next_tokens in (0, 2147483647), f"{name}: sliding windows not emulated")
        _need(sparse_mode in (0, 3), f"{name}: sparse_mode {sparse_mode} not emulated")
        if sparse_mode == 3:
            _need(atten_mask is not None and tuple(atten_mask.shape) == (MASK_SIZE, MASK_SIZE),
                  f"{name}: sparse_mode 3 takes the compressed {MASK_SIZE}x{MASK_SIZE} mask")
            _need(atten_mask.dtype in (torch.int8, torch.uint8, torch.bool), f"{name}: mask must be int8/uint8/bool")
            _need(torch.equal(atten_mask.bool(), _upper()), f"{name}: the mask must be 1 strictly above the diagonal")
        else:
            _need(atten_mask is None, f"{name}: an explicit mask with sparse_mode 0 is not emulated")
        keys = key.view(key.shape[0], block_size, kvh, d)
        vals = value.view(value.shape[0], block_size, kvh, d)
        out = torch.empty_like(query)
        start = 0
        for i, (end, kv_len) in enumerate(zip(ends, kv_lens)):
            n_q = end - start
            _need(kv_len <= block_table.shape[1] * block_size, f"{name}: kv length {kv_len} beyond the block table")
            if n_q:
                _need(kv_len >= n_q, f"{name}: kv length {kv_len} shorter than its {n_q} queries")
                k = _gather_blocks(keys, block_table[i], kv_len)
                v = _gather_blocks(vals, block_table[i], kv_len)
                offset = kv_len - n_q if sparse_mode == 3 else kv_len  # 3: causal aligned bottom right
                out[start:end] = _attend(query[start:end], k, v, scale, offset).to(query.dtype)
            start = end
        return out, torch.empty(0)

    def paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                        context_lens, out):
        name = "_npu_paged_attention"
        _need(query.dim() == 3 and query.shape[1] == num_heads, f"{name}: query must be [B, num_heads, D]")
        _need(query.dtype in HALF, f"{name}: query must be float16/bfloat16, got {query.dtype}")
        _need(key_cache.dim() == 4 and key_cache.shape[2] == num_kv_heads and key_cache.shape[3] == query.shape[2],
              f"{name}: key_cache must be [num_blocks, block_size, num_kv_heads, D], got {tuple(key_cache.shape)}")
        bs = key_cache.shape[1]
        _need(bs % 16 == 0 and bs <= 128, f"{name}: block_size must be a multiple of 16 <= 128, got {bs}")
        _need(block_table.dtype == torch.int32 and block_table.shape[0] == query.shape[0],
              f"{name}: block_table must be int32 [B, max_blocks]")
        _need(isinstance(context_lens, torch.Tensor) and context_lens.dtype == torch.int32
              and context_lens.device.type == "cpu" and context_lens.shape == (query.shape[0],),
              f"{name}: context_lens must be a host int32 tensor [B], got {context_lens!r}")
        _need(out.shape == query.shape and out.dtype == query.dtype, f"{name}: out must match the query")
        for i, n in enumerate(context_lens.tolist()):
            _need(0 < n <= block_table.shape[1] * bs, f"{name}: context length {n} beyond the block table")
            k = _gather_blocks(key_cache, block_table[i], n)
            v = _gather_blocks(value_cache, block_table[i], n)
            out[i:i + 1] = _attend(query[i:i + 1], k, v, scale_value, n - 1).to(out.dtype)

    @op
    def _npu_paged_attention(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                             context_lens, out, workspace=None):
        static = _ptrs(key_cache=key_cache, value_cache=value_cache, block_table=block_table)
        if emu.updating is not None:  # patch the captured task's host arguments; nothing runs
            _need(emu.updating.static == static, "graph task update passed other device tensors than captured")
            emu.updating.context_lens = context_lens.clone()
            emu.updating.updates += 1
            return
        if emu.mode == "replay":
            _need(emu.replay_cursor < len(emu.replay_tasks), "replay ran more paged-attention tasks than captured")
            task = emu.replay_tasks[emu.replay_cursor]
            emu.replay_cursor += 1
            _need(task.static == static, "replay reads other caches / block table than were captured")
            context_lens = task.context_lens  # the task's baked-in host argument, not what Python passes now
        elif emu.mode == "capture":
            _need(emu.group_open, "_npu_paged_attention captured outside graph_task_group_begin/end: "
                  "its context lengths could never be updated")
            _need(workspace is not None, "_npu_paged_attention needs a workspace in graph capture")
            emu.pending.append(TaskHandle(static=static, context_lens=context_lens.clone()))
        paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                        context_lens, out)

    @op
    def _npu_paged_attention_get_workspace(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                                           block_table, context_lens, out):
        return torch.empty(1024, dtype=torch.uint8)

    @op
    def npu_rms_norm(x, gamma, epsilon=1e-6):
        _need(gamma.shape == x.shape[-1:], f"npu_rms_norm: gamma {tuple(gamma.shape)} vs x {tuple(x.shape)}")
        return _rms(x, gamma, epsilon)

    @op
    def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
        _need(x1.shape == x2.shape and x1.dtype == x2.dtype, "npu_add_rms_norm: x1 and x2 must match")
        s = x1 + x2
        _need(gamma.shape == s.shape[-1:], f"npu_add_rms_norm: gamma {tuple(gamma.shape)} vs x {tuple(s.shape)}")
        y, rstd = _rms(s, gamma, epsilon)
        return y, rstd, s

    @op
    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
        _need(rotary_mode == "half", f"npu_rotary_mul: only rotary_mode 'half' is emulated, got {rotary_mode!r}")
        _need(input.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape,
              f"npu_rotary_mul: 4-D input and cos/sin expected, got {tuple(input.shape)}, {tuple(r1.shape)}")
        _need(r1.shape[-1] == input.shape[-1], "npu_rotary_mul: cos/sin must span the head dim")
        torch.broadcast_shapes(input.shape, r1.shape)  # raises like the op if they do not broadcast
        half = input.shape[-1] // 2
        rotated = torch.cat((-input[..., half:], input[..., :half]), dim=-1)
        return (input.float() * r1.float() + rotated.float() * r2.float()).to(input.dtype)

    @op
    def npu_swiglu(x, dim=-1):
        a, b = x.chunk(2, dim=dim)
        return (torch.nn.functional.silu(a.float()) * b.float()).to(x.dtype)

    # -- torch.npu: streams, events, graph task groups, memory --
    class Stream:
        def synchronize(self):
            pass

        def wait_stream(self, other):
            pass

    current = Stream()

    class _StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            return self.stream

        def __exit__(self, *exc):
            return False

    class ExternalEvent:
        def wait(self, stream):
            pass

        def reset(self, stream):
            pass

        def record(self, stream):
            emu.external_event_records += 1

    def graph_task_group_begin(stream):
        _need(emu.mode == "capture", "graph_task_group_begin outside a graph capture")
        _need(not emu.group_open, "task groups do not nest")
        emu.group_open, emu.pending = True, []

    def graph_task_group_end(stream):
        _need(emu.group_open, "graph_task_group_end without a begin")
        _need(len(emu.pending) == 1, f"a task group must hold one paged-attention task, got {len(emu.pending)}")
        emu.group_open = False
        handle = emu.pending.pop()
        emu.captured.append(handle)
        return handle

    def graph_task_update_begin(stream, handle):
        _need(emu.mode == "eager" and emu.updating is None, "graph_task_update_begin during capture/replay")
        _need(isinstance(handle, TaskHandle), "graph_task_update_begin takes a handle from graph_task_group_end")
        emu.updating = handle

    def graph_task_update_end(stream):
        _need(emu.updating is not None, "graph_task_update_end without a begin")
        emu.updating = None

    for name, value in dict(
        Stream=Stream, ExternalEvent=ExternalEvent, stream=_StreamContext, current_stream=lambda: current,
        synchronize=lambda *a: None, is_available=lambda: True, device_count=lambda: 1,
        memory_allocated=lambda *a: 0, mem_get_info=lambda *a: (1 << 34, 1 << 35),
        graph_task_group_begin=graph_task_group_begin, graph_task_group_end=graph_task_group_end,
        graph_task_update_begin=graph_task_update_begin, graph_task_update_end=graph_task_update_end,
    ).items():
        setattr(tnpu, name, value)
    npu_mod.npu = tnpu
    return npu_mod, tnpu


@functools.cache
def _upper() -> torch.Tensor:
    return torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1)


def _rms(x, gamma, eps):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def install(monkeypatch, without: tuple[str, ...] = ()) -> EmulatedNpu:
    """Install the fake as `torch_npu` and `torch.npu` for one test; returns its state."""
    emu = EmulatedNpu()
    npu_mod, tnpu = build(emu, without)
    monkeypatch.setitem(sys.modules, "torch_npu", npu_mod)
    monkeypatch.setattr(torch, "npu", tnpu, raising=False)
    return emu
