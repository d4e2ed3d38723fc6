"""StepStaging: the one host->device copy of a step's small inputs, through buffers reused every step.

A step's integer inputs (token ids, positions, slot mapping, block tables, indices) and the
few float32 values it must write (the sampling parameters of requests that just arrived)
are packed into one int64 host buffer, copied to the device in one transfer, and split
into views there. On accelerators the host buffer is pinned (page-locked), so the copy is
asynchronous and never waits for the forward queued before it. Both buffers grow by
doubling and are reused; nothing is allocated per step once they are big enough.

Float32 values travel bit for bit: two of them per int64 element, viewed back as float32
on the device.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from workers.device import record_event

MIN_ELEMENTS = 1024


class StepStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None  # [capacity] int64, pinned on accelerators
        self._host_np: np.ndarray | None = None  # the same memory, for filling from lists
        self._dev: torch.Tensor | None = None  # [capacity] int64 on the device (the host buffer on the CPU)
        self._copied = None  # event after the last copy: the host buffer is free once it has passed
        self.num_allocations = 0

    def _reserve(self, n: int) -> None:
        if self._host is not None and self._host.numel() >= n:
            return
        capacity = max(MIN_ELEMENTS, 1 << max(0, n - 1).bit_length())
        host = torch.empty(capacity, dtype=torch.int64)
        if self.device.type != "cpu":
            host = host.pin_memory()
        self._host, self._host_np = host, host.numpy()
        self._dev = host if self.device.type == "cpu" else torch.empty(capacity, dtype=torch.int64,
                                                                         device=self.device)
        self.num_allocations += 1

    def upload(self, int_parts: list[list[int]], float_parts: list[list[float]] = ()
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Device views of `int_parts` (int64) and `float_parts` (float32), in order, after one copy."""
        int_sizes = [len(p) for p in int_parts]
        float_sizes = [len(p) for p in float_parts]
        n_int, n_float = sum(int_sizes), sum(float_sizes)
        n = n_int + (n_float + 1) // 2  # int64 elements in all
        if self._copied is not None:  # the previous copy may still be reading the host buffer
            self._copied.synchronize()
            self._copied = None
        self._reserve(n)
        host = self._host_np
        host[:n_int] = list(chain.from_iterable(int_parts))
        if n_float:
            host[n_int:n].view(np.float32)[:n_float] = list(chain.from_iterable(float_parts))
        dev = self._dev[:n]
        if self.device.type != "cpu":
            dev.copy_(self._host[:n], non_blocking=True)
            self._copied = record_event(self.device)
        ints = list(torch.split(dev[:n_int], int_sizes)) if int_parts else []
        floats = list(torch.split(dev[n_int:n].view(torch.float32)[:n_float], float_sizes)) if float_parts else []
        return ints, floats
