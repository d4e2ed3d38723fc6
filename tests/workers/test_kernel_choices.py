"""Kernel choices measured on a host are kept for every later process on it: a restarted worker and
the next launch take the kernels the first start measured, so they round alike and answer alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from workers.ops import cpu_kernels, cpu_narrow, get_op_table, kernel_choices
from workers.ops.kernel_choices import remembered


@pytest.fixture
def kept(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    monkeypatch.setenv(kernel_choices.ENV, str(path))
    return path


def test_the_first_measurement_is_kept_and_later_ones_are_not_made(kept):
    assert remembered("probe", (64, 256), lambda: 5) == 5
    assert remembered("probe", (64, 256), lambda: pytest.fail("measured a kept choice again")) == 5
    assert remembered("probe", (64, 128), lambda: 0) == 0  # another shape, its own measurement
    assert remembered("other", (64, 256), lambda: 16) == 16  # another kind of choice


def test_another_process_on_the_host_takes_the_kept_choice(kept):
    remembered("probe", (3, 7), lambda: 42)
    code = "from workers.ops.kernel_choices import remembered; print(remembered('probe', (3, 7), lambda: 9))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"


def test_a_choice_is_kept_per_thread_count(kept):
    threads = torch.get_num_threads()
    try:
        remembered("probe", (8,), lambda: 1)
        torch.set_num_threads(threads + 1)
        assert remembered("probe", (8,), lambda: 2) == 2
    finally:
        torch.set_num_threads(threads)
    assert remembered("probe", (8,), lambda: 3) == 1


@pytest.mark.parametrize("flag", ["off", "0", "False", "no"])
def test_off_measures_every_time(monkeypatch, flag):
    monkeypatch.setenv(kernel_choices.ENV, flag)
    assert kernel_choices.path() is None
    assert remembered("probe", (1,), lambda: 1) == 1
    assert remembered("probe", (1,), lambda: 2) == 2


@pytest.mark.parametrize("flag", ["on", "1", "TRUE", "yes", ""])
def test_a_yes_keeps_them_beside_the_build_and_a_bare_word_is_refused(monkeypatch, flag):
    monkeypatch.setenv(kernel_choices.ENV, flag)  # "": as if unset
    assert kernel_choices.path().name == "choices.json" and kernel_choices.path().parent.name
    monkeypatch.setenv(kernel_choices.ENV, "onn")  # a typo of a flag: not silently a file in the cwd
    with pytest.raises(ValueError, match="RAYLM_KERNEL_CHOICES.*'onn'"):
        kernel_choices.path()


def test_a_damaged_file_is_measured_again_and_rewritten(kept):
    kept.write_text("{not json")
    assert remembered("probe", (1,), lambda: 7) == 7
    assert remembered("probe", (1,), lambda: 8) == 7


def test_a_cache_that_cannot_be_written_measures_and_serves(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(kernel_choices.ENV, str(blocker / "choices.json"))  # its directory is a file
    assert remembered("probe", (1,), lambda: 3) == 3
    assert remembered("probe", (1,), lambda: 4) == 4


@pytest.mark.skipif(cpu_kernels.load() is None, reason="raylm's CPU kernels did not build here")
def test_a_second_op_table_takes_the_first_ones_narrow_crossover_where_its_own_probe_would_differ(kept, monkeypatch):
    monkeypatch.setattr(cpu_narrow, "NARROW_MIN_ELEMENTS", 1)
    monkeypatch.delenv(cpu_narrow.ENV, raising=False)
    weight = torch.randn(64, 256).bfloat16().float()
    outcomes = iter([16, 64])  # two starts of a drifting host time the same shape differently
    monkeypatch.setattr("workers.ops.cpu.choose_rows", lambda *a: next(outcomes))
    first = get_op_table("cpu", "cpu")
    first.prepare_linear(weight)
    second = get_op_table("cpu", "cpu")  # a restarted worker's table
    second.prepare_linear(weight)
    assert "narrow-bf16(<=16 rows)" in first.describe()["linear"]
    assert second.describe()["linear"] == first.describe()["linear"]
