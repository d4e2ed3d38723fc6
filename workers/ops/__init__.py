"""The op tables, one per device kind, and `get_op_table` choosing one for a runner.

A table lives in `workers.ops.<name>` as an OpTable subclass whose `name` is `<name>`
(`reference`, `cpu`, `cuda`, `npu`); it is constructed with the torch device when its
__init__ takes an argument. The name can be forced with RAYLM_OPS (or the runner's
`ops` setting); otherwise the device's own table, falling back to the reference when the
device's module or its library is absent.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os

import torch

from workers.ops.base import AttentionBackend, AttentionMetadata, MoEWeights, OpTable, route_tokens

__all__ = ["AttentionBackend", "AttentionMetadata", "MoEWeights", "OpTable", "route_tokens", "NAMES", "default_name",
           "get_op_table"]

NAMES = ("reference", "cpu", "cuda", "npu")
_DEFAULTS = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}
ENV = "RAYLM_OPS"

log = logging.getLogger(__name__)


def default_name(device: torch.device | str) -> str:
    kind = torch.device(device).type
    return os.environ.get(ENV) or _DEFAULTS.get(kind, "reference")


def _table_class(name: str) -> type[OpTable]:
    module = importlib.import_module(f"workers.ops.{name}")
    for value in vars(module).values():
        if (inspect.isclass(value) and issubclass(value, OpTable) and value.__module__ == module.__name__
                and getattr(value, "name", None) == name):
            return value
    raise ImportError(f"workers.ops.{name} defines no OpTable named {name!r}")


def get_op_table(device: torch.device | str, name: str | None = None) -> OpTable:
    """The op table for `device`: `name` if given (ValueError if unknown), else RAYLM_OPS, else
    the device's own (the reference where that cannot be imported)."""
    if name is not None and name not in NAMES:
        raise ValueError(f"ops must be one of {', '.join(NAMES)}, got {name!r}")
    device = torch.device(device)
    explicit = name is not None or ENV in os.environ
    name = name or default_name(device)
    if name not in NAMES:
        raise ValueError(f"{ENV} must be one of {', '.join(NAMES)}, got {name!r}")
    try:
        cls = _table_class(name)
    except ImportError as e:
        if explicit or name == "reference":
            raise
        log.warning("op table %r unavailable on %s (%s); using the reference", name, device, e)
        cls = _table_class("reference")
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    return cls(device) if params else cls()
