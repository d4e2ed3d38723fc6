"""The figures every contender reports: throughput, latency percentiles, agreement of outputs."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.bench.workload import Workload


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def ms_stats(prefix: str, seconds: list[float]) -> dict:
    """p50, p99 and mean of `seconds` in milliseconds, as `{prefix}_p50_ms` and so on."""
    out = {}
    for name, q in (("p50", 50), ("p99", 99)):
        v = percentile(seconds, q)
        out[f"{prefix}_{name}_ms"] = None if v is None else v * 1e3
    vals = [s for s in seconds if s is not None]
    out[f"{prefix}_mean_ms"] = statistics.fmean(vals) * 1e3 if vals else None
    return out


def throughput_figures(wl: Workload, elapsed: float, generated: int, ttft: list, tpot: list) -> dict:
    """Tokens per second (the tokens asked for) and TTFT / TPOT percentiles of one run."""
    return {
        "elapsed_s": elapsed,
        "num_requests": wl.num_requests,
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,  # the tokens the requests asked for
        "generated_tokens": generated,  # what the system computed (more when it runs past a request's length)
        "output_tok_s": wl.output_tokens / elapsed,
        "total_tok_s": (wl.prompt_tokens + wl.output_tokens) / elapsed,
        **ms_stats("ttft", ttft), **ms_stats("tpot", tpot),
    }


def time_per_output_token(first: float | None, last: float | None, n: int) -> float | None:
    """Seconds per token after the first, from the first and last token's times (None for one token)."""
    return (last - first) / (n - 1) if n > 1 and first is not None and last is not None else None


def agreement(outs: list[list[int]], ref: list[list[int]] | None) -> dict:
    """How often a contender made the reference run's first token, and its whole sequence."""
    if ref is None:
        return {}
    n = len(ref)
    return {"first_token_agreement": sum(bool(a) and bool(b) and a[0] == b[0] for a, b in zip(outs, ref)) / n,
            "sequence_agreement": sum(a == b for a, b in zip(outs, ref)) / n}
