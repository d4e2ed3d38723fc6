"""raylm's own CPU kernels (workers/ops/csrc/), compiled once per machine and cached.

Built with torch's C++ extension builder (g++ and ninja; -O3 -march=native -fopenmp, so the
build is this CPU's) into RAYLM_KERNEL_CACHE (default ~/.cache/raylm/kernels), under a name
that hashes the sources, torch's version, the compiler flags and this CPU's feature flags: a
second start, another worker, another process or another checkout of the same sources on the
same machine loads the built library in milliseconds (it is built from copies of the sources kept
there); a different CPU or torch builds its own. Concurrent builders wait on torch's
lock in the build directory. Each load marks its build as used; a fresh build removes the builds
no process has loaded for UNUSED_DAYS (each source change leaves one behind, a few MB).

`load()` returns the module, or None when it cannot be built here (no compiler, no headers):
the CPU table then keeps the gather + SDPA path, eager elementwise ops and torch's grouped GEMM
for MoE experts, the CPU sampler its torch draw, and stats() says so.
`python -m workers.ops.cpu_kernels` builds it ahead of time (make venv does) and prints where.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from workers.ops.cpu_features import cpu_flags

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "elementwise.cpp", _CSRC / "sampling.cpp", _CSRC / "fused_moe.cpp",
           _CSRC / "narrow_linear.cpp", _CSRC / "packed_bf16_linear.cpp", _CSRC / "int8_linear.cpp",
           _CSRC / "prefill_attention.cpp", _CSRC / "amx_int8_linear.cpp")
HEADERS = (_CSRC / "vec_math.h", _CSRC / "moe_gemv.h", _CSRC / "panel_gemm.h", _CSRC / "int8_dot.h",
           _CSRC / "row_best.h", _CSRC / "amx_tiles.h", _CSRC / "huge_pages.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")  # no FP traps: branch-free math vectorizes
ENV_CACHE = "RAYLM_KERNEL_CACHE"
PREFIX = "raylm_cpu_kernels_"
UNUSED_DAYS = 14  # a build no process loaded for this long is removed when another is built

log = logging.getLogger(__name__)
_failure: str | None = None


def cache_root() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "raylm" / "kernels")


def build_name() -> str:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join((torch.__version__, sys.version, *CFLAGS, *sorted(cpu_flags()))).encode())
    return f"{PREFIX}{h.hexdigest()[:16]}"


@functools.lru_cache(maxsize=1)
def load():
    """torch.ops.raylm with the compiled kernels registered, or None (failure() says why)."""
    global _failure
    if sys.platform != "linux":
        _failure = f"raylm's CPU kernels build on Linux only, not {sys.platform}"
        return None
    try:
        from torch.utils import cpp_extension

        name = build_name()
        build_dir = cache_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        fresh = not any(build_dir.glob("*.so"))
        sources = _content_addressed_sources(build_dir)
        cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=list(CFLAGS),
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
                           verbose=False)
        module = torch.ops.raylm
        with contextlib.suppress(OSError):  # a read-only cache: nothing there is pruned either
            os.utime(build_dir)  # used now: kept by prune_unused
        if fresh:
            log.info("built raylm's CPU kernels in %.0f s (%s)", time.perf_counter() - t0, build_dir)
            prune_unused(cache_root(), keep=name)
        return module
    except Exception as e:  # any build failure leaves the torch paths in place
        _failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("raylm's CPU kernels could not be built (%s); attention gathers, elementwise ops run eager, "
                    "sampling draws with torch ops",
                    _failure)
        return None


def prune_unused(root: Path, keep: str, days: float = UNUSED_DAYS) -> list[str]:
    """Remove the builds under root (directories named PREFIX...) that no process has loaded for
    `days` (their mtime, which each load sets), but `keep`; returns their names. A build another
    process holds loaded stays usable (its library is mapped); one that starts later builds again."""
    cutoff = time.time() - days * 86400
    removed = []
    for d in root.glob(PREFIX + "*"):
        try:
            if d.name != keep and d.is_dir() and d.stat().st_mtime < cutoff:
                shutil.rmtree(d)
                removed.append(d.name)
        except OSError:  # another process removed it, or it is not ours to remove
            continue
    if removed:
        log.info("removed %d CPU kernel build(s) unused for %g days from %s", len(removed), days, root)
    return removed


def _content_addressed_sources(build_dir: Path) -> list[Path]:
    """The sources (and headers) copied under build_dir, whose name hashes their content, and built
    from there: ninja keys its build on the sources' paths, so two checkouts of the same sources on one
    machine (a clone and a worktree, say) built from their own paths rebuilt each other's library at
    every process start (~25 s of g++ in the first worker). Copies go in by rename, so concurrent
    starts never see half a file."""
    src_dir = build_dir / "src"
    src_dir.mkdir(exist_ok=True)
    copies = []
    for src in (*SOURCES, *HEADERS):
        dst = src_dir / src.name
        data = src.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            tmp = src_dir / f".{src.name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        copies.append(dst)
    return copies[:len(SOURCES)]


def load_unless(env: str, off: str):
    """load(), unless the environment variable `env` is `off` (then None); `env`=fused makes
    a build failure an error instead of the torch path. Any other value is a ValueError."""
    forced = os.environ.get(env)
    if forced is not None and forced not in (off, "fused"):
        raise ValueError(f"{env} must be {off} or fused, got {forced!r}")
    if forced == off:
        return None
    kernels = load()
    if kernels is None and forced == "fused":
        raise RuntimeError(f"{env}=fused, but raylm's CPU kernels could not be built: {failure()}")
    return kernels


def failure() -> str | None:
    """Why load() returned None (after it did)."""
    return _failure


def main() -> int:
    t0 = time.perf_counter()
    module = load()
    if module is None:
        print(f"raylm CPU kernels: not built ({failure()})")
        return 1
    print(f"raylm CPU kernels: {cache_root() / build_name()} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
