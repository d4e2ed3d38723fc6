"""The CPU table's narrow linear: a big fp32 weight of bf16 values kept in bf16 gives the fp32
linear's results, alone or for small batches beside the wide GEMM, and is used only where it
qualifies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.workers.argmax_cases import check_fused_argmax, tied_weight
from workers.ops import cpu_kernels, cpu_narrow, get_op_table

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="raylm's CPU kernels did not build here")


@pytest.fixture
def small_weights_qualify(monkeypatch):
    monkeypatch.setattr(cpu_narrow, "NARROW_MIN_ELEMENTS", 1)
    monkeypatch.setenv(cpu_narrow.ENV, "16")


@pytest.mark.parametrize("bias", [False, True])
def test_small_batches_read_the_bf16_copy_and_equal_the_fp32_linear(small_weights_qualify, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(301, 72, generator=gen).bfloat16().float()  # every value a bf16 value
    b = torch.randn(301, generator=gen) if bias else None
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight, b)
    assert isinstance(handle, cpu_narrow.NarrowWeight) and handle.narrow.dtype == torch.bfloat16
    assert "narrow-bf16(<=16 rows)" in ops.describe()["linear"]
    for rows in (0, 1, 5, 16, 17, 40):  # up to 16 the bf16 copy, beyond it the fp32 path
        x = torch.randn(rows, 72, generator=gen)
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        torch.testing.assert_close(ops.linear(x, handle).double(), want, atol=1e-5, rtol=1e-5)
        out = torch.full((rows, 320), 7.0)
        ops.linear_into(x, handle, out[:, :250])  # the first 250 vocab rows, into a wider buffer
        torch.testing.assert_close(out[:, :250].double(), want[:, :250], atol=1e-5, rtol=1e-5)
        assert (out[:, 250:] == 7.0).all()


def test_only_big_fp32_weights_of_bf16_values_qualify(small_weights_qualify, monkeypatch):
    ops = get_op_table("cpu", "cpu")
    not_bf16 = torch.randn(64, 32) + 1e-3  # values bf16 cannot hold: no copy (it would change results)
    assert not isinstance(ops.prepare_linear(not_bf16), cpu_narrow.NarrowWeight)
    assert not isinstance(ops.prepare_linear(not_bf16.bfloat16()), cpu_narrow.NarrowWeight)  # bf16 already
    monkeypatch.setenv(cpu_narrow.ENV, "off")
    assert not isinstance(ops.prepare_linear(not_bf16.bfloat16().float()), cpu_narrow.NarrowWeight)
    monkeypatch.setenv(cpu_narrow.ENV, "some")
    with pytest.raises(ValueError, match="RAYLM_CPU_NARROW_LINEAR must be 'off', 'all' or a number of rows, "
                                         "got 'some'"):
        ops.prepare_linear(not_bf16.bfloat16().float())
    monkeypatch.delenv(cpu_narrow.ENV)
    monkeypatch.setattr(cpu_narrow, "NARROW_MIN_ELEMENTS", 1 << 25)
    assert not isinstance(ops.prepare_linear(not_bf16.bfloat16().float()), cpu_narrow.NarrowWeight)  # too small


def test_a_weight_kept_narrow_only_serves_every_batch_size_and_shape(small_weights_qualify, monkeypatch):
    monkeypatch.setenv(cpu_narrow.ENV, "all")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(37, 300, generator=gen).bfloat16().float()  # rows not a whole panel; long rows
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight)
    assert isinstance(handle, cpu_narrow.NarrowWeight) and handle.wide is None  # no fp32 copy kept
    assert "narrow-bf16" in ops.describe()["linear"].split(",")
    for rows in (1, 7, 300):  # past a token block (rows of x beyond what stays in L2)
        x = torch.randn(rows, 300, generator=gen)
        want = F.linear(x.double(), weight.double())
        torch.testing.assert_close(ops.linear(x, handle).double(), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(ops.linear(x.view(1, rows, 300), handle).double(), want[None], atol=1e-4,
                                   rtol=1e-5)
        out = torch.zeros(rows, 40, dtype=torch.float64)  # not fp32: computed, then copied
        ops.linear_into(x, handle, out[:, :30])
        torch.testing.assert_close(out[:, :30], want[:, :30], atol=1e-4, rtol=1e-5)


def test_the_measured_choice_is_made_once_per_shape(small_weights_qualify, monkeypatch):
    monkeypatch.delenv(cpu_narrow.ENV)
    ops = get_op_table("cpu", "cpu")
    first = ops.prepare_linear(torch.randn(64, 256).bfloat16().float())
    rows = first.max_rows if isinstance(first, cpu_narrow.NarrowWeight) else 0
    assert rows in (cpu_narrow.ALL, 0, *cpu_narrow.PROBE_ROWS)
    monkeypatch.setattr("workers.ops.cpu.choose_rows", lambda *a: pytest.fail("measured the same shape twice"))
    again = ops.prepare_linear(torch.randn(64, 256).bfloat16().float())
    assert (again.max_rows if isinstance(again, cpu_narrow.NarrowWeight) else 0) == rows


def test_the_measured_choice_is_the_one_the_table_agrees_on(small_weights_qualify, monkeypatch):
    """A tensor-parallel rank's drafter table takes rank 0's crossover (OpTable.agree), not its own."""
    monkeypatch.delenv(cpu_narrow.ENV)
    ops = get_op_table("cpu", "cpu")
    measured = []
    ops.agree = lambda rows: measured.append(rows) or 5  # 5: no probe's row count, so never measured here
    handle = ops.prepare_linear(torch.randn(64, 256).bfloat16().float())
    assert len(measured) == 1 and measured[0] in (cpu_narrow.ALL, 0, *cpu_narrow.PROBE_ROWS)
    assert isinstance(handle, cpu_narrow.NarrowWeight) and handle.max_rows == 5
    assert "narrow-bf16(<=5 rows)" in ops.describe()["linear"]


@pytest.mark.parametrize("kept", ["all", "16"])
def test_the_lm_head_fused_with_the_argmax_picks_the_logits_argmax(small_weights_qualify, monkeypatch, kept):
    """Greedy ids straight from the bf16 copy: each row's argmax over the first n outputs, ties to
    the lowest index and a NaN row to 0 as torch.argmax, across panels split among threads."""
    monkeypatch.setenv(cpu_narrow.ENV, kept)
    gen = torch.Generator().manual_seed(2)
    weight = tied_weight(torch.float32, gen)
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight)
    assert isinstance(handle, cpu_narrow.NarrowWeight)
    x = check_fused_argmax(ops, handle, weight, torch.float32, gen)
    with pytest.raises(RuntimeError, match="rows must be in"):
        cpu_kernels.load().narrow_linear_argmax(x, handle.narrow, 2000)


def test_a_tied_bf16_checkpoint_computing_in_fp32_holds_about_its_own_bytes(small_weights_qualify, monkeypatch,
                                                                           tmp_path):
    """The lm_head kept as its own bf16 copy, the tied embedding it was prepared from is freed and
    lookups read the lm_head's panels: the checkpoint's bytes, each matrix once at its width;
    tokens the reference's."""
    from tests.plans import PlanDriver
    from tests.workers.tied_bf16 import save_tied_bf16, tied_runner

    monkeypatch.setenv(cpu_narrow.ENV, "all")
    stored = save_tied_bf16(tmp_path)

    def runner(ops):
        return tied_runner(tmp_path, ops, "float32")

    fast = runner("cpu")
    stats = fast.stats()
    assert stats["dtype"] == "float32" and stats["weights_dtype"] == "bfloat16"
    assert stats["weight_bytes"] <= 1.05 * stored  # the fp32 norms are the only bytes past the checkpoint's
    outputs = []
    for r in (fast, runner("reference")):
        driver = PlanDriver(r)
        driver.add([5, 100, 200, 7, 7, 9])
        outputs.append(driver.generate(12))
    assert outputs[0] == outputs[1]


def test_rows_read_back_from_the_panels_are_the_weights_rows(small_weights_qualify, monkeypatch):
    monkeypatch.setenv(cpu_narrow.ENV, "all")
    weight = torch.randn(301, 40, generator=torch.Generator().manual_seed(3)).bfloat16().float()
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight)
    ids = torch.tensor([0, 7, 8, 15, 16, 300, 7])  # both halves of a panel, the last (partial) panel, repeats
    out = torch.full((len(ids), 40), 5.0)
    assert ops.linear_rows(handle, ids, out) is out
    assert torch.equal(out, weight[ids])
    assert torch.equal(get_op_table("cpu", "reference").linear_rows((weight, None), ids, torch.empty(7, 40)),
                       weight[ids])
    with pytest.raises(RuntimeError, match="id 10000 is outside w's"):
        ops.linear_rows(handle, torch.tensor([10000]), torch.empty(1, 40))
    with pytest.raises(RuntimeError, match="w must be bfloat16, float16 or float32, got Char"):
        cpu_kernels.load().narrow_rows(torch.empty(1, 40), handle.narrow.to(torch.int8), torch.tensor([0]))
