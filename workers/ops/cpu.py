"""The CPU op table: prepacked GEMMs chosen per CPU feature, and paged attention that reads
the KV blocks where they lie (workers/ops/cpu_attention.py).

Linear, by the CPU's class (workers/ops/cpu_features.py) and the weights' dtype, measured
with benchmarks/bench_gemm.py --packed (figures in docs/benchmarks.md):
- fp32: "onednn-packed": `torch.ops.mkldnn._linear_pointwise` over weights reordered once by
  `_reorder_linear_weight`: 1.2-2x F.linear at 16-64 rows, about even at 512+ (AVX2 and AVX-512
  alike). MKL's packed sgemm ("mkl-packed", `_mkl_linear` over `_mkl_reorder_linear_weight`) is
  as fast at 64 rows on an AVX-512 Xeon but half as fast at 16 and its packed copy is 1.4-18x the
  weight's bytes (kept beside the weight), so it runs only when asked for;
- bf16 on AVX512-BF16 / AMX: "onednn-packed" as for fp32: oneDNN's bf16 inner product
  (AMX tiles where the CPU has them) over weights reordered once; F.linear reaches the same
  kernels but reorders the weight on every call (1.2-1.7x at 16-64 rows, measured on an AMX Xeon).
  A big weight is instead packed in raylm's own layout (workers/ops/cpu_packed_bf16.py: AMX tiles,
  "amx-bf16", or vdpbf16ps without AMX, "dpbf16-packed") where that measures as fast at every batch
  size: the lm_head, whose rows a tied embedding's lookups then read, and whose greedy argmax is fused
  (and without AMX every big weight, as measured on a Zen 4);
- fp16, and bf16 elsewhere: "aten" (F.linear).
A small weight (a tiny model's, a draft's, an EAGLE-3 head's, a MoE router's: up to SMALL_MAX_ELEMENTS)
is instead kept plain for F.linear where that measures no more than PLAIN_TOLERANCE slower at any batch
size probed (the packed GEMM's fixed cost a call can be most of such a weight's time at a few rows);
one copy either way.
RAYLM_CPU_LINEAR=aten|mkl-packed|onednn-packed overrides the choice; mkl-packed falls back to aten where
the op is absent. An fp32 weight whose values are all bf16 values (a bf16 checkpoint computing in
fp32) is also, or instead, read at bf16's width by raylm's narrow linear, as measured per weight
shape when it is prepared (workers/ops/cpu_narrow.py).

Norms, RoPE and SwiGLU ("elementwise"): raylm's fused C++ kernels (workers/ops/csrc/elementwise.cpp:
add + RMSNorm, q/k RMSNorm + RoPE, silu * up, each one pass) for fp32, bf16 and fp16 tensors
(bf16 / fp16 read at their width, computed in fp32 and rounded back where HF's eager bf16 ops
round, so they agree with the reference to within one ulp; fp16 silu * up stays torch's, measured
faster than the kernel) where the kernels built ("fused-cpp");
else the reference's eager ops ("eager"). RAYLM_CPU_ELEMENTWISE=eager|fused overrides ("fused"
fails loudly where the kernels cannot be built).

MoE experts: workers/ops/cpu_moe.py (raylm's kernel reading bf16 / fp16 experts at their own width,
aten's GEMM per expert, or torch._grouped_mm, whichever measures fastest here per dtype and batch
size); RAYLM_CPU_MOE overrides.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from workers.ops import cpu_kernels, cpu_packed_bf16
from workers.ops.base import QuantLinear
from workers.ops.cpu_attention import make_cpu_attention
from workers.ops.cpu_features import cpu_class, has_mkl_packed_linear, has_onednn_packed_linear
from workers.ops.cpu_moe import CPUMoE
from workers.ops.cpu_narrow import ALL, PROBE_ROWS, NarrowWeight, bf16_copy, choose_rows, forced_rows, narrow_linear
from workers.ops.cpu_quant import Int4Paths, Int8Paths
from workers.ops.kernel_choices import remembered
from workers.ops.reference import ReferenceOps

LINEAR_PATHS = ("aten", "mkl-packed", "onednn-packed")
# the fp32 linear path per CPU class, as measured (docs/benchmarks.md)
FP32_LINEAR = {"amx_bf16": "onednn-packed", "avx512_bf16": "onednn-packed", "avx512f": "onednn-packed",
               "avx2": "onednn-packed", "other": "aten"}
# the bf16 linear path per CPU class (where bf16 has native dot products); others run F.linear
BF16_LINEAR = {"amx_bf16": "onednn-packed", "avx512_bf16": "onednn-packed"}
_MKL_BATCH = 64  # the batch size hint MKL's packing takes (rows it is tuned for)
# a weight of up to this many elements (1 MiB in fp32: a tiny model's, a draft's, an EAGLE-3 head's, a
# MoE router's) may be kept plain for F.linear instead of packed; a real model's projections are larger
SMALL_MAX_ELEMENTS = 1 << 18
# how much slower than the packed GEMM F.linear may measure at a probe and still serve a small weight
PLAIN_TOLERANCE = 1.25
# per small weight's shape, dtype, path and thread count: whether F.linear serves it, as measured in
# this process, which every table here takes (a draft and its target, a quantized model and its float
# original prepare the same shapes: one choice, as a shape near the bound would otherwise get two)
_PLAIN: dict[tuple, bool] = {}
ELEMENTWISE_ENV = "RAYLM_CPU_ELEMENTWISE"


def fused_elementwise_kernels():
    """torch.ops.raylm when the fused elementwise kernels serve (the default where they build),
    else None (eager torch)."""
    return cpu_kernels.load_unless(ELEMENTWISE_ENV, "eager")


def linear_path(dtype: torch.dtype) -> str:
    forced = os.environ.get("RAYLM_CPU_LINEAR")
    if forced is not None and forced not in LINEAR_PATHS:
        raise ValueError(f"RAYLM_CPU_LINEAR must be one of {', '.join(LINEAR_PATHS)}, got {forced!r}")
    if forced is None:
        path = FP32_LINEAR[cpu_class()] if dtype == torch.float32 else BF16_LINEAR.get(cpu_class(), "aten")
    else:
        path = forced
    if path == "mkl-packed" and (dtype != torch.float32 or not has_mkl_packed_linear()):
        path = "aten"
    if path == "onednn-packed" and (dtype not in (torch.float32, torch.bfloat16) or not has_onednn_packed_linear()):
        path = "aten"
    return path


class MKLPackedWeight:
    """A weight packed once for MKL's sgemm (opaque), with the original for its shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, _MKL_BATCH)
        self.out_features = weight.shape[0]


