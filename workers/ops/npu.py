"""The Ascend NPU op table: torch_npu's fused kernels, as vllm-ascend calls them.

- K/V writes: `npu_scatter_pa_kv_cache` (older torch_npu: `_npu_reshape_and_cache`), with
  an int32 slot mapping, into the cache's [num_blocks, block_size, KVH, D] layer tensors.
- Attention of an eager step (decode rows and prefill chunks mixed):
  `npu_fused_infer_attention_score` in "TND" layout over the paged cache viewed as
  [num_blocks, block_size, KVH * D], an int32 block table, `actual_seq_lengths` = the
  cumulative query ends, `actual_seq_lengths_kv` = each sequence's keys, sparse_mode 3
  (causal aligned bottom right: cached keys before new ones) with the compressed
  2048 x 2048 int8 upper-triangular mask.
- Attention of a captured decode graph: `_npu_paged_attention`, one task group per layer,
  whose host context lengths are patched before each replay (`update_graph`).
- RMSNorm `npu_rms_norm` / `npu_add_rms_norm`, RoPE `npu_rotary_mul`, SwiGLU `npu_swiglu`.
- Fused MoE (`fused_moe`), vllm-ascend's all-gather path: `npu_moe_gating_top_k_softmax`
  (softmax + top-k of the fp32 logits; the renormalization is ours), `npu_moe_init_routing_v2`
  (pairs sorted by expert, only this rank's `active_expert_range`, per-expert counts),
  `npu_grouped_matmul` twice around `npu_swiglu` over the experts laid out [E, in, out] once
  in `prepare_moe`, and `npu_moe_token_unpermute` (the weighted sum back to token order).
  Int8 experts (W8A8 dynamic, msmodelslim's W8A8_DYNAMIC, laid out so once in
  `prepare_quantized_moe`) take the same steps, each grouped matmul's input quantized per token
  first as vllm-ascend does: `npu_dynamic_quant` (int8 rows, fp32 per-token scales), then
  `npu_grouped_matmul` with scale=[the per-channel scales [E, out]] (fp32 for float16 outputs,
  bfloat16 for bfloat16 ones: the combinations the A2/A3 op takes), per_token_scale and
  output_dtype = the activations' dtype.
- Quantized linears (workers/quant), as vllm-ascend runs them, the int8 weight laid out [in, out]
  once in `prepare_quantized_linear` (the weight's own tensor becomes a transposed view of it):
  W8A8 dynamic: `npu_dynamic_quant` (int8 rows, fp32 per-token scales) then `npu_quant_matmul`
  (int32 sums x the fp32 per-channel scale x the per-token one); W8A8 static (msmodelslim):
  `npu_quantize` (x * 1/input_scale + input_offset, both repeated to the input width in the
  activations' dtype, round, clamp) then `npu_quant_matmul` with quant_bias and deq_scale (fp32
  for bfloat16 outputs, `npu_trans_quant_param`'s int64 for float16 ones); W4A16 (AWQ):
  `npu_weight_quant_batchmatmul` over the weight packed by `npu_convert_weight_to_int4pack`
  ([in, out / 8] int32 holding q - 8) with antiquant_offset = 8 - zero, so (q - 8 + 8 - zero) *
  scale, per group (group sizes the op takes: multiples of 32 below in; one group: per channel).
  A W4A16 weight the op cannot take runs the reference arithmetic (describe() says "reference").

torch_npu is imported when the table is built (get_op_table for an "npu" device), never at
module import: importing it without the CANN toolkit breaks `import torch`. Tested on the CPU through an emulation of
these ops (tests/workers/npu_emulation.py); never run on an Ascend device yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.block_sizes import check_npu_block_size
from workers.ops.base import AttentionBackend, AttentionMetadata, Int8MoEWeights, MoEWeights, OpTable, QuantLinear
from workers.quant.weights import Int4Weight, Int8Weight, reference_linear

MASK_SIZE = 2048  # sparse_mode 3 reads the causal mask compressed to this square
NPU_DTYPES = (torch.float16, torch.bfloat16)


def torch_npu():
    """The torch_npu module, imported on first use (registers torch.npu)."""
    import torch_npu as module  # lazy by design

    return module


def check_npu_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in NPU_DTYPES:
        raise ValueError(f"dtype must be float16 or bfloat16 on the NPU (its attention kernels take no other), "
                         f"got {str(dtype).removeprefix('torch.')}")
    return dtype


@dataclass
class NpuMoEWeights(MoEWeights):
    """One layer's experts as the NPU table computes with them: `gate_up` [num_local, hidden, 2I]
    and `down` [num_local, I, hidden], the [E, in, out] layout of npu_grouped_matmul, made once
    by prepare_moe (w13 / w2, the model's own parameters, become transposed views of them).

    Expert parallelism (this rank holds experts [first_expert, first_expert + num_local) of
    num_experts) is init_routing_v2's `active_expert_range`, as in vllm-ascend: the routing keeps
    only the (token, choice) pairs of this rank's experts, sorted first, and counts tokens per
    local expert, so the grouped matmuls compute nothing for experts held elsewhere. Its gather
    index marks a dropped pair -1, which npu_moe_token_unpermute does not skip (vllm-ascend's
    A2/A3 path reads row |-1| = 1 under a zeroed weight, which is NaN where that row holds
    garbage, and past the end when there is one pair). Here the rows past the kept pairs are
    zeroed and every dropped pair reads the last row, which is past them whenever a pair was
    dropped, so it adds exactly zero. Without expert parallelism every pair is kept and neither
    step runs."""

    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None


@dataclass
class NpuInt8MoEWeights(Int8MoEWeights):
    """One layer's int8 experts (W8A8 dynamic) as the NPU table computes with them: `gate_up_int8`
    [num_local, hidden, 2I] and `down_int8` [num_local, I, hidden], laid out once by
    prepare_quantized_moe as NpuMoEWeights' are (w13 / w2 become transposed views of them: the int8
    values are held once; Int8MoEWeights' gate_up(e) / down(e) still read them), and `scales`: per
    activation dtype, the (w13, w2) per-channel scales [num_local, out] in the dtype the grouped
    matmul takes for that output (fp32 for float16, bfloat16 for bfloat16; the fp32 ones are
    w13_scale / w2_scale themselves). Expert parallelism as NpuMoEWeights."""

    gate_up_int8: torch.Tensor | None = None
    down_int8: torch.Tensor | None = None
    scales: dict | None = None


def _moe_scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The per-channel scale dtype npu_grouped_matmul takes with per-token int8 inputs and `dtype` outputs
    (A2/A3: float32 scales for float16 outputs, bfloat16 scales for bfloat16 ones)."""
    return torch.float32 if dtype == torch.float16 else torch.bfloat16


@dataclass
class _Task:
    """One captured layer's paged attention: what an update must pass again."""
    handle: object
    event: object
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    out: torch.Tensor


@dataclass
class NpuGraphState:
    """A decode graph bucket's attention state (the graph runner holds one per bucket)."""
    num_rows: int
    capturing: bool = False
    tasks: list[_Task] = field(default_factory=list)
    workspace: torch.Tensor | None = None
    update_stream: object = None


class NpuAttentionBackend(AttentionBackend):
    name = "npu"

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}

    def _mask(self, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(device)
        if mask is None:  # 1 = masked: strictly above the diagonal
            mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device).triu_(1)
            self._masks[device] = mask
        return mask

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        check_npu_block_size(meta.block_size)
        x = meta.extra
        x["npu_mask"] = self._mask(meta.slot_mapping.device)
        x["npu_slots"] = meta.slot_mapping.to(torch.int32)  # [T]; the kernels take int32 slots
        ends, total = [], 0
        for n in meta.query_lens_host:
            total += n
            ends.append(total)
        x["npu_q_ends"] = ends  # TND: cumulative query ends
        x["npu_kv_lens"] = list(meta.seq_lens_host)
        x["npu_context_lens"] = torch.tensor(meta.seq_lens_host, dtype=torch.int32)  # host, for paged attention
        return meta

    def write_kv(self, kv_cache, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        npu = torch_npu()
        slots = meta.extra["npu_slots"]
        key_cache, value_cache = kv_cache.key(layer), kv_cache.value(layer)
        if hasattr(npu, "npu_scatter_pa_kv_cache"):
            npu.npu_scatter_pa_kv_cache(key=k.contiguous(), value=v.contiguous(), key_cache=key_cache,
                                        value_cache=value_cache, slot_mapping=slots, cache_mode="Norm")
        else:  # torch_npu before npu_scatter_pa_kv_cache
            npu._npu_reshape_and_cache(key=k.contiguous(), value=v.contiguous(), key_cache=key_cache,
                                       value_cache=value_cache, slot_indices=slots)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, layer: int,
                meta: AttentionMetadata) -> torch.Tensor:
        check_npu_dtype(q.dtype)
        t, heads, dim = q.shape
        kv_heads = k.shape[1]
        scale = dim ** -0.5
        key_cache, value_cache = kv_cache.key(layer), kv_cache.value(layer)  # [num_blocks, bs, KVH, D]
        graph = meta.extra.get("graph")
        if isinstance(graph, NpuGraphState):
            return self._paged_decode(q.contiguous(), key_cache, value_cache, kv_heads, scale, meta, graph)
        x = meta.extra
        nb, bs = key_cache.shape[:2]
        out, _ = torch_npu().npu_fused_infer_attention_score(
            q.contiguous(), key_cache.view(nb, bs, -1), value_cache.view(nb, bs, -1),
            atten_mask=x["npu_mask"], block_table=meta.block_tables, input_layout="TND", block_size=bs,
            actual_seq_lengths=x["npu_q_ends"], actual_seq_lengths_kv=x["npu_kv_lens"],
            num_key_value_heads=kv_heads, num_heads=heads, scale=scale, sparse_mode=3,
        )  # [T, H, D]
        return out.view(t, heads * dim)

    # -- decode graphs ------------------------------------------------------------------

    supports_graphs = True

    def new_graph_state(self, num_rows: int, **shape) -> NpuGraphState:
        """shape (max_blocks, device, heads, dtype) is what other backends need; paged attention reads it all
        from its arguments."""
        return NpuGraphState(num_rows=num_rows, update_stream=torch.npu.Stream())

    def _paged_decode(self, q, key_cache, value_cache, kv_heads, scale, meta, graph: NpuGraphState):
        npu = torch_npu()
        t, heads, dim = q.shape
        out = torch.empty_like(q)  # [B, H, D]; inside a capture it lives in the graph's pool
        args = dict(query=q, key_cache=key_cache, value_cache=value_cache, num_kv_heads=kv_heads,
                    num_heads=heads, scale_value=scale, block_table=meta.block_tables,
                    context_lens=meta.extra["npu_context_lens"], out=out)
        if not graph.capturing:
            npu._npu_paged_attention(**args)
            return out.view(t, heads * dim)
        if graph.workspace is None:
            graph.workspace = npu._npu_paged_attention_get_workspace(**args)
        stream = torch.npu.current_stream()
        event = torch.npu.ExternalEvent()  # the task waits until its update has been recorded
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        npu._npu_paged_attention(**args, workspace=graph.workspace)
        handle = torch.npu.graph_task_group_end(stream)
        graph.tasks.append(_Task(handle, event, q, key_cache, value_cache, out))
        return out.view(t, heads * dim)

    def update_graph(self, graph: NpuGraphState, meta: AttentionMetadata) -> None:
        """Before a replay: patch every captured paged-attention task with this step's
        context lengths (host arguments are baked into a captured task)."""
        if not graph.tasks:
            return
        npu = torch_npu()
        lens = torch.tensor(meta.seq_lens_host, dtype=torch.int32)
        torch.npu.current_stream().synchronize()  # the previous replay has read the old ones
        stream = graph.update_stream
        with torch.npu.stream(stream):
            for task in graph.tasks:
                torch.npu.graph_task_update_begin(stream, task.handle)
                npu._npu_paged_attention(query=task.query, key_cache=task.key_cache, value_cache=task.value_cache,
                                         num_kv_heads=task.key_cache.shape[2], num_heads=task.query.shape[1],
                                         scale_value=task.query.shape[2] ** -0.5, block_table=meta.block_tables,
                                         context_lens=lens, out=task.out, workspace=graph.workspace)
                torch.npu.graph_task_update_end(stream)
                task.event.record(stream)


