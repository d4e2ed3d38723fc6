"""The CUDA op table: FlashInfer's paged attention (optional extra `raylm[cuda]`).

- K/V writes: one `index_copy_` per K and V into the layer's flat [slots, KVH, D] view
  (no Python loop; capturable in a CUDA graph).
- Attention: FlashInfer over the cache in its "NHD" layout ([pages, page_size, KVH, D],
  exactly KVCache's per-layer tensors), planned once per step from the host lengths:
  decode-only steps through BatchDecodeWithPagedKVCacheWrapper, mixed steps through
  BatchPrefillWithPagedKVCacheWrapper with causal=True (aligned bottom right, so cached
  keys come before a chunk's own). A captured decode graph owns a decode wrapper built
  with use_cuda_graph=True over static buffers; `update_graph` re-plans it before a
  replay, which rewrites those buffers.
- Without FlashInfer, or in float32 (FlashInfer takes float16 / bfloat16), attention
  falls back to the reference's gather + SDPA; decode graphs need FlashInfer.
- Elementwise ops and GEMMs are the reference's (plain torch: cuBLAS on a GPU).
- Quantized linears (workers/quant): W8A8 by `torch._int_mm` (int8 x int8 -> exact int32 sums,
  the weight read as the column-major transpose of its [out, in] rows), the activations quantized
  in torch first (per token, or by the static scale and offset) and the scales (and msmodelslim's
  quant_bias) applied to the sums after; cuBLAS takes only more than 16 rows, so fewer are padded
  with zero rows to 17, and in / out must be multiples of 8 (else the reference arithmetic).
  W4A16 by torch's tinygemm `_weight_int4pack_mm` (bfloat16 only) over the weight repacked once
  on the GPU by `_convert_weight_to_int4pack` (uint8 pairs, the even input in the high nibble),
  scales_and_zeros [in / g, out, 2] in torch's convention w = (q - 8) * scale + zero, i.e. zero =
  (8 - awq_zero) * scale; a weight not on a GPU, other group sizes (torch takes 32 / 64 / 128 /
  256) or other activation dtypes take the reference arithmetic.
- MoE experts: two torch._grouped_mm calls over all of a layer's experts
  (workers/ops/moe_grouped.py: no loop over experts, no host sync for weights in x's dtype;
  narrower weights widened per call, the hit experts only, as the reference does); the
  reference's expert loop where torch._grouped_mm cannot take the layer (its rows must be
  multiples of 16 bytes).

flashinfer is imported on first use. Tested on the CPU through an emulation of the two
wrappers (tests/workers/flashinfer_emulation.py); never run on a CUDA device yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.ops.base import AttentionBackend, AttentionMetadata, MoEWeights, QuantLinear
from workers.ops.moe_grouped import grouped_mm_fits, grouped_mm_moe
from workers.ops.reference import GatherSDPAAttention, ReferenceOps
from workers.quant.weights import Int4Weight, Int8Weight, quantize_rows, quantize_static, reference_linear

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
INT_MM_MIN_ROWS = 17  # cuBLAS' int8 GEMM behind torch._int_mm takes more than 16 rows
TINYGEMM_GROUPS = (32, 64, 128, 256)


def flashinfer():
    """The flashinfer module, or None when it is not installed."""
    try:
        import flashinfer as module  # lazy by design: an optional extra
    except ImportError:
        return None
    return module


def page_table(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table from the step's block tables and host lengths:
    kv_indptr [B + 1] and last_page_len [B] (host int32), page indices [sum pages] (device int32)."""
    bs, cols = meta.block_size, meta.block_tables.shape[1]
    lens = torch.tensor(meta.seq_lens_host, dtype=torch.int32)  # host work, vectorized
    pages = (lens + bs - 1) // bs
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    last = lens - (pages - 1) * bs
    used = torch.arange(cols)[None, :] < pages[:, None]  # [B, cols]: the table entries holding keys
    flat = used.flatten().nonzero().squeeze(1).to(meta.block_tables.device, non_blocking=True)
    indices = meta.block_tables.reshape(-1).index_select(0, flat)
    return indptr, last.to(torch.int32), indices


def _query_indptr(meta: AttentionMetadata) -> torch.Tensor:
    qo = [0]
    for n in meta.query_lens_host:
        qo.append(qo[-1] + n)
    return torch.tensor(qo, dtype=torch.int32)


