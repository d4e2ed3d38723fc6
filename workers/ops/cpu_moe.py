"""The CPU table's fused MoE (Qwen3-MoE experts), the path chosen by measurement.

Every path routes with `route_tokens`, groups the (token, expert) pairs by expert, runs gate/up,
silu * up and down per expert and sums each token's weighted outputs; none loops over experts in
Python:
- "cpp-packed": raylm's kernel over experts packed once at prepare into panels (csrc/panel_gemm.h's
  outer-product micro-kernel, as the narrow linear's), read at their own width and widened in
  registers, fp32 math: for experts narrower than the activations (a bf16 checkpoint computing in
  fp32), the only layout they are then held in (the worker frees the unpacked ones);
- "cpp": raylm's kernel (csrc/fused_moe.cpp): register-blocked dot products over the weights where
  they lie, bf16 / fp16 experts read at their own width and widened in registers, fp32 math;
- "aten-mm": the same kernel's routing with aten's GEMM per hit expert (oneDNN, with AMX for bf16
  where the CPU has it; MKL for fp32), in x's dtype;
- "grouped-mm": torch._grouped_mm (workers/ops/moe_grouped.py), in x's dtype;
- "reference": the reference table's expert loop (forced only);
- "cpp-int8": int8 experts (Int8MoEWeights, W8A8 with dynamic activations), raylm's kernel
  (csrc/fused_moe.cpp's fused_moe_int8 over csrc/int8_dot.h): tokens quantized once, exact int32
  sums, the reference's rounding steps, int8 weights at a quarter of fp32's bytes. With AVX512-VNNI the
  experts are repacked once at prepare into panels of 16 rows (PackedInt8MoEWeights: VPDPBUSD adds four
  columns into 16 rows' sums, no horizontal sum per output; with AMX-INT8 an expert meeting enough
  tokens multiplies the same panels in tiles); elsewhere they are read where they lie,
  row by row, against int16-widened activations. The only path for int8 experts besides the reference
  (no library here runs a grouped int8 GEMM); a float path forced by RAYLM_CPU_MOE leaves them on it.

The fastest depends on the CPU (AMX or not), the dtypes and the tokens per step: decode reads every
hit expert's weights once and is bound by memory, a large batch is bound by arithmetic, where a GEMM
library's bf16 tiles win. So the first call of each (x dtype, weight dtype, tokens bucket, layer
shape) times the candidates on that call's own input (at most MEASURE_TOKENS of its tokens, a warm
run, and more of them where runs are quick) and the process keeps the winner. Narrower experts are
packed and served by "cpp-packed" alone (on an AVX2 Zen 3, within 5% of "cpp" at decode sizes and
1.2-1.45x it at 512-2048 tokens: benchmarks/bench_moe.py, docs/benchmarks.md); "aten-mm" and
"grouped-mm" would widen a copy.
RAYLM_CPU_MOE=cpp-packed|cpp|aten-mm|grouped-mm|reference forces one (the "cpp" paths / "aten-mm"
fail loudly where the kernels cannot be built). Without the kernels the table runs "grouped-mm"
(widening the hit experts where the weights are narrower), or the reference where
torch._grouped_mm cannot take the layer's sizes.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from workers.ops import cpu_kernels
from workers.ops.base import Int8MoEWeights, MoEWeights, route_tokens
from workers.ops.moe_grouped import grouped_mm_fits, grouped_mm_moe
from workers.ops.reference import ReferenceOps

PATHS = ("cpp-packed", "cpp", "aten-mm", "grouped-mm", "reference", "cpp-int8")
ENV = "RAYLM_CPU_MOE"
BUCKETS = (1, 8, 64, 256, 1024)  # token counts up to each edge share one measurement; above the last, one more
# a larger batch is measured on its first MEASURE_TOKENS tokens: a prefill step's size (max_num_batched_tokens'
# default), since which GEMM path wins still changes between 512 and 2048 tokens
MEASURE_TOKENS = 2048
_QUICK_S = 0.01  # a warm run under QUICK is timed best of 3 more, a slower one best of 1 more

log = logging.getLogger(__name__)
_chosen: dict[tuple, str] = {}  # per process: (dtypes, bucket, shape, threads) -> the measured winner
_reference = ReferenceOps()


class PackedMoEWeights(MoEWeights):
    """A layer's experts packed by the kernels' fused_moe_pack: w13 [E, ceil(2I / NR), hidden, NR],
    w2 [E, ceil(hidden / NR), I, NR], in the experts' own dtype."""

    def __init__(self, w13, w2, first_expert: int, num_experts: int, intermediate: int) -> None:
        super().__init__(w13, w2, first_expert, num_experts)
        self.intermediate = intermediate

    @property
    def intermediate_size(self) -> int:
        return self.intermediate


