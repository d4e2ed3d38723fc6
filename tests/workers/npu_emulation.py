"""A plain-torch emulation of the torch_npu ops raylm's NPU table calls, for CPU tests.

Each op follows the documented semantics of torch_npu / CANN (argument names, layouts,
dtypes, the compressed causal mask of sparse_mode 3, TND's cumulative actual_seq_lengths,
the MoE routing's index conventions) and refuses what the real op refuses, so layout,
mask and argument mistakes in workers/ops/npu.py fail here instead of on an Ascend
machine. It is not torch_npu: it knows nothing of NZ formats or the many arguments raylm never
passes (a non-default one raises).

The quantized-linear ops follow their documented arithmetic (torch_npu's API pages and op-plugin's
golden tests): npu_dynamic_quant's per-row scale max |x| / 127 and round(x / scale) in fp32;
npu_quantize (div_mode=False) round(x * scales + zero_points) in fp32, round half to even, then
clamped to int8; npu_quant_matmul's exact int32 sums, + an int32 bias, then x the scale (an int64
one from npu_trans_quant_param read back as its fp32 bits, which that op truncates to the high 19
as the hardware does) and the per-token scale in fp32, cast to output_dtype last, and npu_grouped_matmul's
int8 case likewise per group (its per-channel scale fp32 for float16 outputs, bfloat16 for bfloat16 ones);
npu_convert_weight_to_int4pack's 8 int4 per int32, element 8i + j in bits 4j..4j+3;
npu_weight_quant_batchmatmul's (weight + antiquant_offset) * antiquant_scale per group, the weight
so dequantized rounded to x's dtype, fp32 sums. Where the documented dtype combinations differ
between torch_npu releases, the stricter is enforced (npu_quantize's scales in the input's dtype;
a float16 npu_quant_matmul without per-token scales takes only the int64 scale; a bfloat16 output of
npu_grouped_matmul's int8 x only a bfloat16 scale, as the A2/A3 tables say, where 910_95's take fp32 too).

What a real op leaves undefined the emulation fills with NaN (init_routing_v2's rows past
the pairs it kept, npu_grouped_matmul's rows past its groups), so a table that reads them
gets a NaN answer here, not a lucky zero.

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
FLOATS = (*HALF, torch.float32)


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

    # -- MoE: gating, routing, grouped matmul, combine (the unquantized, dropless path) --
    @op
    def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
        """Softmax over the last dim, then its top k (no renormalization). -> (y in x.dtype, expert_idx int32,
        row_idx int32 with row_idx[t, j] = j * rows + t: the k-major source row numbering of the v1 routing)."""
        name = "npu_moe_gating_top_k_softmax"
        _need(finished is None, f"{name}: `finished` is not emulated")
        _need(x.dim() in (2, 3), f"{name}: x must be 2-D or 3-D, got {tuple(x.shape)}")
        _need(x.dtype in FLOATS, f"{name}: x must be float16/bfloat16/float32, got {x.dtype}")
        _need(isinstance(k, int) and 0 < k <= min(x.shape[-1], 1024), f"{name}: k must be in (0, min(E, 1024)], "
              f"got {k!r} for {x.shape[-1]} experts")
        y, expert_idx = x.float().softmax(dim=-1).topk(k, dim=-1)
        rows = x.shape[:-1].numel()
        row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().reshape(expert_idx.shape)
        return y.to(x.dtype), expert_idx.to(torch.int32), row_idx

    @op
    def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                                expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                                quant_mode=0, active_expert_range=(), row_idx_type=0):
        """Sort the (token, choice) pairs by expert and gather their rows; only the pairs whose expert lies in
        active_expert_range [start, end) are kept, first, in expert order (available = their number).
        -> (expanded_x [N*K, H]: rows past `available` undefined (NaN here);
            expanded_row_idx [N*K] int32: row_idx_type 0 (gather) = the expanded row of source pair t*K + j,
                -1 for a pair outside the range; 1 (scatter) = the source pair of expanded row i, undefined past
                `available`;
            expert_token_cumsum_or_count [end - start] int64 (type 0 cumsum, 1 count) over the active experts;
            expanded_scale [N*K] float32: undefined without a scale (NaN here))."""
        name = "npu_moe_init_routing_v2"
        _need(quant_mode == -1, f"{name}: only quant_mode -1 (no quantization) is emulated; the default 0 "
              f"(static quantization) is not supported by the op, got {quant_mode!r}")
        _need(scale is None and offset is None, f"{name}: scale/offset are not emulated")
        _need(drop_pad_mode == 0 and expert_capacity == -1, f"{name}: only the dropless mode (drop_pad_mode 0, "
              f"no expert_capacity) is emulated, got {drop_pad_mode!r}, {expert_capacity!r}")
        _need(expert_tokens_num_flag is True, f"{name}: the op supports only expert_tokens_num_flag=True")
        _need(expert_tokens_num_type in (0, 1), f"{name}: expert_tokens_num_type 0 (cumsum) / 1 (count) are "
              f"emulated, got {expert_tokens_num_type!r}")
        _need(row_idx_type in (0, 1), f"{name}: row_idx_type must be 0 (gather) or 1 (scatter), got {row_idx_type!r}")
        _need(x.dim() == 2 and x.dtype in FLOATS, f"{name}: x must be a 2-D float16/bfloat16/float32 [N, H] "
              f"tensor, got {x.dtype} {tuple(x.shape)}")
        _need(expert_idx.dim() == 2 and expert_idx.dtype == torch.int32 and expert_idx.shape[0] == x.shape[0],
              f"{name}: expert_idx must be int32 [N, K] with x's N, got {expert_idx.dtype} {tuple(expert_idx.shape)}")
        n, k = expert_idx.shape
        _need(active_num == n * k, f"{name}: active_num must be N * K = {n * k}, got {active_num!r}")
        _need(isinstance(expert_num, int) and 0 < expert_num <= 10240,
              f"{name}: expert_num must be in (0, 10240], got {expert_num!r}")
        _need(len(active_expert_range) in (0, 2) and all(isinstance(v, int) for v in active_expert_range),
              f"{name}: active_expert_range must be two ints [start, end), got {active_expert_range!r}")
        start, end = active_expert_range or (0, expert_num)
        _need(0 <= start < end <= expert_num,
              f"{name}: active_expert_range must be [start, end) within [0, {expert_num}], got {active_expert_range!r}")
        flat = expert_idx.reshape(-1).long()
        _need(bool(((flat >= -1) & (flat < expert_num)).all()), f"{name}: expert ids must be < expert_num")
        active = (flat >= start) & (flat < end)
        src = torch.sort(torch.where(active, flat, expert_num), stable=True).indices[: int(active.sum())]
        available = src.numel()
        expanded_x = torch.full((n * k, x.shape[1]), float("nan"), dtype=x.dtype)
        expanded_x[:available] = x[src // k]
        if row_idx_type == 0:
            expanded_row_idx = torch.full((n * k,), -1, dtype=torch.int32)
            expanded_row_idx[src] = torch.arange(available, dtype=torch.int32)
        else:
            expanded_row_idx = torch.full((n * k,), torch.iinfo(torch.int32).min, dtype=torch.int32)
            expanded_row_idx[:available] = src.to(torch.int32)
        counts = torch.bincount(flat[active] - start, minlength=end - start)
        tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
        return expanded_x, expanded_row_idx, tokens.to(torch.int64), torch.full((n * k,), float("nan"))

    gmm_unemulated = ("bias", "offset", "antiquant_scale", "antiquant_offset", "activation_input",
                      "activation_quant_scale", "activation_quant_offset", "tuning_config")
    # int8 x and weight with per-channel (and per-token) scales, A2/A3: the scale dtype each output dtype takes
    gmm_int8_scale = {torch.float16: torch.float32, torch.bfloat16: torch.bfloat16}

    @op
    def npu_grouped_matmul(x, weight, *, scale=None, per_token_scale=None, group_list=None, split_item=0,
                           group_type=None, group_list_type=0, act_type=0, output_dtype=None, **rest):
        """y_g = x_g @ weight_g for consecutive row groups of one x over one [E, K, N] weight (the single-tensor,
        m-axis grouped case), -> [y [M, N]]. Rows past the groups' total are not written (NaN here).
        Float x and weight: fp32 sums, in x's dtype. Int8 x and weight (W8A8): the exact int32 sums x scale[g]
        (one per output channel, [E, N]) [x per_token_scale, one per row, [M]] in fp32, cast to output_dtype:
        float16 with fp32 scales, bfloat16 with bfloat16 ones (the A2/A3 combinations)."""
        name = "npu_grouped_matmul"
        unknown = set(rest) - set(gmm_unemulated)
        _need(not unknown, f"{name}: unexpected arguments {sorted(unknown)}")
        _need(all(v is None for v in rest.values()), f"{name}: unemulated arguments {sorted(rest)}")
        _need(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)) and len(x) == len(weight) == 1,
              f"{name}: x and weight are lists; only one x over one 3-D weight is emulated")
        _need(group_type == 0 and split_item in (2, 3), f"{name}: only m-axis grouping (group_type 0) into one "
              f"output (split_item 2/3) is emulated, got group_type {group_type!r}, split_item {split_item!r}")
        _need(act_type == 0, f"{name}: fused activations (act_type {act_type}) are not emulated")
        (a,), (w,) = x, weight
        _need(a.dim() == 2 and w.dim() == 3, f"{name}: x [M, K] and weight [E, K, N] expected, got "
              f"{tuple(a.shape)} and {tuple(w.shape)}")
        _need(a.is_contiguous(), f"{name}: x may not be transposed")
        quantized = torch.int8 in (a.dtype, w.dtype)
        if quantized:
            _need(a.dtype == w.dtype, f"{name}: int8 x takes an int8 weight and an int8 weight an int8 x (a float "
                  f"x over int8 weights is the antiquant case, not emulated), got {a.dtype} and {w.dtype}")
            _need(output_dtype in gmm_int8_scale, f"{name}: only float16/bfloat16 output of int8 x is emulated (None "
                  f"is int8 output, with an int64 scale), got {output_dtype}")
        else:
            _need(a.dtype == w.dtype and a.dtype in FLOATS, f"{name}: x and weight must share a "
                  f"float16/bfloat16/float32 dtype, got {a.dtype} and {w.dtype}")
            _need(output_dtype in (None, a.dtype), f"{name}: output_dtype {output_dtype} differs from x's {a.dtype}")
            _need(scale is None and per_token_scale is None, f"{name}: scale / per_token_scale dequantize int8 x; "
                  f"with {a.dtype} x they are not emulated")
        _need(a.shape[1] == w.shape[1], f"{name}: x's K {a.shape[1]} differs from the weight's {w.shape[1]} "
              f"(the weight is [E, in, out])")
        _need(max(w.shape[1], w.shape[2]) < 65536, f"{name}: inner dims must be < 65536")
        groups, n = w.shape[0], w.shape[2]
        if quantized:
            want = gmm_int8_scale[output_dtype]
            _need(isinstance(scale, (list, tuple)) and len(scale) == 1 and isinstance(scale[0], torch.Tensor),
                  f"{name}: int8 x with {output_dtype} output needs scale, a list of one tensor as weight is, got "
                  f"{type(scale).__name__}")
            s = scale[0]
            _need(tuple(s.shape) == (groups, n), f"{name}: scale must be [E, N] = [{groups}, {n}] (per output "
                  f"channel of each group), got {tuple(s.shape)}")
            _need(s.dtype == want, f"{name}: int8 x with {output_dtype} output takes a {want} scale, got {s.dtype}")
            pts = None
            if per_token_scale is not None:
                _need(isinstance(per_token_scale, (list, tuple)) and len(per_token_scale) == 1,
                      f"{name}: per_token_scale is a list of one tensor as x is")
                pts = per_token_scale[0]
                _need(pts.dtype == torch.float32 and tuple(pts.shape) == (a.shape[0],),
                      f"{name}: per_token_scale must be fp32 [M={a.shape[0]}], got {pts.dtype} {tuple(pts.shape)}")
        _need(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64
              and group_list.shape == (groups,), f"{name}: group_list must be an int64 tensor [E={groups}], got "
              f"{getattr(group_list, 'dtype', type(group_list))} {tuple(getattr(group_list, 'shape', ()))}")
        _need(groups <= 1024, f"{name}: at most 1024 groups, got {groups}")
        _need(group_list_type in (0, 1), f"{name}: group_list_type 0 (cumsum) / 1 (count) are emulated, "
              f"got {group_list_type!r}")
        _need(bool((group_list >= 0).all()), f"{name}: group_list must be non-negative")
        if group_list_type == 1:
            _need(groups > 1, f"{name}: a count group_list (group_list_type 1) may not have length 1")
            ends = group_list.cumsum(0)
        else:
            ends = group_list
            _need(bool((ends[1:] >= ends[:-1]).all()), f"{name}: a cumsum group_list must be non-decreasing")
        ends = ends.tolist()
        _need(ends[-1] <= a.shape[0], f"{name}: the groups hold {ends[-1]} rows, x only {a.shape[0]}")
        y = torch.full((a.shape[0], n), float("nan"), dtype=output_dtype if quantized else a.dtype)
        start = 0
        for g, end in enumerate(ends):
            if quantized:
                acc = a[start:end].to(torch.int64) @ w[g].to(torch.int64)
                _need(bool((acc.abs() < 2 ** 31).all()), f"{name}: int32 sums overflow")
                v = acc.float() * s[g].float()
                y[start:end] = (v if pts is None else v * pts[start:end, None]).to(output_dtype)
            else:
                y[start:end] = (a[start:end].float() @ w[g].float()).to(a.dtype)
            start = end
        return [y]

    @op
    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        """out[t] = sum_j probs[t, j] * permuted_tokens[sorted_indices[t * K + j]] (a gather: sorted_indices is
        init_routing_v2's gather-type expanded_row_idx), fp32 sums -> [T, H] in permuted_tokens' dtype."""
        name = "npu_moe_token_unpermute"
        _need(not padded_mode and restore_shape is None, f"{name}: padded_mode / restore_shape are not emulated")
        _need(permuted_tokens.dim() == 2 and permuted_tokens.dtype in FLOATS,
              f"{name}: permuted_tokens must be 2-D float16/bfloat16/float32")
        _need(sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32,
              f"{name}: sorted_indices must be int32 1-D, got {sorted_indices.dtype} {tuple(sorted_indices.shape)}")
        n = sorted_indices.numel()
        _need(permuted_tokens.shape[0] == n, f"{name}: permuted_tokens must be [T * K = {n}, H], "
              f"got {tuple(permuted_tokens.shape)}")
        if probs is None:
            probs = torch.ones(n, 1, dtype=permuted_tokens.dtype)
        _need(probs.dim() == 2 and probs.numel() == n, f"{name}: probs must be [T, K] with T * K = {n}, "
              f"got {tuple(probs.shape)}")
        _need(probs.dtype == permuted_tokens.dtype, f"{name}: probs dtype {probs.dtype} differs from "
              f"permuted_tokens' {permuted_tokens.dtype}")
        _need(probs.shape[1] <= 512, f"{name}: top k must be <= 512, got {probs.shape[1]}")
        _need(bool(((sorted_indices >= 0) & (sorted_indices < n)).all()),
              f"{name}: sorted_indices must lie in [0, {n}); a -1 (a pair outside init_routing_v2's "
              f"active_expert_range) is not skipped by the A2/A3 kernel")
        rows = permuted_tokens.float()[sorted_indices.long()].view(*probs.shape, -1)
        return (rows * probs.float()[..., None]).sum(dim=1).to(permuted_tokens.dtype)

    # -- quantized linears: W8A8 (dynamic / static) and W4A16 --
    @op
    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
        """Symmetric per-token int8: scale = max |x| / 127 per row (fp32, x's shape without the last dim),
        y = round(x / scale) in fp32."""
        name = "npu_dynamic_quant"
        _need(smooth_scales is None and group_index is None, f"{name}: smooth_scales / group_index are not emulated")
        _need(dst_type in (None, torch.int8), f"{name}: only int8 output is emulated, got {dst_type}")
        _need(x.dtype in HALF, f"{name}: x must be float16/bfloat16, got {x.dtype}")
        _need(x.dim() > 1, f"{name}: x must have more than one dimension, got {tuple(x.shape)}")
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True) / 127
        y = torch.where(scale > 0, torch.round(xf / scale), 0.0).clamp(-128, 127)
        return y.to(torch.int8), scale.squeeze(-1)

    @op
    def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
        """div_mode=False (multiply): round(input * scales + zero_points) in fp32, half to even, clamped to int8."""
        name = "npu_quantize"
        _need(div_mode is False, f"{name}: only div_mode=False (scales multiply) is emulated")
        _need(dtype == torch.qint8, f"{name}: only torch.qint8 output is emulated, got {dtype}")
        _need(isinstance(axis, int) and axis > -2, f"{name}: only the last axis (axis > -2) is emulated, got {axis!r}")
        _need(input.dtype in FLOATS, f"{name}: input must be float16/bfloat16/float32, got {input.dtype}")
        _need(scales.dtype == input.dtype, f"{name}: with div_mode=False scales must have input's dtype "
              f"{input.dtype}, got {scales.dtype}")
        width = input.shape[-1]
        _need(scales.dim() == 1 and scales.shape[0] in (1, width),
              f"{name}: scales must be 1-D of the last dim ({width}) or 1, got {tuple(scales.shape)}")
        _need(zero_points is None or (zero_points.shape == scales.shape and zero_points.dtype == scales.dtype),
              f"{name}: zero_points must match scales' shape and dtype")
        y = input.float() * scales.float() + (0.0 if zero_points is None else zero_points.float())
        return torch.round(y).clamp(-128, 127).to(torch.int8)

    @op
    def npu_trans_quant_param(scale, offset=None):
        """fp32 scale -> int64: its bits' high 19 kept (& 0xFFFFE000) in the low word, bit 46 set."""
        name = "npu_trans_quant_param"
        _need(offset is None, f"{name}: offset is not emulated")
        _need(scale.dtype == torch.float32 and scale.dim() in (1, 2), f"{name}: scale must be fp32 (t,) or (1, n), "
              f"got {scale.dtype} {tuple(scale.shape)}")
        bits = scale.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return (bits & 0xFFFFE000) | (1 << 46)

    @op
    def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, **rest):
        """(x1 @ x2 exact in int32 [+ int32 bias]) * scale [* pertoken_scale per row] in fp32 [+ a float bias],
        cast to output_dtype. x1 int8 [m, k], x2 int8 [k, n]."""
        name = "npu_quant_matmul"
        _need(all(v is None for v in rest.values()), f"{name}: unemulated arguments {sorted(rest)}")
        _need(offset is None, f"{name}: offset (int8 output) is not emulated")
        _need(output_dtype in HALF, f"{name}: only float16/bfloat16 output is emulated, got {output_dtype}")
        _need(x1.dtype == torch.int8 and x2.dtype == torch.int8,
              f"{name}: x1 and x2 must be int8 (int32 int4 is not emulated), got {x1.dtype}, {x2.dtype}")
        _need(x1.dim() == 2 and x2.dim() == 2, f"{name}: only 2-D x1 [m, k] and x2 [k, n] are emulated")
        (m, k), n = x1.shape, x2.shape[1]
        _need(x2.shape[0] == k, f"{name}: x1 is [m, {k}] but x2 [{x2.shape[0]}, n] (x2 is [k, n])")
        _need(scale.dim() == 1 and scale.shape[0] in (1, n), f"{name}: scale must be 1-D of n ({n}) or 1, "
              f"got {tuple(scale.shape)}")
        _need(pertoken_scale is None or (pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (m,)),
              f"{name}: pertoken_scale must be fp32 [m={m}]")
        _need(bias is None or (bias.dim() == 1 and bias.shape[0] == n), f"{name}: bias must be [n={n}]")
        if output_dtype == torch.bfloat16:
            scales, biases = (torch.float32, torch.bfloat16), (torch.int32, torch.bfloat16, torch.float32)
        elif pertoken_scale is not None:
            scales, biases = (torch.float32,), (torch.int32, torch.float16, torch.float32)
        else:  # float16 out without per-token scales: the scale from npu_trans_quant_param
            scales, biases = (torch.int64,), (torch.int32,)
        _need(scale.dtype in scales, f"{name}: output {output_dtype} with pertoken_scale "
              f"{'set' if pertoken_scale is not None else 'None'} takes scale {scales}, got {scale.dtype}")
        _need(bias is None or bias.dtype in biases, f"{name}: bias {bias.dtype if bias is not None else None} "
              f"not one of {biases} for output {output_dtype}")
        acc = x1.to(torch.int64) @ x2.to(torch.int64)
        _need(bool((acc.abs() < 2 ** 31).all()), f"{name}: int32 sums overflow")
        if bias is not None and bias.dtype == torch.int32:
            acc = acc + bias
        s = (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32) if scale.dtype == torch.int64 else scale.float()
        y = acc.float() * s
        if pertoken_scale is not None:
            y = y * pertoken_scale[:, None]
        if bias is not None and bias.dtype != torch.int32:
            y = y + bias.float()
        return y.to(output_dtype)

    @op
    def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
        """int32 [rows, cols] of int4 values -> int32 [rows, cols / 8]: element 8i + j in bits 4j..4j+3."""
        name = "npu_convert_weight_to_int4pack"
        _need(inner_k_tiles == 0, f"{name}: inner_k_tiles is reserved (0)")
        _need(weight.dtype == torch.int32 and weight.dim() == 2 and weight.is_contiguous(),
              f"{name}: weight must be a contiguous 2-D int32 tensor, got {weight.dtype} {tuple(weight.shape)}")
        rows, cols = weight.shape
        _need(cols % 8 == 0, f"{name}: the last dim must be a multiple of 8, got {cols}")
        _need(bool(((weight >= -8) & (weight <= 7)).all()), f"{name}: values must be int4, in [-8, 7]")
        nibbles = (weight.to(torch.int64) & 0xF).view(rows, cols // 8, 8) << (4 * torch.arange(8))
        packed = nibbles.sum(dim=-1)
        return (packed - (packed >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32)

    @op
    def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                     quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
        """x [m, k] @ ((weight + antiquant_offset) * antiquant_scale), per group of antiquant_group_size inputs
        (0: per channel), the weight int4 packed in int32 [k, n / 8] (or int8 [k, n])."""
        name = "npu_weight_quant_batchmatmul"
        _need(quant_scale is None and quant_offset is None and bias is None,
              f"{name}: quant_scale / quant_offset / bias are not emulated")
        _need(inner_precise in (0, 1), f"{name}: inner_precise must be 0 or 1")
        _need(x.dtype in HALF and x.dim() == 2, f"{name}: x must be 2-D float16/bfloat16, got {x.dtype} "
              f"{tuple(x.shape)}")
        _need(weight.dim() == 2 and weight.is_contiguous() and weight.dtype in (torch.int32, torch.int8),
              f"{name}: only a contiguous [k, n] int8 / int4-in-int32 [k, n / 8] weight is emulated")
        k = x.shape[1]
        _need(weight.shape[0] == k, f"{name}: the k of x ({k}) and weight ({weight.shape[0]}) differ")
        g = antiquant_group_size
        _need(g == 0 or (g % 32 == 0 and 32 <= g <= k - 1), f"{name}: antiquant_group_size must be 0 or a "
              f"multiple of 32 in [32, k - 1 = {k - 1}], got {g}")
        if weight.dtype == torch.int32:
            shifts = 4 * torch.arange(8)
            nib = ((weight.to(torch.int64)[..., None] >> shifts) & 0xF).view(k, -1)
            q = torch.where(nib >= 8, nib - 16, nib)
        else:
            q = weight.to(torch.int64)
        n = q.shape[1]
        groups = -(-k // g) if g else 1
        _need(antiquant_scale.dtype == x.dtype, f"{name}: antiquant_scale must have x's dtype {x.dtype}, "
              f"got {antiquant_scale.dtype}")
        _need(tuple(antiquant_scale.shape) == (groups, n) or (not g and tuple(antiquant_scale.shape) == (n,)),
              f"{name}: antiquant_scale must be [{groups}, {n}], got {tuple(antiquant_scale.shape)}")
        _need(antiquant_offset is None or (antiquant_offset.shape == antiquant_scale.shape
                                           and antiquant_offset.dtype == antiquant_scale.dtype),
              f"{name}: antiquant_offset must match antiquant_scale's shape and dtype")
        rows = torch.arange(k) // g if g else torch.zeros(k, dtype=torch.int64)
        scale = antiquant_scale.view(groups, n).float()[rows]
        off = 0.0 if antiquant_offset is None else antiquant_offset.view(groups, n).float()[rows]
        w = ((q.float() + off) * scale).to(x.dtype)
        return (x.float() @ w.float()).to(x.dtype)

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