@dataclass
class CudaGraphState:
    """A decode graph bucket's FlashInfer wrapper over static page-table buffers."""
    num_rows: int
    wrapper: object
    shape: tuple[int, int, int, torch.dtype]  # num_heads, num_kv_heads, head_dim, dtype
    capturing: bool = False


class CudaAttentionBackend(AttentionBackend):
    name = "cuda"

    def __init__(self) -> None:
        self._fi = flashinfer()
        self._workspace: torch.Tensor | None = None
        self._decode = self._prefill = None
        self._fallback = GatherSDPAAttention()

    @property
    def supports_graphs(self) -> bool:
        return self._fi is not None

    def _workspace_on(self, device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, kv_cache_dtype: torch.dtype) -> object:
        """Plan this step's wrapper once (at the first layer); later layers reuse it."""
        x = meta.extra
        if "fi_wrapper" in x:
            return x["fi_wrapper"]
        _, heads, dim = q.shape
        kv_heads = x["fi_kv_heads"]
        indptr, last, indices = page_table(meta)
        ws = self._workspace_on(q.device)
        fi = self._fi
        if meta.num_decode == meta.num_seqs:
            if self._decode is None:
                self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=heads // kv_heads >= 4)
            wrapper = self._decode
            wrapper.plan(indptr, indices, last, heads, kv_heads, dim, meta.block_size, q_data_type=q.dtype,
                         kv_data_type=kv_cache_dtype, sm_scale=dim ** -0.5)
        else:
            if self._prefill is None:
                self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            wrapper = self._prefill
            wrapper.plan(_query_indptr(meta), indptr, indices, last, heads, kv_heads, dim, meta.block_size,
                         causal=True, sm_scale=dim ** -0.5, q_data_type=q.dtype, kv_data_type=kv_cache_dtype)
        x["fi_wrapper"] = wrapper
        return wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, layer: int,
                meta: AttentionMetadata) -> torch.Tensor:
        t, heads, dim = q.shape
        key_cache, value_cache = kv_cache.key(layer), kv_cache.value(layer)  # [pages, page_size, KVH, D]
        graph = meta.extra.get("graph")
        if isinstance(graph, CudaGraphState):
            return graph.wrapper.run(q.contiguous(), (key_cache, value_cache)).view(t, heads * dim)
        if self._fi is None or q.dtype not in FLASHINFER_DTYPES:  # the reference's gather + SDPA
            if "chunks" not in meta.extra:
                self._fallback.prepare(meta)  # once per step, at the first layer
            return self._fallback.forward(q, k, v, kv_cache, layer, meta)
        meta.extra["fi_kv_heads"] = k.shape[1]
        wrapper = self._plan(meta, q, key_cache.dtype)
        return wrapper.run(q.contiguous(), (key_cache, value_cache)).view(t, heads * dim)

    # -- decode graphs ------------------------------------------------------------------

    def new_graph_state(self, num_rows: int, *, max_blocks: int, device, num_heads: int, num_kv_heads: int,
                        head_dim: int, dtype: torch.dtype) -> CudaGraphState:
        if self._fi is None:
            raise ValueError("CUDA decode graphs need FlashInfer (pip install 'raylm[cuda]'); "
                             "or set enforce_eager=True")
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"CUDA decode graphs run in float16 or bfloat16, got {dtype}; set enforce_eager=True")
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace_on(device), "NHD", use_cuda_graph=True,
            use_tensor_cores=num_heads // num_kv_heads >= 4,
            paged_kv_indptr_buffer=torch.zeros(num_rows + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(num_rows * max_blocks, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(num_rows, dtype=torch.int32, device=device))
        return CudaGraphState(num_rows=num_rows, wrapper=wrapper, shape=(num_heads, num_kv_heads, head_dim, dtype))

    def update_graph(self, graph: CudaGraphState, meta: AttentionMetadata) -> None:
        """Before capture and each replay: re-plan, which rewrites the static page table."""
        heads, kv_heads, dim, dtype = graph.shape
        indptr, last, indices = page_table(meta)
        graph.wrapper.plan(indptr, indices, last, heads, kv_heads, dim, meta.block_size, q_data_type=dtype,
                           kv_data_type=dtype, sm_scale=dim ** -0.5)


class CudaOpTable(ReferenceOps):
    """The reference's elementwise ops and GEMMs (cuBLAS already), FlashInfer's attention, grouped-GEMM
    MoE."""

    name = "cuda"

    def __init__(self) -> None:
        self.attention = CudaAttentionBackend()

    def fused_moe(self, x: torch.Tensor, router_logits: torch.Tensor, experts: MoEWeights, top_k: int,
                  renormalize: bool) -> torch.Tensor:
        if grouped_mm_fits(x, experts):
            return grouped_mm_moe(x, router_logits, experts, top_k, renormalize)
        return super().fused_moe(x, router_logits, experts, top_k, renormalize)

    # -- quantized linears --
    def prepare_quantized_linear(self, weight, bias=None, dtype=None) -> QuantLinear:
        if isinstance(weight, Int4Weight):
            packed = _tinygemm_pack(weight, dtype)
            if packed is None:
                return self._quantized("reference", lambda x: reference_linear(x, weight), weight, bias)
            b, scales_zeros = packed

            def run(x):
                if x.dtype != torch.bfloat16 or not x.is_cuda:  # tinygemm computes bfloat16 on the GPU only
                    return reference_linear(x, weight)
                return torch.ops.aten._weight_int4pack_mm(x.contiguous(), b, weight.group_size, scales_zeros)
            return self._quantized("tinygemm-int4", run, weight, bias)
        if weight.in_features <= 16 or weight.in_features % 8 or weight.out_features % 8:
            return self._quantized("reference", lambda x: reference_linear(x, weight), weight, bias)
        return self._quantized("int-mm", _int8_linear(weight), weight, bias)


def int8_sums(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """xq [T, in] int8 @ qweight [out, in].T -> exact int32 [T, out] by torch._int_mm; fewer than 17 rows
    padded with zero rows (cuBLAS' limit; the CPU takes any, and pads alike so one path is tested)."""
    t = xq.shape[0]
    if t < INT_MM_MIN_ROWS:
        xq = torch.cat([xq, xq.new_zeros(INT_MM_MIN_ROWS - t, xq.shape[1])])
    return torch._int_mm(xq.contiguous(), qweight.t())[:t]


def _int8_linear(w: Int8Weight):
    """run(x [T, in]) -> [T, out] in x.dtype: the activations quantized as the reference quantizes them,
    the exact int32 sums, then the scales in fp32."""
    qweight = w.qweight.contiguous()  # read as its transpose: the column-major [in, out] cuBLAS wants
    if w.dynamic:
        scale = w.scale.float()

        def run(x):
            xq, sx = quantize_rows(x)  # per token: max |x| / 127
            return int8_sums(xq, qweight).float().mul_(scale).mul_(sx[:, None]).to(x.dtype)
        return run
    quant_bias, deq = w.quant_bias.to(torch.int32), w.deq_scale.float()

    def run(x):
        return (int8_sums(quantize_static(x, w), qweight) + quant_bias).float().mul_(deq).to(x.dtype)
    return run


def tinygemm_scales_and_zeros(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """[in / g, out, 2] in dtype: torch's int4 kernels compute (q - 8) * scale + zero, which is AWQ's
    (q - awq_zero) * scale for zero = (8 - awq_zero) * scale."""
    scale = w.scales.float().t()
    zero = (8 - w.zeros.float().t()) * scale
    return torch.stack([scale, zero], dim=-1).to(dtype).contiguous()


def _tinygemm_pack(w: Int4Weight, dtype: torch.dtype | None):
    """(the weight in tinygemm's layout, scales_and_zeros) where torch's CUDA int4 kernel takes this weight
    (on a GPU, bfloat16 activations, its group sizes, out a multiple of 8, in of 32); else None."""
    k, n = w.in_features, w.out_features
    if not w.qweight.is_cuda or dtype not in (None, torch.bfloat16) or w.group_size not in TINYGEMM_GROUPS \
            or n % 8 or k % 32:
        return None
    tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)  # inner k-tiles packed back to back
    q = w.qweight.to(torch.uint8)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # [out, in / 2]: the even input in the high nibble
    return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles), tinygemm_scales_and_zeros(w, torch.bfloat16)
