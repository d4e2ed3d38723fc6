"""cpu / cuda / npu: everything else in raylm asks this module about the device.

Device kinds are plain strings. Ray assigns accelerators by setting the visible-devices
variable (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES) before an actor starts, so
inside a worker the devices it owns are numbered from 0 and `torch_device(kind)` means
the first of them.

torch_npu is imported lazily, and only for the "npu" kind: importing it without the
Ascend CANN toolkit breaks `import torch`, so no other code path may touch it.
"""

from __future__ import annotations

import os
import sys

import torch

from scheduler.checks import check_fraction, check_int
from workers.runner_config import DEVICE_KINDS as KINDS

_DIST_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_RAY_RESOURCE = {"cpu": None, "cuda": "GPU", "npu": "NPU"}
_VISIBLE_ENV = {"cpu": None, "cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


class DeviceUnavailableError(RuntimeError):
    """The requested device kind is known but not usable in this process."""


def check_kind(kind: str) -> str:
    """Return `kind` if it names a supported device kind, else raise ValueError naming it."""
    if kind not in KINDS:
        raise ValueError(f"unknown device kind {kind!r}; expected one of {', '.join(KINDS)}")
    return kind


def _import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError as e:
        raise DeviceUnavailableError(
            "device kind 'npu' needs torch-npu and the Ascend CANN toolkit "
            f"(pip install 'raylm[npu]'); importing torch_npu failed: {e}"
        ) from e
    return torch.npu  # type: ignore[attr-defined]


def _backend(device: torch.device):
    """The torch submodule (torch.cuda / torch.npu) for an accelerator device."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return _import_torch_npu()
    raise ValueError(f"unsupported device {device}; expected one of {', '.join(KINDS)}")


def torch_device(kind: str, index: int | None = None) -> torch.device:
    """The torch.device for `kind`; `index` counts among the visible devices (default 0)."""
    check_kind(kind)
    check_int("device index", index, 0, optional=True)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise DeviceUnavailableError(
                "device kind 'cuda' was requested but CUDA is not available in this process "
                f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
                f"CUDA_VISIBLE_DEVICES={env!r}); use device='cpu' or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
    else:
        npu = _import_torch_npu()
        if not npu.is_available():
            env = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
            raise DeviceUnavailableError(
                f"device kind 'npu' was requested but no NPU is visible (ASCEND_RT_VISIBLE_DEVICES={env!r})"
            )
        count = npu.device_count()
    index = 0 if index is None else index
    if index >= count:
        raise ValueError(f"device index {index} is out of range: {count} {kind} device(s) visible")
    return torch.device(kind, index)


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type != "cpu":
        _backend(device).synchronize(device)


def bind_device(device: torch.device) -> None:
    """Make `device` the calling thread's current device (torch keeps it per thread; a no-op
    on the CPU)."""
    device = torch.device(device)
    if device.type != "cpu":
        _backend(device).set_device(device)


def record_event(device: torch.device):
    """An event on `device`'s current stream; its `synchronize()` waits for the work queued
    before it. None on the CPU, where work is done when it returns."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    backend = _backend(device)
    event = backend.Event()
    event.record(backend.current_stream(device))
    return event


