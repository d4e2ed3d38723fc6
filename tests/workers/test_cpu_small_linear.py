"""The CPU table's small weights: kept plain beside the packed copy, F.linear serves the batch
sizes up to the crossover measured here and the packed GEMM the rest, both giving the linear's
results; big weights and a forced path are never measured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.ops import cpu, get_op_table
from workers.ops.cpu_features import has_onednn_packed_linear

pytestmark = pytest.mark.skipif(not has_onednn_packed_linear(), reason="no packed library GEMM here")


@pytest.fixture
def crossover(monkeypatch):
    """Every small weight measures a crossover of 4 rows; the weights each measurement was for."""
    measured = []
    monkeypatch.delenv("RAYLM_CPU_LINEAR", raising=False)
    monkeypatch.setattr(cpu, "_PLAIN_ROWS", {})  # nothing measured before in this process
    monkeypatch.setattr(cpu, "choose_rows", lambda mine, theirs, out_f, in_f, **kw: measured.append((out_f, in_f)) or 4)
    return measured


@pytest.mark.parametrize("bias", [False, True])
def test_batches_up_to_the_crossover_run_plain_and_every_batch_equals_the_linear(crossover, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 72, generator=gen)
    b = torch.randn(300, generator=gen) if bias else None
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight, b)
    assert isinstance(handle, cpu.ByRows) and crossover == [(300, 72)]
    assert {"aten(<=4 rows)", "onednn-packed"} <= set(ops.describe()["linear"].split(","))
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 72, generator=gen)
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = ops.linear(x, handle)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        if rows <= 4:  # F.linear over the same weight: the same sums
            assert torch.equal(got, F.linear(x, weight, b))
        out = torch.full((rows, 320), 7.0)
        ops.linear_into(x, handle, out[:, :250])
        torch.testing.assert_close(out[:, :250].double(), want[:, :250], atol=1e-4, rtol=1e-5)
        assert (out[:, 250:] == 7.0).all()
        if not bias:
            assert torch.equal(ops.linear_argmax(x, handle, 250), got[:, :250].argmax(-1))
    rows = ops.linear_rows(handle, torch.tensor([3, 0, 299]), torch.empty(3, 72))
    assert torch.equal(rows, weight[[3, 0, 299]])  # a tied embedding's lookups


def test_a_shape_is_measured_once_per_process_and_the_agreed_value_serves(crossover):
    ops = get_op_table("cpu", "cpu")
    ops.agree = lambda rows: 9  # a tensor-parallel rank takes rank 0's crossover, not its own
    first = ops.prepare_linear(torch.randn(64, 32))
    again = ops.prepare_linear(torch.randn(64, 32))
    other = get_op_table("cpu", "cpu").prepare_linear(torch.randn(64, 32))  # a draft's table beside
    assert crossover == [(64, 32)]
    assert first.max_rows == again.max_rows == 9 and other.max_rows == 4


def test_big_weights_and_a_forced_path_keep_one_copy(crossover, monkeypatch):
    ops = get_op_table("cpu", "cpu")
    big = torch.randn(cpu.SMALL_MAX_ELEMENTS // 64 + 1, 64) + 1e-3  # not bf16 values: no narrow copy
    assert isinstance(ops.prepare_linear(big), cpu.OneDNNPackedWeight)
    monkeypatch.setenv("RAYLM_CPU_LINEAR", "onednn-packed")
    assert isinstance(ops.prepare_linear(torch.randn(64, 32)), cpu.OneDNNPackedWeight)
    monkeypatch.setenv("RAYLM_CPU_LINEAR", "aten")
    assert isinstance(ops.prepare_linear(torch.randn(64, 32)), tuple)
    assert crossover == []


def test_a_measured_plain_win_at_every_batch_keeps_the_plain_weight_alone(monkeypatch):
    monkeypatch.delenv("RAYLM_CPU_LINEAR", raising=False)
    monkeypatch.setattr(cpu, "_PLAIN_ROWS", {})
    monkeypatch.setattr(cpu, "choose_rows", lambda *a, **kw: cpu.ALL)
    ops = get_op_table("cpu", "cpu")
    weight = torch.randn(16, 8)
    handle = ops.prepare_linear(weight)
    assert isinstance(handle, tuple) and handle[0] is weight and ops.describe()["linear"] == "aten"


def test_the_real_measurement_gives_a_probed_crossover():
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(torch.randn(128, 64))
    rows = handle.max_rows if isinstance(handle, cpu.ByRows) else \
        cpu.ALL if isinstance(handle, tuple) else 0
    assert rows in (cpu.ALL, 0, *cpu.PROBE_ROWS)
