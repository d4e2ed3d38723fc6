"""The checks every boundary uses on its input: ValueErrors that name the field and the value.

Pure Python, importable from every package (scheduler, workers, cluster). `bool` is an
`int` subclass in Python, so "an integer" here never accepts True or False.
"""

from __future__ import annotations

import math


def is_int(x) -> bool:
    """An int, and not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def all_ints(values) -> bool:
    """Every value an int (not a bool). Exact ints are checked in C: this runs per request on the serving
    path, where a per-element Python check costs more than the rest of a request's validation."""
    return set(map(type, values)) <= {int} or all(is_int(t) for t in values)


def all_ints_in(values, lo: int, hi: int) -> bool:
    """Every value an int (not a bool) in [lo, hi)."""
    return not values or (all_ints(values) and lo <= min(values) and max(values) < hi)


def is_number(x) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_int(name: str, value, low: int, high: int | None = None, *, optional: bool = False) -> None:
    """ValueError unless `value` is an integer in [low, high] (None when `optional`)."""
    if optional and value is None:
        return
    if not is_int(value) or value < low or (high is not None and value > high):
        want = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {want}{' or None' if optional else ''}, got {value!r}")


def check_positive_ints(owner, names, what: str = "") -> None:
    """ValueError naming the first of `names` whose attribute of `owner` is not an integer >= 1
    (a model config's sizes); `what` prefixes the name (e.g. "EAGLE-3 config ")."""
    for name in names:
        value = getattr(owner, name)
        if not is_int(value) or value < 1:
            raise ValueError(f"{what}{name} must be a positive integer, got {value!r}")


YES_WORDS, NO_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag_word(raw: str) -> bool | None:
    """An environment variable's yes or no (1 / true / yes / on, 0 / false / no / off, any case);
    None where `raw` is neither."""
    value = raw.strip().lower()
    return True if value in YES_WORDS else False if value in NO_WORDS else None


def check_bool(name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")


def check_fraction(name: str, value) -> None:
    """ValueError unless 0 < value <= 1."""
    if not is_number(value) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def check_positive(name: str, value) -> None:
    """ValueError unless `value` is a finite number > 0."""
    if not is_number(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
