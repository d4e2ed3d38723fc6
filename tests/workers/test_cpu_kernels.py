"""Building raylm's CPU kernels: a build that fails leaves the torch paths and says why; the
build's name follows what it is built from."""

from __future__ import annotations

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
