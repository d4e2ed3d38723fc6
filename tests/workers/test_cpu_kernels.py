"""Building raylm's CPU kernels: a build that fails leaves the torch paths and says why; the
build's name follows what it is built from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.ops import cpu_kernels, get_op_table


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """load() as on a machine with an empty cache under tmp_path; the process's own build after."""
    monkeypatch.setenv(cpu_kernels.ENV_CACHE, str(tmp_path / "kernels"))
    cpu_kernels.load.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_kernels.load.cache_clear()


def test_a_kernel_that_does_not_compile_leaves_the_gather_path_and_says_why(fresh_load, monkeypatch):
    broken = fresh_load / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (broken,))
    monkeypatch.delenv("RAYLM_CPU_ATTENTION", raising=False)
    assert cpu_kernels.load() is None
    assert cpu_kernels.failure()  # the builder's complaint, e.g. "RuntimeError: Error building extension ..."
    ops = get_op_table("cpu", "cpu")
    assert ops.describe()["attention"] == "gather-sdpa"
    assert ops.describe()["kernels"] == f"not built: {cpu_kernels.failure()}"


def test_the_build_name_follows_sources_and_cpu_features(tmp_path, monkeypatch):
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int a;\n")
    b.write_text("int b;\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (a,))
    first = cpu_kernels.build_name()
    assert first == cpu_kernels.build_name() and first.startswith("raylm_cpu_kernels_")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (b,))
    assert cpu_kernels.build_name() != first
    monkeypatch.setattr(cpu_kernels, "SOURCES", (a,))
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert cpu_kernels.build_name() != first  # another CPU builds its own


LOAD_FROM = """
import sys
from pathlib import Path
from workers.ops import cpu_kernels
d = Path(sys.argv[1])
cpu_kernels.SOURCES, cpu_kernels.HEADERS = (d / "tiny.cpp",), (d / "tiny.h",)
assert cpu_kernels.load() is not None, cpu_kernels.failure()
build = cpu_kernels.cache_root() / cpu_kernels.build_name()
print(sorted((p.name, p.stat().st_mtime_ns) for p in build.glob("*.so")))
"""


def test_two_checkouts_of_the_same_sources_share_one_build(tmp_path):
    """A second clone (or worktree) on the machine loads the first one's library, and the first then
    loads it again, each in a process of its own, without either rebuilding it."""
    checkouts = []
    for name in ("one", "two"):
        d = tmp_path / name
        d.mkdir()
        (d / "tiny.h").write_text("static int tiny_value() { return 7; }\n")
        (d / "tiny.cpp").write_text('#include "tiny.h"\nint tiny_entry() { return tiny_value(); }\n')
        checkouts.append(d)
    env = {**os.environ, cpu_kernels.ENV_CACHE: str(tmp_path / "kernels")}

    def load_from(d):
        out = subprocess.run([sys.executable, "-c", LOAD_FROM, str(d)], env=env, capture_output=True, text=True,
                             timeout=120, cwd=Path(cpu_kernels.__file__).parents[2])
        assert out.returncode == 0, out.stderr
        return out.stdout

    built = load_from(checkouts[0])
    assert ".so" in built  # one library, and when it was written
    assert load_from(checkouts[1]) == built
    assert load_from(checkouts[0]) == built
