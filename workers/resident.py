"""ResidentOutputs: the worker's device buffers, reused every step.

It keeps the large per-step outputs (`logits`, `next_hidden`, sampler scratch, ...) on the
worker's device: a buffer is allocated once per (name, shape, dtype) and reused every
step. Leading (batch) dimensions go through `bucket` so a few buffers serve all batch
sizes; callers slice the rows they use (`get_rows`).
"""

from __future__ import annotations

import operator

import torch

from scheduler.checks import check_int

MIN_BUCKET = 8


def bucket(n: int) -> int:
    """The batch-size bucket for `n` rows: the next power of two, at least 8."""
    check_int("batch size", n, 0)
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    return 1 << (n - 1).bit_length()


class ResidentOutputs:
    """Device buffers cached by (name, shape, dtype): the same key returns the same tensor.

    Buffers are uninitialized (torch.empty) and owned by the cache; `close()` drops them
    all so the device allocator can reuse their memory.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self.num_allocations = 0  # buffers allocated since construction (cache misses)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        try:
            buf = self._buffers.get((name, tuple(shape), dtype))
        except TypeError:  # shape not iterable, or unhashable parts
            buf = None
        if buf is None:
            key = self._check_key(name, shape, dtype)
            buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(key[1], dtype=dtype, device=self.device)
            self._buffers[key] = buf
            self.num_allocations += 1
        return buf

    def get_rows(self, name: str, rows: int, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of the first `rows` rows of the bucketed buffer (bucket(rows), *tail)."""
        return self.get(name, (bucket(rows), *tail), dtype)[:rows]

    @staticmethod
    def _check_key(name, shape, dtype) -> tuple[str, tuple[int, ...], torch.dtype]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"buffer name must be a non-empty string, got {name!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"buffer {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        try:
            dims = tuple(operator.index(d) for d in shape)  # ints only: no floats or bools
            ok = all(d >= 0 and not isinstance(s, bool) for d, s in zip(dims, shape))
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"buffer {name!r}: shape must be a tuple of integers >= 0, got {shape!r}")
        return name, dims, dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by the live buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)

    def close(self) -> None:
        """Free every buffer. The cache stays usable: a later `get` allocates afresh."""
        self._buffers.clear()

    def __enter__(self) -> ResidentOutputs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
