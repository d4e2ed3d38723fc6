"""Quantized weights through the engine (Ray workers): a W8A8 checkpoint and int8 at load generate
what the runner does in-process, the worker reports what it runs, and an unsupported quantization
fails at start with its name."""

from __future__ import annotations

import pytest

import cluster
from cluster import SamplingParams
from tests.workers.quant_checkpoints import write_compressed_tensors
from tests.workers.tp_ranks import job, run_ranks
from workers.loader import bundled_model_path, load_tokenizer

pytestmark = pytest.mark.ray

PROMPTS = ["北京故宫是", "Hello there", "The quick brown fox jumps over the lazy dog"]
N = 16
RUNNER = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    return str(write_compressed_tensors(bundled_model_path(), tmp_path_factory.mktemp("quant_engine") / "ct"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", ["compressed-tensors", "int8"])
def test_quantized_greedy_through_the_engine_equals_the_runners(ray_session, w8a8, which):
    model, quantization = (w8a8, None) if which == "compressed-tensors" else (bundled_model_path(), "int8")
    tok = load_tokenizer(model)
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    ((want, runner_stats),) = run_ranks(1, [job(dict(RUNNER, model=model, quantization=quantization), ids, N)])
    greedy = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    with cluster.launch(model=model, quantization=quantization, num_kv_blocks=64, block_size=4,
                        threads_per_worker=1) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        (worker,) = llm.worker_stats()
    assert got == want
    assert worker["quantization"] == runner_stats["quantization"] == {"method": which, "scheme": "w8a8-dynamic"}
    assert worker["ops"]["quantized"].startswith("w8a8-dynamic:")


def test_an_unsupported_quantization_fails_at_start_by_name(ray_session):
    with pytest.raises(ValueError, match="quantization.*'fp8'"):
        cluster.launch(model=bundled_model_path(), quantization="fp8")


def test_the_cli_passes_quantization_to_the_engine(capsys):
    from cluster.cli import _engine_kwargs, build_parser
    from cluster.config import EngineConfig

    for command in ("serve", "generate"):
        args = [command] + (["hi"] if command == "generate" else []) + ["--quantization", "int8"]
        assert EngineConfig(**_engine_kwargs(build_parser().parse_args(args))).quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "-q", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