class NpuOpTable(OpTable):
    name = "npu"

    def __init__(self) -> None:
        torch_npu()  # ImportError here, where the table is chosen, when torch_npu is absent
        self.attention = NpuAttentionBackend()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_npu().npu_rms_norm(x, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        y, _, s = torch_npu().npu_add_rms_norm(x, residual, weight, eps)
        return y, s

    def apply_rotary(self, q, k, cos, sin):
        npu = torch_npu()
        c, s = cos[None, :, None, :], sin[None, :, None, :]  # [1, T, 1, D]
        q = npu.npu_rotary_mul(q.unsqueeze(0), c, s)[0]  # [1, T, H, D] -> [T, H, D]
        k = npu.npu_rotary_mul(k.unsqueeze(0), c, s)[0]
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch_npu().npu_swiglu(x, dim=-1)

    # -- mixture of experts --
    def prepare_moe(self, w13, w2, first_expert, num_experts, dtype=None) -> NpuMoEWeights:
        """The grouped matmul computes x_g @ weight_g with weight [E, in, out]: our [E, out, in]
        experts are laid out so once here, as vllm-ascend does at load. The model's parameters become
        transposed views of the new layout, so the experts are held once (a second call copies nothing)."""
        if w13.dtype not in NPU_DTYPES or w2.dtype != w13.dtype:
            raise ValueError(f"MoE experts must be float16 or bfloat16 on the NPU (the table computes half "
                             f"precision only), got {w13.dtype} and {w2.dtype}")
        gate_up = w13.detach().transpose(1, 2).contiguous()  # [E, hidden, 2I]
        down = w2.detach().transpose(1, 2).contiguous()  # [E, I, hidden]
        w13.data, w2.data = gate_up.transpose(1, 2), down.transpose(1, 2)  # the same shapes, one storage each
        return NpuMoEWeights(w13, w2, first_expert, num_experts, gate_up=gate_up, down=down)

    def prepare_quantized_moe(self, experts: Int8MoEWeights, dtype=None) -> NpuInt8MoEWeights:
        """Int8 experts laid out [E, in, out] once, as prepare_moe lays out float ones (the model's int8
        parameters become transposed views: held once, a second call copies nothing); the scales the
        grouped matmul takes for `dtype` outputs are made here (the fp32 ones are the experts' own),
        those of another dtype on its first call."""
        if dtype is not None:
            check_npu_dtype(dtype)
        w13, w2 = experts.w13, experts.w2
        if w13.dtype != torch.int8 or w2.dtype != torch.int8:
            raise ValueError(f"int8 MoE experts must be int8, got {w13.dtype} and {w2.dtype}")
        gate_up = w13.detach().transpose(1, 2).contiguous()  # [E, hidden, 2I]
        down = w2.detach().transpose(1, 2).contiguous()  # [E, I, hidden]
        w13.data, w2.data = gate_up.transpose(1, 2), down.transpose(1, 2)
        s13, s2 = experts.w13_scale.float().contiguous(), experts.w2_scale.float().contiguous()

        def scales(dt):  # [E, 2I], [E, hidden] in the dtype the op takes with dt outputs
            sd = _moe_scale_dtype(dt)
            return s13.to(sd), s2.to(sd)
        self.quant_paths = self.quant_paths | {"moe-w8a8-dynamic:npu_grouped_matmul"}
        return NpuInt8MoEWeights(w13, w2, experts.first_expert, experts.num_experts, experts.w13_scale,
                                 experts.w2_scale, gate_up_int8=gate_up, down_int8=down, scales=_ByDtype(scales, dtype))

    def fused_moe(self, x, router_logits, experts: MoEWeights, top_k, renormalize):
        """Route, permute, two grouped matmuls around SwiGLU, unpermute; int8 experts quantize each
        grouped matmul's input per token first. See `NpuMoEWeights` for how the pairs routed to experts
        held elsewhere (expert parallelism) add nothing."""
        check_npu_dtype(x.dtype)
        quantized = isinstance(experts, NpuInt8MoEWeights)
        if not quantized and not isinstance(experts, NpuMoEWeights):
            raise TypeError("fused_moe takes the handle NpuOpTable.prepare_moe or prepare_quantized_moe returned")
        if not quantized and experts.gate_up.dtype != x.dtype:
            raise ValueError(f"MoE experts are {experts.gate_up.dtype} but the activations {x.dtype}: "
                             f"the grouped matmul takes one dtype")
        t = x.shape[0]
        if t == 0:
            return torch.empty_like(x)
        npu = torch_npu()
        # softmax and top-k of the fp32 logits, as route_tokens; the op leaves the top-k unnormalized
        weights, ids, _ = npu.npu_moe_gating_top_k_softmax(router_logits.float(), k=top_k)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(router_logits.dtype).to(x.dtype)  # [T, k], rounded as route_tokens rounds
        first, num_local = experts.first_expert, experts.num_local
        pairs = t * top_k
        rows, src_to_row, counts, _ = npu.npu_moe_init_routing_v2(
            x, ids, active_num=pairs, expert_num=experts.num_experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[first, first + num_local],
            row_idx_type=0)  # rows [pairs, H]: this rank's pairs first, by expert; counts [num_local]
        counts = counts.to(torch.int64)  # group_list is int64 (the routing's count is already; vllm-ascend casts too)
        # a count group_list may not have length 1; one expert's cumsum is the same number
        group_list_type = 1 if num_local > 1 else 0
        gmm = dict(group_list=counts, group_list_type=group_list_type, group_type=0, split_item=2)
        if quantized:
            (gate_up, down), (s13, s2) = (experts.gate_up_int8, experts.down_int8), experts.scales[x.dtype]
        else:
            gate_up, down, s13, s2 = experts.gate_up, experts.down, None, None
        h = _grouped_matmul(npu, rows, gate_up, s13, gmm)  # [pairs, 2I]
        h = npu.npu_swiglu(h, dim=-1)
        h = _grouped_matmul(npu, h, down, s2, gmm)  # [pairs, H]
        if num_local < experts.num_experts:  # expert parallelism: some pairs were not kept
            kept = torch.arange(pairs, device=x.device) < counts.sum()
            h = torch.where(kept[:, None], h, 0)  # the rows past the kept pairs are undefined: zero them
            src_to_row = torch.where(src_to_row < 0, pairs - 1, src_to_row)  # and read a dropped pair from one
        return npu.npu_moe_token_unpermute(permuted_tokens=h, sorted_indices=src_to_row, probs=weights)

    # -- quantized linears --
    def prepare_quantized_linear(self, weight, bias=None, dtype=None) -> QuantLinear:
        """The weight laid out for torch_npu's quantized matmuls once, here (see the module docstring);
        what depends on the activations' dtype (`dtype`, or each new one a call brings) is made once per dtype."""
        if dtype is not None:
            check_npu_dtype(dtype)
        if isinstance(weight, Int4Weight):
            return self._prepare_w4a16(weight, bias, dtype)
        return self._prepare_w8a8(weight, bias, dtype)

    def _prepare_w8a8(self, w: Int8Weight, bias, dtype) -> QuantLinear:
        npu = torch_npu()
        w_t = w.qweight.t().contiguous()  # [in, out], as npu_quant_matmul reads its x2 (vllm-ascend's layout)
        w.qweight.data = w_t.t()  # held once: the [out, in] weight becomes a view of it (a second call copies nothing)
        if w.dynamic:
            scale = w.scale.float().contiguous()

            def run(x):
                check_npu_dtype(x.dtype)
                xq, sx = npu.npu_dynamic_quant(x)  # int8 [T, in], fp32 [T]: max |x| / 127 per row
                return npu.npu_quant_matmul(xq, w_t, scale, pertoken_scale=sx, bias=None, output_dtype=x.dtype)
            return self._quantized("npu_quant_matmul", run, w, bias)

        width = w.in_features

        def params(dt):  # as vllm-ascend: 1/input_scale and the offset repeated to the input width, in x's dtype
            inv, offset = (torch.full((width,), v, dtype=dt, device=w_t.device)
                           for v in (1.0 / w.input_scale, float(w.input_offset)))
            deq = w.deq_scale.float().contiguous()  # bfloat16 outputs take fp32; float16 ones the int64 form
            return inv, offset, npu.npu_trans_quant_param(deq) if dt == torch.float16 else deq
        by_dtype = _ByDtype(params, dtype)
        quant_bias = w.quant_bias.to(torch.int32).contiguous()

        def run(x):
            check_npu_dtype(x.dtype)
            inv, offset, deq = by_dtype[x.dtype]
            xq = npu.npu_quantize(x, inv, offset, torch.qint8, -1, False)  # round(x * inv + offset), clamped
            return npu.npu_quant_matmul(xq, w_t, deq, bias=quant_bias, output_dtype=x.dtype)
        return self._quantized("npu_quant_matmul", run, w, bias)

    def _prepare_w4a16(self, w: Int4Weight, bias, dtype) -> QuantLinear:
        k, n, g = w.in_features, w.out_features, w.group_size
        group = 0 if g >= k else g  # one group spanning the inputs is the per-channel case
        if n % 8 or (group and (group % 32 or group > k - 1)):  # what npu_weight_quant_batchmatmul takes
            return self._quantized("reference", lambda x: reference_linear(x, w), w, bias)
        npu = torch_npu()
        packed = npu.npu_convert_weight_to_int4pack((w.qweight.t().to(torch.int32) - 8).contiguous())  # [in, out/8]

        def params(dt):  # [in / g, out] in x's dtype: weight = (q - 8 + (8 - zero)) * scale
            return w.scales.t().to(dt).contiguous(), (8 - w.zeros.t().to(dt)).contiguous()
        by_dtype = _ByDtype(params, dtype)

        def run(x):
            check_npu_dtype(x.dtype)
            scale, offset = by_dtype[x.dtype]
            return npu.npu_weight_quant_batchmatmul(x, packed, antiquant_scale=scale, antiquant_offset=offset,
                                                    antiquant_group_size=group)
        return self._quantized("npu_weight_quant_batchmatmul", run, w, bias)


def _grouped_matmul(npu, h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, gmm: dict) -> torch.Tensor:
    """One grouped matmul of the routed rows h [pairs, in] over the experts [E, in, out] -> [pairs, out]
    in h's dtype. Float experts (scale None) multiply h as it is; int8 ones (W8A8 dynamic) take h
    quantized per token (int8 rows, fp32 per-token scales), the int32 sums dequantized by the
    per-channel `scale` [E, out] and the per-token scales."""
    if scale is None:
        return npu.npu_grouped_matmul(x=[h], weight=[weight], **gmm)[0]
    hq, h_scale = npu.npu_dynamic_quant(h)
    return npu.npu_grouped_matmul(x=[hq], weight=[weight], scale=[scale], per_token_scale=[h_scale],
                                  output_dtype=h.dtype, **gmm)[0]


class _ByDtype(dict):
    """Tensors a kernel takes in the activations' dtype, made once per dtype (`first` at once)."""

    def __init__(self, make, first: torch.dtype | None = None) -> None:
        super().__init__()
        self.make = make
        if first is not None:
            self[first] = make(first)

    def __missing__(self, dtype):
        value = self[dtype] = self.make(dtype)
        return value
