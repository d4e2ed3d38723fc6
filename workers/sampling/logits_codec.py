"""The host-logits baseline's wire encoding of logits (device_outputs=False).

In that mode the worker returns the sampling rows' logits (`encode_logits`) in its
StepResult and the driver decodes them (`logits_tensor`) and samples on the CPU.
"""

from __future__ import annotations

import torch

from scheduler.protocol import StepResult, sampled_on_device
from workers.runner_config import DTYPE_NAMES

LOGITS_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the dtypes logits travel in
_DTYPE_NAMES = {v: k for k, v in LOGITS_DTYPES.items()}


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
