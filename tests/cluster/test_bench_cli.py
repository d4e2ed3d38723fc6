"""`raylm bench`'s argument checks, workload and figures, and the random-weights model spec: no Ray."""

from __future__ import annotations

import math

import pytest

from cluster.bench.figures import percentile
from cluster.bench.workload import make_workload
from cluster.cli import main as cli_main
from workers.loader import parse_random_spec, random_model, weights_fingerprint


@pytest.mark.parametrize("argv, message", [
    (["--serve", "--compare", "hf"], "--serve runs alone"),
    (["--model", "/nonexistent", "--layers", "2"], "--layers applies to a random model"),
    (["--model", "random:qwen3-7b"], "unknown random model"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys):
    assert cli_main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isclose(percentile(list(range(101)), 99), 99.0)


def test_workload_is_seeded_and_in_range():
    a = make_workload(20, (3, 9), (2, 4), 100, seed=7)
    assert a == make_workload(20, (3, 9), (2, 4), 100, seed=7)
    assert a != make_workload(20, (3, 9), (2, 4), 100, seed=8)
    assert all(3 <= len(p) <= 9 and all(0 <= t < 100 for t in p) for p in a.prompts)
    assert all(2 <= o <= 4 for o in a.output_lens) and a.output_tokens == sum(a.output_lens)


# ---- the random model spec ----

def test_random_spec_parses_and_refuses_what_it_cannot_build():
    spec = parse_random_spec("random:qwen3-0.6b?layers=4&seed=3")
    assert (spec.name, spec.layers, spec.seed) == ("qwen3-0.6b", 4, 3)
    assert parse_random_spec(str(spec)) == spec
    assert parse_random_spec("random:qwen3-0.6b") == parse_random_spec("random:qwen3-0.6b?seed=0")
    for bad, msg in [("random:qwen3-0.6b?layers=0", "layers must be"), ("random:qwen3-0.6b?depth=2", "unknown option"),
                     ("random:qwen3-0.6b?layers", "key=value"), ("random:qwen3-0.6b?seed=1&seed=2", "twice"),
                     ("random:llama", "unknown random model")]:
        with pytest.raises(ValueError, match=msg):
            parse_random_spec(bad)


def test_random_model_is_a_function_of_its_spec():
    a = random_model("random:qwen3-0.6b?layers=1&seed=1")
    assert a.config.num_hidden_layers == 1 and a.config.hidden_size == 1024 and a.dtype.is_floating_point
    assert weights_fingerprint(a) == weights_fingerprint(random_model("random:qwen3-0.6b?layers=1&seed=1"))
    assert weights_fingerprint(a) != weights_fingerprint(random_model("random:qwen3-0.6b?layers=1&seed=2"))
