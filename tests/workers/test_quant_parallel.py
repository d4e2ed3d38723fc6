"""Quantized checkpoints under tensor parallelism (two spawned ranks against one): each rank holds
its slice of the int8 / int4 values with the scales, zero points and biases that belong to them.

Where the arithmetic does not depend on how a linear's input is split (static W8A8: one scale for
the whole tensor; W4A16: groups lie inside a rank's slice) two ranks compute what one does, up to
the order of the all-reduce's sum, and greedy outputs are equal. Dynamic per-token W8A8 quantizes a
row-parallel linear's input per rank, over that rank's slice (as vLLM does): the scales differ from
one rank's, so the outputs are held to the format's tolerance instead (most tokens equal)."""

from __future__ import annotations

import pytest

from tests.workers.quant_checkpoints import calibrate_input_ranges, write_awq, write_compressed_tensors, write_modelslim
from tests.workers.test_quant import corpus_ids
from tests.workers.tp_ranks import job, run_ranks
from workers.loader import bundled_model_path
from workers.ops.cpu_quant import INT4_ENV

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

NEW = 16
RUNNER = dict(block_size=4, num_kv_blocks=128, max_num_seqs=4)
EXACT = ("modelslim-w8a8", "awq")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # AWQ's int4 path is measured per (sliced) shape, and torch's int4 packing is held beside the
    # nibbles only where it runs: one path on every layout, so the bytes compare and outputs are one sum
    with pytest.MonkeyPatch.context() as env:
        env.setenv(INT4_ENV, "0")
        return _runs(tmp_path_factory)


def _runs(tmp_path_factory):
    src = bundled_model_path()
    d = tmp_path_factory.mktemp("quant_tp")
    ids = corpus_ids()
    models = {"compressed-tensors": (str(write_compressed_tensors(src, d / "ct")), None),
              "modelslim-w8a8": (str(write_modelslim(src, d / "ms", dynamic=False,
                                                     input_ranges=calibrate_input_ranges(src, ids))), None),
              "awq": (str(write_awq(src, d / "awq", group_size=64)), None),
              "int8": (src, "int8")}
    prompts = [p[:24] for p in ids[:4]]
    jobs = [job(dict(RUNNER, model=path, quantization=q), prompts, NEW) for path, q in models.values()]
    return {tp: dict(zip(models, run_ranks(tp, jobs))) for tp in (1, 2)}, len(prompts)


@pytest.mark.parametrize("fmt", EXACT)
def test_two_ranks_generate_what_one_does(runs, fmt):
    by_tp, _ = runs
    assert by_tp[2][fmt][0] == by_tp[1][fmt][0]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "int8"])
def test_dynamic_w8a8_on_two_ranks_stays_close_to_one(runs, fmt):
    by_tp, n = runs
    one, two = by_tp[1][fmt][0], by_tp[2][fmt][0]
    equal = sum(a == b for x, y in zip(one, two) for a, b in zip(x, y))
    assert equal >= 0.75 * n * NEW, (equal, one, two)


@pytest.mark.parametrize("fmt", EXACT + ("compressed-tensors", "int8"))
def test_each_rank_holds_half_the_quantized_weights(runs, fmt):
    by_tp, _ = runs
    one, two = by_tp[1][fmt][1], by_tp[2][fmt][1]
    assert two["tensor_parallel_size"] == 2 and two["quantization"] == one["quantization"] is not None
    def schemes(stats):  # the kernels are measured per (sliced) shape: only the scheme must agree
        return {p.split(":")[0] for p in stats["ops"]["quantized"].split(",")}
    assert schemes(two) == schemes(one) == {one["quantization"]["scheme"]}
    assert two["weight_bytes"] < 0.6 * one["weight_bytes"]
