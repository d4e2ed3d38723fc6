"""`raylm bench`: offline throughput, A/B and scaling runs, serving load (see issue 5)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark raylm (and peers) on seeded random requests")
    b.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    raise SystemExit("raylm bench: not implemented yet")
