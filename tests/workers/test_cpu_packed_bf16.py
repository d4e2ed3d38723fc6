"""The CPU table's bf16 linear in raylm's own packing: its products are the bf16 linear's (fp32
sums rounded once), its argmax is the argmax of those, rows read back are the weight's rows, and a
tied bf16 model computing in bf16 holds its embedding once, generating the reference's tokens.
Both engines (AMX tiles, vdpbf16ps) are held to the reference where the CPU has them; the op table's
tests run whichever it picks. Runs only where the CPU has AVX512-BF16 (and the kernels built)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.workers.argmax_cases import check_fused_argmax, tied_weight
from workers.ops import cpu_kernels, cpu_packed_bf16, get_op_table

pytestmark = pytest.mark.skipif(not cpu_packed_bf16.available(cpu_kernels.load()),
                                reason="this CPU has no AVX512-BF16 (or raylm's kernels did not build)")
# the engines this process can run: vdpbf16ps wherever the kernel built, AMX's tiles where permitted too
ENGINES = ["dpbf16"] + (["amx"] if cpu_packed_bf16.engine(cpu_kernels.load()) == "amx" else [])
PATH = cpu_packed_bf16.path_name(cpu_kernels.load())  # what the op table names the path it picks


@pytest.fixture
def packed_all(monkeypatch):
    monkeypatch.setenv(cpu_packed_bf16.ENV, "all")


def bf16_linear(x, weight, bias=None):
    """The bf16 linear's products: exact sums (float64), rounded to bf16 once (then the bias, in bf16)."""
    y = F.linear(x.double(), weight.double()).bfloat16()
    return y if bias is None else y + bias


def assert_bf16_close(got, want):
    """Within a bf16 rounding of the exact sum: fp32 sums taken in another order may round to the
    neighbouring bf16 value."""
    scale = want.double().abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=2 ** -7, atol=scale * 2 ** -12)


@pytest.mark.parametrize("bias", [False, True])
def test_products_are_the_bf16_linears(packed_all, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(301, 4096, generator=gen).bfloat16()  # rows not a whole pair of blocks; long rows
    b = torch.randn(301, generator=gen).bfloat16() if bias else None
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight, b)
    assert isinstance(handle, cpu_packed_bf16.PackedBF16Weight)
    assert PATH in ops.describe()["linear"].split(",")
    for rows in (0, 1, 5, 16, 17, 33, 300):  # tile row blocks part-filled, and past a block of x's rows
        x = torch.randn(rows, 4096, generator=gen).bfloat16()
        want = bf16_linear(x, weight, b)
        got = ops.linear(x, handle)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 301)
        assert_bf16_close(got, want)
        assert torch.equal(ops.linear(x.view(1, rows, 4096), handle), got.view(1, rows, 301))
        out = torch.full((rows, 320), 7.0)
        ops.linear_into(x, handle, out[:, :250])  # the first 250 rows of the weight, widened, into a wider buffer
        assert torch.equal(out[:, :250], got[:, :250].float())
        assert (out[:, 250:] == 7.0).all()


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_computes_the_bf16_products_and_their_argmax(engine):
    """The kernel itself, engine by engine: rows past a block of x and its 8-row groups, a weight
    not a whole pair of blocks, K long and short, a tall weight beside a narrow x (an lm_head's
    proportions, for which AMX copies x into its tiles' layout), x's rows in place or a stride
    apart; the argmax over the first n of exactly those products."""
    kernels = cpu_kernels.load()
    gen = torch.Generator().manual_seed(4)
    for out_features, width in ((301, 4096), (70, 64), (20_011, 64)):
        weight = torch.randn(out_features, width, generator=gen).bfloat16()
        packed = kernels.packed_bf16_pack(weight)
        for rows in (1, 3, 8, 13, 16, 29, 32, 45, 300):
            x = torch.randn(rows, width + 32 * (rows % 2), generator=gen).bfloat16()[:, :width]  # odd: strided
            y = torch.empty(rows, out_features, dtype=torch.bfloat16)
            kernels.packed_bf16_linear(y, x, packed, engine)
            assert_bf16_close(y, bf16_linear(x, weight))
            for n in (out_features, out_features - 5, 17):
                ids = kernels.packed_bf16_linear_argmax(x, packed, n, engine)
                assert torch.equal(ids, y[:, :n].float().argmax(dim=-1)), (rows, n)
    with pytest.raises(RuntimeError, match="engine must be 'auto', 'amx' or 'dpbf16', got 'tiles'"):
        kernels.packed_bf16_linear(y, x, packed, "tiles")


