"""Kernel choices measured on this host, kept for every later process on it.

The CPU op table picks some kernels by timing them while it prepares weights: raylm's bf16 packing or
oneDNN's for a bf16 shape (cpu_packed_bf16.py), the narrow linear's row crossover (cpu_narrow.py), int4's
(cpu_quant.py). Two kernels sum in different orders, so where a measurement flips from one start to
the next (a host whose speed drifts does that near a tie) the same requests' greedy outputs change
at near-ties: a restarted worker would not recompute the tokens it computed before, and two launches
would answer differently. So the first measurement of each choice on a host is written to a file
beside the built kernels (whose name already keys the CPU, torch and the kernels' sources), under a
lock that also keeps two starting workers from timing at once, and every later process takes it.

RAYLM_KERNEL_CHOICES: unset or a yes (`on`, `1`, `true`, `yes`), that file; a no (`off`, `0`,
`false`, `no`), measure at every start and keep nothing; any other value, the path of the file to
keep them in (one with a directory part, so a flag meant as a yes or no is never taken for a file).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from scheduler.checks import flag_word

ENV = "RAYLM_KERNEL_CHOICES"

log = logging.getLogger(__name__)


def path() -> Path | None:
    """Where choices are kept, or None (RAYLM_KERNEL_CHOICES=off)."""
    raw = (os.environ.get(ENV) or "").strip()
    flag = flag_word(raw)
    if flag is False:
        return None
    if raw and flag is None:
        if os.sep not in raw:
            raise ValueError(f"{ENV} must be on, off or a file path with a directory (e.g. ./choices.json), "
                             f"got {raw!r}")
        return Path(raw)
    from workers.ops import cpu_kernels

    return cpu_kernels.cache_root() / cpu_kernels.build_name() / "choices.json"


def remembered(kind: str, key: tuple, measure: Callable[[], int]) -> int:
    """This host's choice of `kind` for `key` (a weight's shape, dtype...) at this process's torch
    thread count: the one kept, else measure() now, kept for the processes after this one. Where the
    file cannot be written (a read-only cache) the choice is measured and not kept, as with `off`."""
    where = path()
    if where is None:
        return measure()
    name = repr((kind, *key, torch.get_num_threads()))
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        lock = open(where.with_name(where.name + ".lock"), "a")
    except OSError as e:
        log.warning("kernel choices cannot be kept in %s (%s): measured at every start", where, e)
        return measure()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if measure() raises
        kept = _read(where)
        if name in kept:
            return kept[name]
        value = int(measure())
        kept[name] = value
        tmp = where.with_name(f".{where.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(kept, indent=0, sort_keys=True))
            os.replace(tmp, where)  # readers without the lock never see half a file
        except OSError as e:
            log.warning("kernel choice %s not kept in %s (%s)", name, where, e)
        return value


def _read(where: Path) -> dict:
    try:
        kept = json.loads(where.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):  # unreadable or damaged: measured again and rewritten whole
        return {}
    return kept if isinstance(kept, dict) else {}
