"""bf16 weights in raylm's own packing (csrc/packed_bf16_linear.cpp), on CPUs with AVX512-BF16.

Two engines compute over the one layout: AMX tiles where the CPU has AMX-BF16 (a Xeon since Sapphire
Rapids), else AVX512-BF16's vdpbf16ps (AMD's Zen 4 and Zen 5): `engine()` says which, and stats' linear
path names it ("amx-bf16" or "dpbf16-packed"). oneDNN's bf16 inner product runs the same instructions
over weights reordered into its own, opaque layout. raylm's layout is known, so rows can be read back
from it: a tied embedding's lookups are served by the lm_head's packed copy and the embedding is freed
(one 151,936 x hidden table instead of two). The kernel also folds greedy sampling into the lm_head
(each row's argmax as the sums come out, no [B, V] logits written). Its products are oneDNN's up to the
order of fp32 sums (equal bit for bit at up to 32 rows on the lm_head's shape on AMX; past that about
one output in 10,000 rounds to the neighbouring bf16 value). AMX's tiles are tuned for decode sizes
(at 2,048 rows oneDNN's GEMM is faster on a layer's shapes); vdpbf16ps keeps up with oneDNN at every
size measured.

Which runs is measured once per weight shape when the weights are prepared (the probes of
cpu_narrow.py): raylm's packing serves a weight only where it is never slower than oneDNN's by more
than TOLERANCE at any probe, and then alone: one copy either way. RAYLM_CPU_PACKED_BF16=off turns it
off; =all uses it for every bf16 weight it can take (any size).
"""

from __future__ import annotations

import os

import torch

from workers.ops.cpu_narrow import NARROW_MIN_ELEMENTS, PROBE_MAX_MACS, best_of, packed_linear

ENV = "RAYLM_CPU_PACKED_BF16"
TILE_K = 32  # the kernel takes widths that are a multiple of a tile's 32 columns
PROBE_ROWS = (1, 16, 64, 256, 2048)  # decode to a prefill chunk
# how much slower than oneDNN's GEMM raylm's packing may measure at any probe and still serve (it holds
# one copy either way: what it buys is the lm_head's fused argmax and a tied embedding held once)
TOLERANCE = 1.1


class PackedBF16Weight:
    """A bf16 weight [out, in] in raylm's packing (the only copy of it)."""

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> None:
        self.packed, self.out_features, self.bias = packed, out_features, bias


def forced() -> str | None:
    """None: measure; "off" or "all" (RAYLM_CPU_PACKED_BF16)."""
    raw = os.environ.get(ENV)
    if raw is not None and raw not in ("off", "all"):
        raise ValueError(f"{ENV} must be 'off' or 'all', got {raw!r}")
    return raw


def available(kernels) -> bool:
    return kernels is not None and bool(kernels.packed_bf16_available())


def engine(kernels) -> str:
    """"amx" or "dpbf16": what the packed linear computes on in this process ("" where it was not built)."""
    return kernels.packed_bf16_engine() if kernels is not None else ""


def path_name(kernels) -> str:
    """The linear path's name in stats()["ops"]["linear"]."""
    return "amx-bf16" if engine(kernels) == "amx" else "dpbf16-packed"


def qualifies(kernels, weight: torch.Tensor) -> bool:
    """A bf16 2-d weight the kernel can take, big enough to be worth measuring (any size when forced)."""
    mode = forced()
    if mode == "off" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % TILE_K:
        return False
    return available(kernels) and (mode == "all" or weight.numel() >= NARROW_MIN_ELEMENTS)


def pack(kernels, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedBF16Weight:
    return PackedBF16Weight(kernels.packed_bf16_pack(weight), weight.shape[0], bias)


def linear(kernels, x: torch.Tensor, handle: PackedBF16Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (bf16) -> [..., out] (bf16), or into `out` (2-d x: out's columns, bf16 or fp32)."""
    return packed_linear(kernels.packed_bf16_linear, x, handle.packed, handle.out_features, handle.bias, torch.bfloat16,
                         out)


def faster(kernels, wide_linear, wide, handle: PackedBF16Weight) -> bool:
    """Whether raylm's packing measured no slower than TOLERANCE x the library GEMM at every probe
    (each the best of three calls after a warm one, of five more where it lost by more)."""
    out_features, in_features = handle.out_features, handle.packed.shape[1] * 2
    for rows in PROBE_ROWS:
        if rows > 1 and rows * out_features * in_features > PROBE_MAX_MACS:
            break
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        mine = best_of(lambda: linear(kernels, x, handle), runs=3)  # noqa: B023 (called at once)
        theirs = best_of(lambda: wide_linear(x, wide), runs=3)  # noqa: B023
        if mine > theirs * TOLERANCE:  # timed again before it decides: a busy moment of the host is not the kernel
            mine = min(mine, best_of(lambda: linear(kernels, x, handle), runs=5))  # noqa: B023
            theirs = min(theirs, best_of(lambda: wide_linear(x, wide), runs=5))  # noqa: B023
        if mine > theirs * TOLERANCE:
            return False
    return True