def test_greedy_ids_are_the_argmax_of_the_bf16_products(packed_all):
    """Each row's argmax over the first n outputs, ties to the lowest index and a NaN row to 0, as
    torch.argmax, across weight blocks split among threads."""
    gen = torch.Generator().manual_seed(2)
    weight = tied_weight(torch.bfloat16, gen)
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight)
    assert isinstance(handle, cpu_packed_bf16.PackedBF16Weight)
    x = check_fused_argmax(ops, handle, weight, torch.bfloat16, gen)
    with pytest.raises(RuntimeError, match="n must be in"):
        cpu_kernels.load().packed_bf16_linear_argmax(x, handle.packed, 2000)


def test_rows_read_back_are_the_weights_rows(packed_all):
    weight = torch.randn(301, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    ops = get_op_table("cpu", "cpu")
    handle = ops.prepare_linear(weight)
    ids = torch.tensor([0, 7, 15, 16, 31, 32, 300, 7])  # within and across blocks, the last (partial) block, repeats
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.full((len(ids), 96), 5.0, dtype=dtype)
        assert ops.linear_rows(handle, ids, out) is out
        assert torch.equal(out, weight[ids].to(dtype))
    with pytest.raises(RuntimeError, match="id 320 is outside w's 320 rows"):
        ops.linear_rows(handle, torch.tensor([320]), torch.empty(1, 96, dtype=torch.bfloat16))


def test_only_bf16_weights_the_kernel_takes_qualify(monkeypatch):
    kernels = cpu_kernels.load()
    monkeypatch.setenv(cpu_packed_bf16.ENV, "all")
    assert cpu_packed_bf16.qualifies(kernels, torch.zeros(8, 64, dtype=torch.bfloat16))
    assert not cpu_packed_bf16.qualifies(kernels, torch.zeros(8, 64))  # fp32: the narrow / library paths
    assert not cpu_packed_bf16.qualifies(kernels, torch.zeros(8, 48, dtype=torch.bfloat16))  # not whole tiles wide
    monkeypatch.delenv(cpu_packed_bf16.ENV)
    assert not cpu_packed_bf16.qualifies(kernels, torch.zeros(8, 64, dtype=torch.bfloat16))  # too small to measure
    monkeypatch.setenv(cpu_packed_bf16.ENV, "off")
    assert not cpu_packed_bf16.qualifies(kernels, torch.zeros(4096, 1024, dtype=torch.bfloat16))
    monkeypatch.setenv(cpu_packed_bf16.ENV, "some")
    with pytest.raises(ValueError, match="RAYLM_CPU_PACKED_BF16 must be 'off' or 'all', got 'some'"):
        get_op_table("cpu", "cpu").prepare_linear(torch.zeros(8, 64, dtype=torch.bfloat16))


def test_the_measured_choice_is_made_once_per_shape_and_holds_one_copy(monkeypatch):
    monkeypatch.setattr(cpu_packed_bf16, "NARROW_MIN_ELEMENTS", 1)
    monkeypatch.delenv(cpu_packed_bf16.ENV, raising=False)
    ops = get_op_table("cpu", "cpu")
    weight = torch.randn(512, 256).bfloat16()
    first = ops.prepare_linear(weight)
    x = torch.randn(3, 256).bfloat16()
    assert_bf16_close(ops.linear(x, first), bf16_linear(x, weight))
    monkeypatch.setattr(cpu_packed_bf16, "faster", lambda *a: pytest.fail("measured the same shape twice"))
    again = ops.prepare_linear(torch.randn(512, 256).bfloat16())
    assert type(again) is type(first)
    chosen = PATH if isinstance(first, cpu_packed_bf16.PackedBF16Weight) else "onednn-packed"
    assert ops.describe()["linear"] == chosen  # one path, one copy: never both for a weight


def test_a_tied_bf16_model_computing_in_bf16_holds_its_embedding_once(packed_all, tmp_path):
    """The lm_head in raylm's packing, the tied embedding it was prepared from is freed and lookups
    read the packed rows: the checkpoint's bytes, each matrix once; greedy tokens the reference
    table's (the same bf16 model computed by plain torch ops), sampled through the fused argmax."""
    from tests.plans import PlanDriver
    from tests.workers.tied_bf16 import save_tied_bf16, tied_runner

    stored = save_tied_bf16(tmp_path)

    def runner(ops):
        return tied_runner(tmp_path, ops, "bfloat16")

    fast = runner("cpu")
    stats = fast.stats()
    assert stats["dtype"] == "bfloat16" and PATH in stats["ops"]["linear"].split(",")
    assert stats["weight_bytes"] <= 1.05 * stored  # the embedding is not held beside the lm_head's copy
    outputs = []
    for r in (fast, runner("reference")):
        driver = PlanDriver(r)
        driver.add([5, 100, 200, 7, 7, 9])
        driver.add([11, 12])
        outputs.append(driver.generate(12))
    assert outputs[0] == outputs[1]
    assert fast.stats()["lm_head_argmax_steps"] > 0
