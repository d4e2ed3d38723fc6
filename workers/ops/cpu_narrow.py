"""Big fp32 weights that a bf16 checkpoint widened at load, also kept in bf16 for small batches.

A bf16 checkpoint computes in fp32 on a CPU without fast bf16 matmuls. Its lm_head (151,936 rows)
is the largest weight a decode step reads, and at a few rows a step the fp32 GEMM is bound by
reading it. Its values are bf16 values, so a bf16 copy read by raylm's narrow linear
(csrc/narrow_linear.cpp: widened in registers, fp32 arithmetic) gives the same products from half
the bytes. Past some number of rows the GEMM becomes bound by arithmetic and the packed fp32 path
wins again; that crossover is measured once per weight when it is prepared, on this CPU.

Only weights of at least NARROW_MIN_ELEMENTS elements whose every value is a bf16 value qualify.
RAYLM_CPU_NARROW_LINEAR=off turns it off; =N forces the bf16 path for batches of up to N rows.
"""

from __future__ import annotations

import os
import time

import torch

ENV = "RAYLM_CPU_NARROW_LINEAR"
NARROW_MIN_ELEMENTS = 1 << 25  # the lm_head / embeddings of real models, not their layers' projections
PROBE_ROWS = (1, 8, 16, 32, 64)  # batch sizes the crossover is measured at (decode-sized)


class NarrowWeight:
    """A prepared linear: the wide handle, and a bf16 copy used for batches of up to max_rows rows."""

    def __init__(self, wide, narrow: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> None:
        self.wide, self.narrow, self.bias, self.max_rows = wide, narrow, bias, max_rows
        self.out_features = narrow.shape[0]

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] <= self.max_rows


def forced_rows() -> int | None:
    """None: measure; 0: off; N: the bf16 path up to N rows (RAYLM_CPU_NARROW_LINEAR)."""
    raw = os.environ.get(ENV)
    if raw is None:
        return None
    if raw == "off":
        return 0
    if not raw.isdigit():
        raise ValueError(f"{ENV} must be 'off' or a number of rows, got {raw!r}")
    return int(raw)


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """weight in bf16 when it qualifies (big, fp32, every value a bf16 value), else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.numel() < NARROW_MIN_ELEMENTS:
        return None
    narrow = weight.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(torch.float32), weight) else None


def narrow_linear(kernels, x: torch.Tensor, handle: NarrowWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] (fp32) -> [m, out'] through the bf16 copy, into `out` (its first out' columns) if given."""
    if out is None:
        out = torch.empty(x.shape[0], handle.out_features, dtype=torch.float32)
    kernels.narrow_linear(out, x.contiguous(), handle.narrow)
    if handle.bias is not None:
        out += handle.bias[: out.shape[1]]
    return out


def crossover(kernels, wide_linear, wide, narrow: torch.Tensor) -> int:
    """The largest probed batch size up to which the bf16 path measured faster than the wide one
    (0 where it never did): each timed best of two after a warm run."""
    probe = NarrowWeight(wide, narrow, None, max(PROBE_ROWS))
    best = 0
    for rows in PROBE_ROWS:
        x = torch.randn(rows, narrow.shape[1])
        mine = _best_of(lambda: narrow_linear(kernels, x, probe))  # noqa: B023 (called at once)
        theirs = _best_of(lambda: wide_linear(x, wide))  # noqa: B023
        if mine >= theirs:
            break
        best = rows
    return best


def _best_of(f, runs: int = 2) -> float:
    """Seconds of the best of `runs` calls of f after a warm one."""
    f()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best
