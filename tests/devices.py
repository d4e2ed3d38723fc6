"""Device parameters for worker tests: "cpu" always; "cuda" / "npu" marked and skipped
where the device is absent, so the same tests run on an accelerator when one is present."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return torch.npu.is_available()  # type: ignore[attr-defined]
    except Exception:  # an install without the CANN toolkit
        return False


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
    pytest.param("npu", marks=[pytest.mark.npu,
                               pytest.mark.skipif(not _npu_available(), reason="no Ascend NPU")]),
]