class OneDNNPackedWeight:
    """A weight reordered once into oneDNN's blocked layout for its fp32 / bf16 inner product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _MKL_BATCH)
        self.bias = bias
        self.out_features = weight.shape[0]


class CPUOps(ReferenceOps):
    name = "cpu"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.attention = make_cpu_attention()
        self.linear_paths: set[str] = set()  # the paths prepared weights took (a model may mix dtypes)
        self.fused = fused_elementwise_kernels()
        self.moe = CPUMoE()
        self.narrow_rows: dict[tuple[int, int], int] = {}  # per weight shape: what choose_rows measured
        self.packed_wins: dict[tuple[int, int], bool] = {}  # per bf16 weight shape: cpu_packed_bf16.faster's answer
        self.int8 = Int8Paths(self.fused)
        self.int4 = Int4Paths(agree=lambda value: self.agree(value))  # int8's paths all sum exactly: no need

    def describe(self) -> dict:
        kernels = "built" if cpu_kernels.load() is not None else f"not built: {cpu_kernels.failure()}"
        return {**super().describe(), "cpu": cpu_class(), "linear": ",".join(sorted(self.linear_paths)) or None,
                "elementwise": "fused-cpp" if self.fused is not None else "eager", "moe": self.moe.describe(),
                "kernels": kernels, "prefill_attention": self.attention.describe_prefill()
                if hasattr(self.attention, "describe_prefill") else "sdpa"}

    def _fusable(self, *tensors) -> bool:
        """The fused kernels take CPU tensors all of one dtype, fp32, bf16 or fp16 (computed in fp32,
        rounded where HF's eager ops round); anything else (e.g. fp32 weights on bf16 activations,
        whose product torch promotes) runs the reference's ops."""
        dtype = tensors[0].dtype
        return self.fused is not None and dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)

    def rms_norm(self, x, weight, eps):
        if not self._fusable(x, weight) or x.stride(-1) != 1 \
                or not (x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2])):
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.fused.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        if not self._fusable(x, residual, weight) or x.dim() != 2 or x.stride(1) != 1 or residual.stride(1) != 1:
            return super().add_rms_norm(x, residual, weight, eps)
        out, s = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
        self.fused.add_rms_norm(out, s, x, residual, weight, eps)
        return out, s

    def qk_norm_rope(self, q, k, q_weight, k_weight, eps, cos, sin):
        fused = self._norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
        return fused or super().qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

    def apply_rotary(self, q, k, cos, sin):
        return self._norm_rope(q, k, None, None, 0.0, cos, sin) or super().apply_rotary(q, k, cos, sin)

    def _norm_rope(self, q, k, q_weight, k_weight, eps, cos, sin):
        """The fused kernel's (q, k): per-head RMSNorm (where weights are given) and RoPE, written
        contiguous; None where it does not take these tensors (each token's heads must be packed)."""
        norms = () if q_weight is None else (q_weight, k_weight)
        if not self._fusable(q, k, *norms, cos, sin) or q.stride(1) != q.shape[2] or k.stride(1) != k.shape[2] \
                or q.stride(2) != 1 or k.stride(2) != 1:
            return None
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        self.fused.qk_norm_rope(q_out, k_out, q, k, q_weight, k_weight, eps, cos, sin)
        return q_out, k_out

    def silu_and_mul(self, x):
        # fp16: torch's own op (the kernel's fp16 rounding measured 17x slower than torch here)
        if not self._fusable(x) or x.dtype == torch.float16 or x.dim() != 2 or x.stride(1) != 1:
            return super().silu_and_mul(x)
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        self.fused.silu_and_mul(out, x)
        return out

    def prepare_linear(self, weight, bias=None):
        path = linear_path(weight.dtype)
        if path == "onednn-packed" and cpu_packed_bf16.qualifies(cpu_kernels.load(), weight):
            return self._packed_or_wide(weight, bias)
        narrow = self._narrow_copy(weight)
        if not self.agree_all(narrow is not None):
            return self._plain_or_packed(weight, bias)
        rows = forced_rows()
        if rows is None:
            rows = self.narrow_rows.get(tuple(weight.shape))  # a shape measured already
        if rows == ALL:  # the bf16 copy alone: no wide one is made
            return self._narrow(None, narrow, weight, bias, ALL)
        handle = self._wide(weight, bias)
        if rows is None:
            kernels = cpu_kernels.load()
            probe = NarrowWeight(handle, narrow, weight.shape[0], None, max(PROBE_ROWS))
            rows = self.agree(remembered("narrow_rows", (*weight.shape, path), lambda: choose_rows(
                lambda x: narrow_linear(kernels, x, probe), lambda x: self.linear(x, handle), *weight.shape)))
            self.narrow_rows[tuple(weight.shape)] = rows
        if rows == ALL:
            return self._narrow(None, narrow, weight, bias, ALL)  # the wide copy made to measure is dropped
        self.linear_paths.add(path)
        return handle if rows == 0 else self._narrow(handle, narrow, weight, bias, rows)

    def _plain_or_packed(self, weight, bias):
        """A weight for the library GEMM of its dtype; a small one (up to SMALL_MAX_ELEMENTS) on a
        packed path, unless RAYLM_CPU_LINEAR forces one, kept plain for F.linear instead where that
        measures about as fast here at every batch size probed."""
        path = linear_path(weight.dtype)
        if path == "aten" or weight.numel() > SMALL_MAX_ELEMENTS or "RAYLM_CPU_LINEAR" in os.environ:
            self.linear_paths.add(path)
            return self._wide(weight, bias)
        plain = (weight.contiguous(), bias)
        key = (*weight.shape, str(weight.dtype).removeprefix("torch."), path)
        chosen = _PLAIN.get((*key, torch.get_num_threads()))
        handle = None
        if chosen is None:
            handle = self._wide(weight, bias)
            chosen = remembered("plain", key, lambda: choose_rows(
                lambda x: F.linear(x, *plain), lambda x: self.linear(x, handle), *weight.shape,
                tolerance=PLAIN_TOLERANCE, dtype=weight.dtype) == ALL)
            _PLAIN[(*key, torch.get_num_threads())] = bool(chosen)
        if self.agree(int(chosen)):
            self.linear_paths.add("aten")
            return plain
        self.linear_paths.add(path)
        return handle if handle is not None else self._wide(weight, bias)

    def _packed_or_wide(self, weight, bias):
        """A bf16 weight in raylm's packing, or oneDNN's, whichever measured faster for its shape
        (cpu_packed_bf16.py); one copy either way."""
        kernels, shape = cpu_kernels.load(), tuple(weight.shape)
        handle = cpu_packed_bf16.pack(kernels, weight, bias)
        if cpu_packed_bf16.forced() != "all" and shape not in self.packed_wins:
            key = f"packed_bf16_{cpu_packed_bf16.engine(kernels)}"  # each engine measured for itself
            self.packed_wins[shape] = bool(self.agree(remembered(key, shape, lambda: cpu_packed_bf16.faster(
                kernels, self.linear, self._wide(weight, bias), handle))))
        if cpu_packed_bf16.forced() == "all" or self.packed_wins[shape]:
            self.linear_paths.add(cpu_packed_bf16.path_name(kernels))
            return handle
        self.linear_paths.add(linear_path(weight.dtype))
        return self._wide(weight, bias)

    def _wide(self, weight, bias):
        """weight prepared for the library GEMM of its dtype on this CPU."""
        path = linear_path(weight.dtype)
        if path == "mkl-packed":
            return MKLPackedWeight(weight, bias)
        if path == "onednn-packed":
            return OneDNNPackedWeight(weight, bias)
        return (weight.contiguous(), bias)

    def _narrow_copy(self, weight):
        """A bf16 copy of an fp32 weight of bf16 values, packed for raylm's narrow linear
        (workers/ops/cpu_narrow.py), where the kernels built and it qualifies; else None."""
        kernels = cpu_kernels.load()
        if kernels is None or forced_rows() == 0:
            return None
        return bf16_copy(kernels, weight)

    def _narrow(self, wide, narrow, weight, bias, rows):
        self.linear_paths.add("narrow-bf16" if rows == ALL else f"narrow-bf16(<={rows} rows)")
        return NarrowWeight(wide, narrow, weight.shape[0], bias, rows)

    def linear(self, x, handle):
        if isinstance(handle, QuantLinear):
            return handle(x)
        if isinstance(handle, cpu_packed_bf16.PackedBF16Weight):
            return cpu_packed_bf16.linear(cpu_kernels.load(), x, handle)
        if isinstance(handle, NarrowWeight):
            if handle.takes(x):
                return narrow_linear(cpu_kernels.load(), x, handle)
            handle = handle.wide
        if isinstance(handle, MKLPackedWeight):
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            y = torch.ops.mkl._mkl_linear(x2.contiguous(), handle.packed, handle.weight, handle.bias, _MKL_BATCH)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], handle.out_features)
        if isinstance(handle, OneDNNPackedWeight):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), handle.packed, handle.bias, "none", [], "")
        weight, bias = handle
        return F.linear(x, weight, bias)

    def linear_argmax(self, x, handle, n):
        if isinstance(handle, cpu_packed_bf16.PackedBF16Weight) and handle.bias is None and x.dim() == 2:
            return cpu_kernels.load().packed_bf16_linear_argmax(x.contiguous(), handle.packed, n)
        if isinstance(handle, NarrowWeight) and handle.bias is None and x.dim() == 2 and handle.takes(x):
            return cpu_kernels.load().narrow_linear_argmax(x.contiguous(), handle.narrow, n)
        kernels = cpu_kernels.load()
        if kernels is None:
            return super().linear_argmax(x, handle, n)
        return kernels.argmax_rows(self.linear(x, handle), n)  # logits, then raylm's argmax over them

    def linear_rows(self, handle, ids, out):
        if isinstance(handle, cpu_packed_bf16.PackedBF16Weight):
            if out.dtype not in (torch.bfloat16, torch.float32) or out.stride(1) != 1:
                return None
            cpu_kernels.load().packed_bf16_rows(out, handle.packed, ids)
            return out
        if isinstance(handle, NarrowWeight):
            if handle.wide is not None or out.dtype != torch.float32 or out.stride(1) != 1:
                return None
            cpu_kernels.load().narrow_rows(out, handle.narrow, ids)
            return out
        return super().linear_rows(handle, ids, out)

    def linear_into(self, x, handle, out):
        if isinstance(handle, cpu_packed_bf16.PackedBF16Weight):
            if x.dim() == 2 and out.dtype in (torch.bfloat16, torch.float32) and out.stride(1) == 1 \
                    and handle.bias is None:
                return cpu_packed_bf16.linear(cpu_kernels.load(), x, handle, out)
            return out.copy_(self.linear(x, handle)[:, : out.shape[1]])
        if isinstance(handle, NarrowWeight):
            if handle.takes(x) and x.dim() == 2 and out.dtype == torch.float32 and out.stride(1) == 1:
                return narrow_linear(cpu_kernels.load(), x, handle, out)
            if handle.wide is None:
                return out.copy_(self.linear(x, handle)[:, : out.shape[1]])
            handle = handle.wide
        if isinstance(handle, (MKLPackedWeight, OneDNNPackedWeight)):
            return out.copy_(self.linear(x, handle)[:, : out.shape[1]])
        return super().linear_into(x, handle, out)

    def prepare_quantized_linear(self, weight, bias=None, dtype=None):
        """W8A8 and W4A16 weights by the library kernels measured fastest here (cpu_quant.py)."""
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        paths = self.int4 if weight.scheme == "w4a16" else self.int8
        name, run, held, kept = paths.prepare(weight, dtype)
        return self._quantized(name, run, kept, bias, held)

    def prepare_moe(self, w13, w2, first_expert, num_experts, dtype=None):
        return self.moe.prepare(w13, w2, first_expert, num_experts, dtype)

    def prepare_quantized_moe(self, experts, dtype=None):
        """int8 experts for raylm's int8 MoE kernel: repacked in its panels where the CPU has VNNI, else
        as they lie (cpu_moe.py)."""
        self.quant_paths = self.quant_paths | {f"moe-{experts.gate_up(0).scheme}:{self.moe.int8_path()}"}
        return self.moe.prepare_int8(experts)

    def fused_moe(self, x, router_logits, experts, top_k, renormalize):
        return self.moe.forward(x, router_logits, experts, top_k, renormalize)