class PackedInt8MoEWeights(Int8MoEWeights):
    """int8 experts packed by the kernels' fused_moe_int8_pack (AVX512-VNNI): w13 [E, 2, Ip, Hp] (gate,
    up) and w2 [E, 1, Hp', Ip'] in panels of 16 rows, zero-padded, with each row's sum (w13_sum, w2_sum)."""

    def __init__(self, packed13, packed2, experts: Int8MoEWeights) -> None:
        super().__init__(packed13[0], packed2[0], experts.first_expert, experts.num_experts, experts.w13_scale,
                         experts.w2_scale)
        self.w13_sum, self.w2_sum = packed13[1], packed2[1]
        self.intermediate = experts.intermediate_size

    @property
    def intermediate_size(self) -> int:
        return self.intermediate

    def gate_up(self, e: int):
        raise TypeError("packed int8 experts run on the CPU table's kernel only")

    down = gate_up


def bucket(tokens: int) -> str:
    """The label of the token-count bucket `tokens` falls in: 'T<=1', 'T<=8', ..., 'T>1024'."""
    for edge in BUCKETS:
        if tokens <= edge:
            return f"T<={edge}"
    return f"T>{BUCKETS[-1]}"


def forced_path() -> str | None:
    path = os.environ.get(ENV)
    if path is not None and path not in PATHS:
        raise ValueError(f"{ENV} must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CPUMoE:
    """One table's MoE: prepares layers' experts, runs the chosen path, remembers what ran."""

    def __init__(self) -> None:
        self.kernels = cpu_kernels.load()
        self.ran: dict[str, str] = {}  # "x/w T<=n" -> the path that ran

    def describe(self) -> str | None:
        """Which path ran per dtypes and tokens bucket, e.g. 'float32/bfloat16 T<=1: cpp', or None."""
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.ran.items())) or None

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor, first_expert: int, num_experts: int,
                dtype: torch.dtype | None = None) -> MoEWeights:
        """Experts narrower than the activations' `dtype` packed for "cpp-packed" (where the kernels
        built and no other path is forced); else as they are (contiguous, in their own dtype: never a
        widened copy)."""
        forced = forced_path()
        narrower = dtype is not None and w13.dtype.itemsize < dtype.itemsize
        if self.kernels is not None and (forced == "cpp-packed" or (forced is None and narrower)):
            return PackedMoEWeights(self.kernels.fused_moe_pack(w13), self.kernels.fused_moe_pack(w2), first_expert,
                                    num_experts, w2.shape[2])
        return MoEWeights(w13.contiguous(), w2.contiguous(), first_expert, num_experts)

    def prepare_int8(self, experts: Int8MoEWeights) -> Int8MoEWeights:
        """int8 experts repacked into the kernel's panels where it has them (AVX512-VNNI) and its path is
        the one that runs; else as they lie."""
        if self.int8_path() != "cpp-int8" or not self.kernels.fused_moe_int8_panels():
            return experts
        return PackedInt8MoEWeights(self.kernels.fused_moe_int8_pack(experts.w13, 2),
                                    self.kernels.fused_moe_int8_pack(experts.w2, 1), experts)

    def int8_path(self) -> str:
        """The path int8 experts run: the kernel, else (not built, or forced) the reference."""
        return "cpp-int8" if self.kernels is not None and forced_path() != "reference" else "reference"

    def candidates(self, x: torch.Tensor, experts: MoEWeights) -> list[str]:
        """The paths that may serve this layer's dtypes here, fastest-first when untimed."""
        if isinstance(experts, Int8MoEWeights):
            return [self.int8_path()]
        if isinstance(experts, PackedMoEWeights):
            return ["cpp-packed"]
        same = experts.w13.dtype == x.dtype
        paths = ["cpp"] if self.kernels is not None else []
        if self.kernels is not None and same:
            paths.append("aten-mm")
        if same and grouped_mm_fits(x, experts):
            paths.append("grouped-mm")
        if not paths:  # no kernels: torch's grouped GEMM over widened hit experts, else the loop
            paths.append("grouped-mm" if grouped_mm_fits(x, experts) else "reference")
        return paths

    def run(self, path: str, x: torch.Tensor, router_logits: torch.Tensor, experts: MoEWeights, top_k: int,
            renormalize: bool) -> torch.Tensor:
        """fused_moe through `path`."""
        packed = isinstance(experts, PackedMoEWeights)
        if packed and path != "cpp-packed":
            raise ValueError(f"these experts are packed for the 'cpp-packed' MoE path, not {path!r}")
        if path == "cpp-packed" and not packed:
            raise ValueError("the 'cpp-packed' MoE path takes experts packed at prepare: set "
                             f"{ENV}=cpp-packed before the model is prepared")
        int8 = isinstance(experts, Int8MoEWeights)
        if (path == "cpp-int8" and not int8) or (int8 and path not in ("cpp-int8", "reference")):
            raise ValueError(f"the MoE path {path!r} does not take {'int8' if int8 else 'float'} experts")
        if isinstance(experts, PackedInt8MoEWeights):
            if path != "cpp-int8":
                raise ValueError(f"these int8 experts are packed for the 'cpp-int8' MoE path, not {path!r}")
            weights, ids = route_tokens(router_logits, top_k, renormalize)
            out = torch.empty_like(x)
            self.kernels.fused_moe_int8_packed(out, x.contiguous(), experts.w13, experts.w13_sum, experts.w13_scale,
                                               experts.w2, experts.w2_sum, experts.w2_scale, ids, weights,
                                               experts.first_expert, experts.intermediate_size)
            return out
        if path == "cpp-int8":
            weights, ids = route_tokens(router_logits, top_k, renormalize)
            out = torch.empty_like(x)
            self.kernels.fused_moe_int8(out, x.contiguous(), experts.w13, experts.w13_scale, experts.w2,
                                        experts.w2_scale, ids, weights, experts.first_expert)
            return out
        if packed:
            weights, ids = route_tokens(router_logits, top_k, renormalize)
            out = torch.empty_like(x)
            self.kernels.fused_moe_packed(out, x.contiguous(), experts.w13, experts.w2, ids, weights,
                                          experts.first_expert, experts.intermediate_size)
            return out
        if path in ("cpp", "aten-mm"):
            if self.kernels is None:
                raise RuntimeError(f"the MoE path {path!r} needs raylm's CPU kernels, which could not be built: "
                                   f"{cpu_kernels.failure()}")
            weights, ids = route_tokens(router_logits, top_k, renormalize)
            out = torch.empty_like(x)
            op = self.kernels.fused_moe if path == "cpp" else self.kernels.fused_moe_mm
            op(out, x.contiguous(), experts.w13.contiguous(), experts.w2.contiguous(), ids, weights,
               experts.first_expert)
            return out
        if path == "grouped-mm":
            if not grouped_mm_fits(x, experts):
                raise ValueError(f"torch._grouped_mm cannot take {x.dtype} rows of hidden {x.shape[-1]} / "
                                 f"intermediate {experts.intermediate_size} (each a multiple of 16 bytes)")
            return grouped_mm_moe(x, router_logits, experts, top_k, renormalize)
        return _reference.fused_moe(x, router_logits, experts, top_k, renormalize)

    def choose(self, x: torch.Tensor, router_logits: torch.Tensor, experts: MoEWeights, top_k: int,
               renormalize: bool) -> str:
        """The forced path, else the process's measured winner for this case (measured now if new)."""
        forced = forced_path()
        if isinstance(experts, Int8MoEWeights):
            return self.int8_path()
        if forced is not None:
            return forced
        paths = self.candidates(x, experts)
        if len(paths) == 1:
            return paths[0]
        key = (x.dtype, experts.w13.dtype, bucket(x.shape[0]), experts.num_local, x.shape[-1],
               experts.intermediate_size, top_k, torch.get_num_threads())
        if key not in _chosen:
            n = min(x.shape[0], MEASURE_TOKENS)
            times = {p: self._time(p, x[:n], router_logits[:n], experts, top_k, renormalize) for p in paths}
            _chosen[key] = min(times, key=times.get)
            log.info("CPU MoE %s/%s %s: %s (%s)", _dtype_name(key[0]), _dtype_name(key[1]), key[2], _chosen[key],
                     ", ".join(f"{p} {t * 1e3:.2f} ms" for p, t in times.items()))
        return _chosen[key]

    def _time(self, path, x, router_logits, experts, top_k, renormalize) -> float:
        """Seconds one call of `path` takes: the best of a warm run (first-call setup) and a few more
        where one is quick (a slow one's setup is a small part of it)."""
        t0 = time.perf_counter()
        self.run(path, x, router_logits, experts, top_k, renormalize)
        best = time.perf_counter() - t0
        for _ in range(3 if best < _QUICK_S else 1):  # the first run pays page faults and packing: never alone
            t0 = time.perf_counter()
            self.run(path, x, router_logits, experts, top_k, renormalize)
            best = min(best, time.perf_counter() - t0)
        return best

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, experts: MoEWeights, top_k: int,
                renormalize: bool) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        path = self.choose(x, router_logits, experts, top_k, renormalize)
        self.ran[f"{_dtype_name(x.dtype)}/{_dtype_name(experts.w13.dtype)} {bucket(x.shape[0])}"] = path
        return self.run(path, x, router_logits, experts, top_k, renormalize)
