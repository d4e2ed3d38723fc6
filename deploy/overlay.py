"""Render a cluster YAML from a base file and an overlay, for `ray up`.

    python deploy/overlay.py deploy/ascend-cluster.yaml deploy/loopback-overlay.yaml \
        --set ssh_key=~/.ssh/raylm_loopback -o /tmp/raylm-loopback.yaml

Merge rule: a mapping in the overlay merges into the base's mapping of the same key;
any other overlay value (list, string, number) replaces the base's. The overlay's
`placeholders` mapping gives defaults for the `{{name}}` placeholders in its strings;
`--set name=value` overrides them; `{{checkout}}` is the repository this script is in.
An unknown placeholder, or a --set that names none, is an error (no silent typo).
Only PyYAML and the standard library, so it runs wherever `ray up` does.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import yaml

CHECKOUT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def merge(base: dict, overlay: dict) -> dict:
    """base with overlay merged in (mappings recursively, anything else replaced)."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _fill(text: str, values: dict[str, str], used: set[str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise ValueError(f"placeholder {{{{{name}}}}} has no value: "
                             f"add it under `placeholders` or --set {name}=...")
        used.add(name)
        return values[name]

    # A value may itself hold placeholders (venv: "{{checkout}}/.venv"): fill until none is left.
    for _ in range(len(values) + 1):
        filled = PLACEHOLDER.sub(one, text)
        if filled == text:
            return filled
        text = filled
    raise ValueError(f"placeholders refer to each other in a cycle: {text!r}")


def _substitute(node, values: dict[str, str], used: set[str]):
    if isinstance(node, str):
        return _fill(node, values, used)
    if isinstance(node, list):
        return [_substitute(v, values, used) for v in node]
    if isinstance(node, dict):
        return {k: _substitute(v, values, used) for k, v in node.items()}
    return node


def render(base: dict, overlay: dict, overrides: dict[str, str] | None = None) -> dict:
    """The cluster config `ray up` should get: base merged with the filled-in overlay."""
    overlay = dict(overlay)
    defaults = overlay.pop("placeholders", None) or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"placeholders must be a mapping of name: value, got {defaults!r}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"--set {unknown[0]}=...: the overlay has no placeholder {unknown[0]!r} "
                         f"(it has: {', '.join(sorted(defaults))})")
    values = {"checkout": str(CHECKOUT)}
    values.update({k: str(v) for k, v in defaults.items()})
    values.update(overrides)
    return merge(base, _substitute(overlay, values, set()))


def _parse_set(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise ValueError(f"--set takes name=value, got {item!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the cluster YAML users run, e.g. deploy/ascend-cluster.yaml")
    p.add_argument("overlay", help="the overlay, e.g. deploy/loopback-overlay.yaml")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="a placeholder value (repeatable)")
    p.add_argument("-o", "--output", default="-", help="where to write the result (default: stdout)")
    a = p.parse_args(argv)
    try:
        with open(a.base) as f:
            base = yaml.safe_load(f)
        with open(a.overlay) as f:
            overlay = yaml.safe_load(f)
        config = render(base, overlay, dict(_parse_set(s) for s in a.sets))
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"overlay: error: {e}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(config, sort_keys=False, width=1 << 16)
    if a.output == "-":
        sys.stdout.write(text)
    else:
        Path(a.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
