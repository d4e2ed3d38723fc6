"""Worker-resident outputs, and the host-logits baseline's encoding.

`ResidentOutputs` keeps the large per-step outputs (`logits`, `next_hidden`, ...) on the
worker's device: a buffer is allocated once per (name, shape, dtype) and reused every
step. Leading (batch) dimensions go through `bucket` so a few buffers serve all batch
sizes; callers slice the rows they use (`get_rows`).

Device outputs (sampling on the worker) are on by default. RAYLM_DEVICE_OUTPUTS=0, or
device_outputs=False, selects the baseline where the worker returns the sampling rows'
logits (`encode_logits`) and the driver decodes them (`logits_tensor`) and samples.
"""

from __future__ import annotations

import operator
import os

import torch

from scheduler.protocol import StepResult, sampled_on_device

ENV_DEVICE_OUTPUTS = "RAYLM_DEVICE_OUTPUTS"
MIN_BUCKET = 8

LOGITS_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in LOGITS_DTYPES.items()}


def bucket(n: int) -> int:
    """The batch-size bucket for `n` rows: the next power of two, at least 8."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"batch size must be an integer >= 0, got {n!r}")
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    return 1 << (n - 1).bit_length()


def device_outputs_enabled(flag: bool | None = None) -> bool:
    """Whether workers sample on the device: `flag` if given, else RAYLM_DEVICE_OUTPUTS.

    Unset, "1" or "true" -> True; "0" or "false" -> False (case-insensitive);
    any other value raises ValueError naming the variable and the value.
    """
    if flag is not None:
        if not isinstance(flag, bool):
            raise ValueError(f"device_outputs must be a bool or None, got {flag!r}")
        return flag
    raw = os.environ.get(ENV_DEVICE_OUTPUTS)
    if raw is None:
        return True
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise ValueError(f"{ENV_DEVICE_OUTPUTS} must be one of 1, true, 0, false; got {raw!r}")


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

    def __enter__(self) -> "ResidentOutputs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def encode_logits(logits: torch.Tensor, vocab_size: int | None = None) -> tuple[bytes, tuple[int, int], str]:
    """Host-logits mode: (raw bytes, (rows, vocab), dtype name) for a StepResult.

    `logits` is [rows, padded_vocab] on any device; `vocab_size` trims the padding so
    only real token ids travel.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if vocab_size is not None:
        if not isinstance(vocab_size, int) or not 0 < vocab_size <= logits.shape[1]:
            raise ValueError(f"vocab_size must be in (0, {logits.shape[1]}], got {vocab_size!r}")
        logits = logits[:, :vocab_size]
    if logits.shape[1] == 0:
        raise ValueError("host-mode logits need at least one vocab column")
    name = _DTYPE_NAMES.get(logits.dtype)
    if name is None:
        raise ValueError(f"logits dtype must be one of {', '.join(LOGITS_DTYPES)}, got {logits.dtype}")
    host = logits.detach().to("cpu").contiguous()  # [rows, vocab]
    data = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return data, (int(host.shape[0]), int(host.shape[1])), name


def logits_tensor(result: StepResult) -> torch.Tensor:
    """A result's logits as a float32 CPU tensor [rows, vocab].

    When the worker sampled on the device this is an empty placeholder [rows, 0], never a
    device tensor; in host-logits mode it is the decoded logits.
    """
    rows, vocab = result.logits_shape
    if sampled_on_device(result):
        return torch.empty((rows, 0), dtype=torch.float32)
    dtype = LOGITS_DTYPES.get(result.logits_dtype)
    if dtype is None:
        raise ValueError(f"logits_dtype must be one of {', '.join(LOGITS_DTYPES)}, got {result.logits_dtype!r}")
    expected = rows * vocab * dtype.itemsize
    if rows < 0 or len(result.logits) != expected:
        raise ValueError(
            f"logits hold {len(result.logits)} bytes but shape {result.logits_shape} "
            f"of {result.logits_dtype} needs {expected}"
        )
    if rows == 0:
        return torch.empty((0, vocab), dtype=torch.float32)
    flat = torch.frombuffer(bytearray(result.logits), dtype=dtype)  # owns a private copy
    return flat.reshape(rows, vocab).to(torch.float32)
