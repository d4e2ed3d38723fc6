"""What this CPU can do, as the CPU op table chooses its paths by it."""

from __future__ import annotations

import functools

import torch

# strongest first: the first feature present names the CPU's class
FEATURES = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_class() -> str:
    """'amx_bf16' | 'avx512_bf16' | 'avx512f' | 'avx2' | 'other' (from /proc/cpuinfo, else torch's view)."""
    flags = cpu_flags()
    for name in FEATURES:
        if name in flags:
            return name
    capability = torch.backends.cpu.get_cpu_capability().lower()  # "avx512", "avx2", "default"
    return {"avx512": "avx512f", "avx2": "avx2"}.get(capability, "other")


def _has_ops(backend: str, namespace: str, *names: str) -> bool:
    """torch.backends.<backend> is available and torch.ops.<namespace> has every op named."""
    try:
        ops = getattr(torch.ops, namespace)
        return getattr(torch.backends, backend).is_available() and all(hasattr(ops, n) for n in names)
    except (AttributeError, RuntimeError):
        return False


def has_mkl_packed_linear() -> bool:
    """torch.ops.mkl._mkl_linear over _mkl_reorder_linear_weight (fp32, MKL builds)."""
    return _has_ops("mkl", "mkl", "_mkl_linear", "_mkl_reorder_linear_weight")


def has_onednn_packed_linear() -> bool:
    """torch.ops.mkldnn._linear_pointwise over _reorder_linear_weight (oneDNN builds)."""
    return _has_ops("mkldnn", "mkldnn", "_linear_pointwise", "_reorder_linear_weight")