def _cpu_memory_info() -> tuple[int, int]:
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024  # values are in kB
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def memory_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`; on the CPU, available and total system memory."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_memory_info()
    free, total = _backend(device).mem_get_info(device)
    return int(free), int(total)


def dist_backend(kind: str) -> str:
    """The torch.distributed backend for `kind`: gloo, nccl or hccl."""
    return _DIST_BACKEND[check_kind(kind)]


def ray_resource_key(kind: str) -> str | None:
    """The Ray resource an actor of `kind` asks for: "GPU", "NPU", or None (CPUs only)."""
    return _RAY_RESOURCE[check_kind(kind)]


def visible_devices_env(kind: str) -> str | None:
    """The variable Ray sets to hand devices of `kind` to an actor (None for the CPU)."""
    return _VISIBLE_ENV[check_kind(kind)]


CPU_KV_BYTES = 1 << 30  # what the default CPU KV pool may take, beyond its floor
CPU_MIN_BLOCKS = 512  # the default pool's floor, whatever the block size


def default_cpu_blocks(bytes_per_block: int, *, max_num_seqs: int, blocks_per_seq: int) -> int:
    """The CPU KV pool when num_kv_blocks is not set: room for every slot at max_model_len
    (more would never be used but by the prefix cache), within CPU_KV_BYTES, and never
    fewer than CPU_MIN_BLOCKS. E.g. the bundled tiny model at 64 slots of 4,096 tokens:
    16,384 blocks (512 MiB); a Qwen3-0.6B in fp32: 512 blocks (1.8 GiB)."""
    return max(2, min(max_num_seqs * blocks_per_seq, max(CPU_MIN_BLOCKS, CPU_KV_BYTES // bytes_per_block)))


def num_kv_blocks(
    device: torch.device, *, bytes_per_block: int, memory_fraction: float, cpu_blocks: int | None
) -> int:
    """How many KV cache blocks to allocate.

    On an accelerator: `memory_fraction` of the device's total memory may be used by this
    process in all (weights already loaded included, as vLLM's gpu_memory_utilization),
    and the KV cache gets what is left of it now; `cpu_blocks` is ignored. On the CPU:
    exactly `cpu_blocks`, which must fit in the available memory.
    """
    device = torch.device(device)
    check_int("bytes_per_block", bytes_per_block, 1)
    free, total = memory_info(device)
    if device.type == "cpu":
        check_int("cpu_blocks", cpu_blocks, 1)
        if cpu_blocks * bytes_per_block > free:
            raise ValueError(
                f"cpu_blocks={cpu_blocks} needs {cpu_blocks * bytes_per_block} bytes "
                f"but only {free} bytes of memory are available"
            )
        return cpu_blocks
    check_fraction("memory_fraction", memory_fraction)
    used = total - free
    budget = int(total * memory_fraction) - used
    blocks = budget // bytes_per_block
    if blocks <= 0:
        raise ValueError(
            f"no memory left for the KV cache on {device}: memory_fraction={memory_fraction} "
            f"allows {int(total * memory_fraction)} of {total} bytes but {used} are already in use; "
            "raise memory_fraction or use a smaller model"
        )
    return int(blocks)


def set_cpu_threads(n: int | None) -> None:
    """Set torch's intra-op threads to `n` (None: the CPUs this process may run on).

    Inter-op threads are set to 1 (a worker runs one forward at a time) when torch still
    allows it; torch refuses once parallel work has started, and that is left as is.
    """
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    check_int("cpu threads", n, 1)
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set, or inter-op work already ran: torch allows it only once


HOST_HEAP_ENV = "RAYLM_CPU_HEAP"  # "keep" (the default) | "release": glibc's own thresholds
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameter numbers
_HEAP_KEEP = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 256 << 20))
_heap_mode: str | None = None


def keep_host_heap() -> str:
    """Keep freed host memory in this process's heap for reuse ("kept"), where glibc would give
    it back to the kernel: by default each freed block over 32 MiB (a prefill chunk's [T, N]
    GEMM output, its int8 activations) is unmapped, and the heap's top trimmed, so every step
    faults those pages in again, zeroed, before a kernel writes them. Raising the mmap and trim
    thresholds (as the MALLOC_*_ environment variables would, or vLLM's advice to preload
    tcmalloc) costs resident memory up to the steps' peak and no more. Process-wide, set once;
    -> "kept", "release" (RAYLM_CPU_HEAP=release) or "glibc-absent"."""
    global _heap_mode
    if _heap_mode is None:
        want = os.environ.get(HOST_HEAP_ENV, "keep")
        if want not in ("keep", "release"):
            raise ValueError(f"{HOST_HEAP_ENV} must be keep or release, got {want!r}")
        _heap_mode = "release" if want == "release" else _mallopt(_HEAP_KEEP)
    return _heap_mode


def _mallopt(settings) -> str:
    import ctypes
    import ctypes.util
    import platform

    if platform.libc_ver()[0] != "glibc":
        return "glibc-absent"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = all(libc.mallopt(ctypes.c_int(k), ctypes.c_int(v)) == 1 for k, v in settings)
    return "kept" if ok else "glibc-refused"


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's madvise advice number


def host_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor backed by 2 MiB pages where Linux grants them (madvise MADV_HUGEPAGE before
    the pages are first touched; transparent huge pages in "madvise" mode, the common default, give
    them to no allocation that does not ask). For what kernels read in scattered pieces, the KV pool's
    blocks: a 4 KiB page covers an eighth of a Qwen3-0.6B block, so every block read walked the page
    tables and restarted the hardware prefetcher eight times. Elsewhere, or refused, plain pages."""
    t = torch.empty(shape, dtype=dtype)
    if sys.platform.startswith("linux") and t.numel() * t.element_size() >= 2 * HUGE_PAGE:
        import ctypes

        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the allocation
        end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_HUGEPAGE))
    return t.zero_()


def native_half_matmul(device: torch.device) -> bool:
    """Whether bf16/fp16 matrix products run at full speed on `device`.

    Accelerators: yes. A CPU: only with AVX512-BF16 or AMX; elsewhere (AVX2, for one)
    torch's bf16 GEMM runs several times slower than its fp32 GEMM (benchmarks/bench_gemm.py).
    """
    if device.type != "cpu":
        return True
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def compute_dtype(device: torch.device, weights_dtype: torch.dtype, requested: torch.dtype | None = None,
                  native_half: bool | None = None) -> torch.dtype:
    """The dtype a model computes in: `requested` when given; otherwise its weights' dtype,
    except half-precision weights on a CPU without native half matmuls, which compute in
    float32 (upcast once at load: exact, twice the memory, several times the speed)."""
    if requested is not None:
        return requested
    if weights_dtype in (torch.bfloat16, torch.float16):
        if not (native_half_matmul(device) if native_half is None else native_half):
            return torch.float32
    return weights_dtype
