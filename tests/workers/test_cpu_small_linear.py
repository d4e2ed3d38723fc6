"""The CPU table's small weights: kept plain for F.linear where that measures about as fast as the
packed GEMM at every batch size probed, else packed; one copy either way, every batch size giving
the linear's results; big weights and a forced path are never measured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.ops import cpu, get_op_table
from workers.ops.cpu_features import has_onednn_packed_linear

pytestmark = pytest.mark.skipif(not has_onednn_packed_linear(), reason="no packed library GEMM here")


@pytest.fixture
def measured(monkeypatch):
    """Nothing measured before in this process; sets what the next measurements give; records the
    shapes measured."""
    shapes, outcome = [], {"rows": cpu.ALL}
    monkeypatch.delenv("RAYLM_CPU_LINEAR", raising=False)
    monkeypatch.setattr(cpu, "_PLAIN", {})

    def choose(mine, theirs, out_f, in_f, **kw):
        shapes.append((out_f, in_f))
        return outcome["rows"]

    monkeypatch.setattr(cpu, "choose_rows", choose)
    return shapes, outcome


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("plain", [True, False])
def test_either_choice_holds_one_copy_and_equals_the_linear(measured, bias, plain):
    shapes, outcome = measured
    outcome["rows"] = cpu.ALL if plain else 16  # F.linear about as fast at every probe, or not
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 72, generator=gen)
    b = torch.randn(300, generator=gen) if bias else None
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight, b)
    assert shapes == [(300, 72)]
    assert isinstance(handle, tuple if plain else cpu.OneDNNPackedWeight)
    assert ops.describe()["linear"] == ("aten" if plain else "onednn-packed")
    if plain:
        assert handle[0] is weight  # not copied: a tied embedding's storage stays shared
    for rows in (1, 5, 40):
        x = torch.randn(rows, 72, generator=gen)
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = ops.linear(x, handle)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        out = torch.full((rows, 320), 7.0)
        ops.linear_into(x, handle, out[:, :250])
        torch.testing.assert_close(out[:, :250].double(), want[:, :250], atol=1e-4, rtol=1e-5)
        assert (out[:, 250:] == 7.0).all()
        if not bias:
            assert torch.equal(ops.linear_argmax(x, handle, 250), got[:, :250].argmax(-1))


def test_a_shape_is_measured_once_per_process_and_the_agreed_choice_serves(measured):
    shapes, _ = measured
    ops = get_op_table("cpu", "cpu")
    ops.agree = lambda value: 0  # a tensor-parallel rank takes rank 0's choice, not its own
    first = ops.prepare_linear(torch.randn(64, 32))
    other = get_op_table("cpu", "cpu").prepare_linear(torch.randn(64, 32))  # a draft's table beside
    assert shapes == [(64, 32)]
    assert isinstance(first, cpu.OneDNNPackedWeight) and isinstance(other, tuple)


def test_big_weights_and_a_forced_path_are_not_measured(measured, monkeypatch):
    shapes, _ = measured
    ops = get_op_table("cpu", "cpu")
    big = torch.randn(cpu.SMALL_MAX_ELEMENTS // 64 + 1, 64) + 1e-3  # not bf16 values: no narrow copy
    assert isinstance(ops.prepare_linear(big), cpu.OneDNNPackedWeight)
    monkeypatch.setenv("RAYLM_CPU_LINEAR", "onednn-packed")
    assert isinstance(ops.prepare_linear(torch.randn(64, 32)), cpu.OneDNNPackedWeight)
    monkeypatch.setenv("RAYLM_CPU_LINEAR", "aten")
    assert isinstance(ops.prepare_linear(torch.randn(64, 32)), tuple)
    assert shapes == []


def test_the_real_measurement_chooses_one_path():
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(torch.randn(128, 64))
    assert isinstance(handle, (tuple, cpu.OneDNNPackedWeight))
    assert ops.describe()["linear"] in ("aten", "onednn-packed")
