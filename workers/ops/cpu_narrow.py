"""fp32 weights that a bf16 checkpoint widened at load, read at bf16's width.

A bf16 checkpoint computes in fp32 on a CPU without fast bf16 matmuls. Its weights' values are bf16
values, so a bf16 copy read by raylm's narrow linear (csrc/narrow_linear.cpp: packed in panels,
widened in registers, fp32 arithmetic) gives fp32's products from half the bytes: at decode sizes,
bound by reading the weight, it is faster; at prefill sizes it runs about as fast as the library's
fp32 GEMM. Which it is on this CPU is measured once per weight shape when the weights are prepared,
at a few batch sizes up to a prefill chunk's (fewer for the lm_head, whose every probe is long):

- narrow only, where the bf16 copy is never slower than the wide GEMM by more than TOLERANCE (50%)
  at any probe: the wide copy is not kept (a model's fp32 weight may then be released: half the
  bytes resident);
- both, up to a crossover, where the wide GEMM wins big batches clearly: the bf16 copy for batches
  of up to the largest probe where it measured faster, the wide one past it;
- wide only, where the bf16 copy never measured faster.

Only weights of at least NARROW_MIN_ELEMENTS elements whose every value is a bf16 value qualify.
RAYLM_CPU_NARROW_LINEAR=off turns it off; =all keeps the bf16 copy only; =N uses it for batches of
up to N rows, the wide GEMM beyond.
"""

from __future__ import annotations

import os
import time

import torch

ENV = "RAYLM_CPU_NARROW_LINEAR"
NARROW_MIN_ELEMENTS = 1 << 18  # a real layer's projections and MoE router (128 x 2048); not a tiny model's
PROBE_ROWS = (1, 16, 64, 256)  # batch sizes probed: decode to a prefill chunk's
PROBE_MAX_MACS = 1 << 33  # a probe past one this long is skipped (the lm_head's beyond 16 rows)
# how much slower than the wide GEMM the bf16 copy may measure and still serve alone. One copy instead
# of two halves a bf16 checkpoint's resident bytes (room for KV); the bf16 copy measured at worst
# 0.83x oneDNN's fp32 GEMM at prefill sizes on an AVX2 Zen 3, and one start's timings there differ
# from the next's by 10-20%, so a tighter bound kept or dropped the fp32 copy by chance
TOLERANCE = 1.5
ALL = -1  # max_rows of a weight kept narrow only


class NarrowWeight:
    """A prepared linear: a bf16 copy (packed by the kernel), used for batches of up to max_rows
    rows, and the wide handle for larger ones (None: narrow only, every batch)."""

    def __init__(self, wide, narrow: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 max_rows: int) -> None:
        self.wide, self.narrow, self.bias, self.max_rows = wide, narrow, bias, max_rows
        self.out_features = out_features

    def takes(self, x: torch.Tensor) -> bool:
        return self.wide is None or (x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] <= self.max_rows)


def forced_rows() -> int | None:
    """None: measure; 0: off; ALL: narrow only; N: the bf16 path up to N rows (RAYLM_CPU_NARROW_LINEAR)."""
    raw = os.environ.get(ENV)
    if raw is None:
        return None
    if raw == "off":
        return 0
    if raw == "all":
        return ALL
    if not raw.isdigit():
        raise ValueError(f"{ENV} must be 'off', 'all' or a number of rows, got {raw!r}")
    return int(raw)


def bf16_copy(kernels, weight: torch.Tensor) -> torch.Tensor | None:
    """weight in bf16, packed for the kernel, when it qualifies (big, fp32, every value a bf16
    value), else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.numel() < NARROW_MIN_ELEMENTS:
        return None
    narrow = weight.to(torch.bfloat16)
    return kernels.narrow_pack(narrow) if torch.equal(narrow.to(torch.float32), weight) else None


def narrow_linear(kernels, x: torch.Tensor, handle: NarrowWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (fp32) -> [..., out'] through the bf16 copy, into `out` (2-d x: its first out'
    columns) if given."""
    return packed_linear(kernels.narrow_linear, x, handle.narrow, handle.out_features, handle.bias, torch.float32, out)


def packed_linear(op, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                  dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out_features] in `dtype` by a kernel op(y, x 2-d, packed) that writes y's
    columns from a weight it packed; into `out` (2-d x: its first columns) if given; the bias added."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = out if out is not None else torch.empty(x2.shape[0], out_features, dtype=dtype)
    op(y, x2, packed)
    if bias is not None:
        y += bias[: y.shape[1]]
    return y if out is not None or x.dim() == 2 else y.view(*x.shape[:-1], out_features)


def choose_rows(mine, theirs, out_features: int, in_features: int, tolerance: float = TOLERANCE,
                dtype: torch.dtype = torch.float32) -> int:
    """Measured on this CPU for one linear [out_features, in_features] computed two ways, mine(x)
    and theirs(x) for x [rows, in_features] in dtype: ALL where mine never measured slower than theirs by
    more than `tolerance`, else the largest probed batch size up to which mine measured faster (and
    at every probe before it), or 0. Each probe is the best of three timed calls after
    a warm one, and of five more of each where mine lost by more than `tolerance`."""
    crossover, always = 0, True
    for rows in PROBE_ROWS:
        if rows > 1 and rows * out_features * in_features > PROBE_MAX_MACS:
            break
        x = torch.randn(rows, in_features, dtype=dtype)
        a, b = best_of(lambda: mine(x), runs=3), best_of(lambda: theirs(x), runs=3)  # noqa: B023 (called at once)
        if a > b * tolerance:  # timed again before it decides: a busy moment of the host is not the kernel
            a = min(a, best_of(lambda: mine(x), runs=5))  # noqa: B023
            b = min(b, best_of(lambda: theirs(x), runs=5))  # noqa: B023
        always = always and a <= b * tolerance
        if a < b and crossover == rows_before(rows):
            crossover = rows
    return ALL if always else crossover


def rows_before(rows: int) -> int:
    """The probe before `rows` (0 before the first): a crossover grows only while each probe wins."""
    i = PROBE_ROWS.index(rows)
    return PROBE_ROWS[i - 1] if i else 0


def best_of(f, runs: int = 2) -> float:
    """Seconds of the best of `runs` calls of f after a warm one."""
    f()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best
