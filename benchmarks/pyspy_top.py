"""Summarize py-spy's raw (collapsed) stacks: where the samples are, by leaf and inclusive.

    py-spy record --pid PID --format raw --native --output worker.txt   # or: raylm bench --profile DIR
    python benchmarks/pyspy_top.py worker.txt [--top 25] [--match paged_attention,compute_logits]

Each line of a raw file is `frame;frame;...;leaf COUNT`. Prints the share of samples whose
leaf frame is each function (self time), the share of samples with each function anywhere
on the stack (inclusive time), and for each --match substring its inclusive share.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>.*)\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    where = m.group("where").rsplit("/", 1)[-1]
    return f"{m.group('name')} ({where.split(':')[0]})"


def load(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            stacks.append(([_short(fr) for fr in stack.split(";")], int(count)))
    return stacks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--match", default="", help="comma-separated substrings: inclusive share of each")
    a = ap.parse_args()
    for path in a.files:
        stacks = load(path)
        total = sum(c for _, c in stacks)
        leaf, incl = Counter(), Counter()
        for frames, c in stacks:
            leaf[frames[-1]] += c
            for fr in set(frames):
                incl[fr] += c
        print(f"# {path}: {total} samples")
        print("## self (leaf frame)")
        for fr, c in leaf.most_common(a.top):
            print(f"{100 * c / total:6.1f}%  {fr}")
        print("## inclusive")
        for fr, c in incl.most_common(a.top):
            print(f"{100 * c / total:6.1f}%  {fr}")
        for m in filter(None, a.match.split(",")):
            c = sum(cnt for frames, cnt in stacks if any(m in fr for fr in frames))
            print(f"match {m!r}: {100 * c / total:.1f}%")


if __name__ == "__main__":
    main()
