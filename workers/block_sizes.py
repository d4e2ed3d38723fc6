"""KV cache block sizes: each device kind's default and what its attention kernels take.

No torch here: the driver's config (cluster/config.py) resolves and checks the block size
before any worker starts. The NPU's fused kernels (workers/ops/npu.py) take multiples of
16 up to 128 (`_npu_paged_attention`'s limit; FIA alone would go to 512); vllm-ascend uses
only 128, the default here. The CPU and CUDA paths take any size.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16
DEFAULT_NPU_BLOCK_SIZE = 128
MAX_NPU_BLOCK_SIZE = 128


def default_block_size(device: str) -> int:
    return DEFAULT_NPU_BLOCK_SIZE if device == "npu" else DEFAULT_BLOCK_SIZE


def check_npu_block_size(block_size) -> int:
    """block_size if the NPU attention kernels take it (a multiple of 16, at most 128)."""
    if (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 16
            or block_size % 16 or block_size > MAX_NPU_BLOCK_SIZE):
        raise ValueError(f"block_size must be a multiple of 16 between 16 and {MAX_NPU_BLOCK_SIZE} on the NPU "
                         f"(the fused attention kernels refuse others; {DEFAULT_NPU_BLOCK_SIZE} is the default), "
                         f"got {block_size!r}")
    return block_size
