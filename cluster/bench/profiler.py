"""py-spy over a benchmark's processes (`raylm bench --profile DIR`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def py_spy_path() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else "py-spy"


class PySpyProfiler:
    """py-spy record (Python stacks, raw collapsed format, not pausing the process) on the
    given pids for the life of a `with` block. Summarize with benchmarks/pyspy_top.py."""

    def __init__(self, directory: str | None, tag: str, pids: dict[str, int]):
        self.directory, self.tag, self.pids, self.procs = directory, tag, pids, []

    def __enter__(self):
        if self.directory:
            os.makedirs(self.directory, exist_ok=True)
            for name, pid in self.pids.items():
                out = os.path.join(self.directory, f"{self.tag}-{name}.txt")
                self.procs.append(subprocess.Popen(
                    [py_spy_path(), "record", "--pid", str(pid), "--rate", "50", "--format", "raw", "--nonblocking",
                     "--output", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
