"""A torch.profiler run sorted into what a step spends its time on, the same way for both engines.

Rows come from `vllm_peer.op_rows` (op name, input shapes, self CPU time, calls): raylm's bare
step loop profiled in this process, vLLM's in its peer process with the engine core in-process.
Self times of the calling thread add up to the time spent inside ops; the run's wall time less
that sum is the time between ops (Python, scheduling, the host's bookkeeping). Worker threads of
an op's parallel region are not counted separately: an op's self time is its wall on the caller.
"""

from __future__ import annotations

# Op-name fragments per category, first match wins; GEMMs are split by shape afterwards.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GEMM, quantized layers (with their activations' quantization and scales)",
     ("qlinear", "int_mm", "int8", "int4pack", "scaled_mm", "scale_rows", "quant")),
    ("GEMM", ("narrow_linear", "onednn_mm", "mkldnn", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
              "aten::linear", "weight_packed_linear", "_linear")),
    ("attention", ("attention", "attn", "scaled_dot_product", "sdpa", "flash")),
    ("norms, RoPE, SwiGLU", ("rms_norm", "rope", "rotary", "silu", "gelu", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("sampling over the vocab", ("argmax", "topk", "sort", "softmax", "sample", "multinomial", "exponential",
                                 "aten::max", "penalt", "aten::div")),
    ("compiled elementwise (inductor)", ("compiled", "torch-compiled", "inductor", "graph")),
    ("copies, indexing, cache writes", ("copy", "index", "cat", "embedding", "packed_bf16_rows", "gather", "scatter",
                                        "reshape_and_cache", "aten::to", "clone", "fill", "zero", "empty", "stack",
                                        "slice", "select", "view", "contiguous", "narrow", "aten::as_strided",
                                        "pin_memory")),
)
BETWEEN = "between ops (Python, scheduler, host)"


def category(op: str, shapes: str, vocab_size: int) -> str:
    low = op.lower()
    for name, fragments in CATEGORIES:
        if any(f.lower() in low for f in fragments):
            if name == "GEMM":  # the lm_head's weight has the vocab's rows; fused with the argmax, no shape says so
                lm_head = str(vocab_size) in shapes or "argmax" in low
                return "GEMM, lm_head" if lm_head else "GEMM, layers"
            return name
    return "other ops"


def summarize(rows: list[dict], wall_s: float, vocab_size: int) -> dict[str, float]:
    """Seconds per category, plus the time between ops; the values add up to wall_s."""
    out: dict[str, float] = {}
    for r in rows:
        key = category(r["op"], r["shapes"], vocab_size)
        out[key] = out.get(key, 0.0) + r["self_us"] / 1e6
    out[BETWEEN] = max(0.0, wall_s - sum(out.values()))
    return out


def top_ops(rows: list[dict], n: int) -> list[dict]:
    """The n rows with the most self time, for a look at what the categories hold."""
    return sorted(rows, key=lambda r: r["self_us"], reverse=True)[:n]
