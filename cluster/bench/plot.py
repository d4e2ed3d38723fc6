"""`raylm bench --plot`: throughput against batch size (or bars), or against request rate
beside the latency percentiles for `--serve`. Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.bench.suite import Bench


def plot(bench: Bench, path: str) -> None:
    """Write the PNG of this invocation's throughput (and latency, for --serve) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{bench.model_spec}, {bench.a.dtype} weights, {bench.wl.num_requests} requests"
    if bench.serve_runs:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        rates = [r.rounds[0]["rate"] for r in bench.serve_runs]
        finite = [x for x in rates if math.isfinite(x)]
        inf_x = 2 * max(finite) if finite else 1.0
        xs = [x if math.isfinite(x) else inf_x for x in rates]
        ax.plot(xs, [r.rounds[0]["output_tok_s"] for r in bench.serve_runs], "o-", label="raylm")
        for k, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("tpot_p50_ms", "s-"), ("itl_p99_ms", "s--")):
            ax2.plot(xs, [r.rounds[0][k] for r in bench.serve_runs], style, label=k.replace("_ms", " (ms)"))
        for a_ in (ax, ax2):
            a_.set_xticks(xs, [f"{x:g}" for x in rates])
            a_.set_xlabel("request rate (req/s)")
        ax.set_ylabel("output tokens/s")
        ax2.set_ylabel("ms")
        ax2.set_yscale("log")
        ax2.legend(fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        groups: dict[str, list] = {}
        for r in bench.runs:
            if r.rounds:
                base = r.name.split(" b=")[0]
                groups.setdefault(base, []).append((r.spec.batch_size, r.summary()["output_tok_s"]))
        if len(bench.a.batch_size) > 1:
            for name, pts in groups.items():
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size (max sequences per step)")
            ax.legend(fontsize=8)
        else:
            names = list(groups)
            bars = ax.bar(names, [groups[n][0][1] for n in names])
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.set_xlabel(f"batch size {bench.a.batch_size[0]}")
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.set_ylabel("output tokens/s (tokens asked for)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
