"""Pipeline parallelism at the runner level: two stages (and two stages x two tensor ranks) in
spawned processes (gloo, one thread each) against one rank and HF transformers, dense and MoE;
what each stage holds; how layers split and how a bad split is named."""

from __future__ import annotations

import pytest

from scheduler.protocol import WorkerSampling
from tests import oracle
from tests.workers.moe_checkpoints import write_checkpoint
from tests.workers.quant_checkpoints import write_compressed_tensors
from tests.workers.test_parallel import odd_model  # noqa: F401  (a fixture: untied, GQA, wide head_dim)
from tests.workers.tp_ranks import job, run_ranks
from workers.loader import bundled_model_path, load_config, load_model
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.parallel import TensorParallel
from workers.pipeline import Pipeline
from workers.stage_layers import check_partition, stage_layers

PROMPTS = [[5, 100, 200, 1000, 7, 9, 11], [42, 43, 44], list(range(1, 19)), [3, 1, 4, 1, 5, 9, 2, 6]]
NEW = 12
RUNNER = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4)
MOE_PROMPTS = [[5, 100, 20, 7, 9, 11], [42, 43, 44], list(range(1, 19))]  # the MoE checkpoints' vocab is small
SEEDED = [WorkerSampling(temperature=1.0, top_k=50, seed=1234 + i) for i in range(len(PROMPTS))]
SPAWNS = (pytest.mark.multiprocess, pytest.mark.timeout(900))


def _marks(fn):
    for m in SPAWNS:
        fn = m(fn)
    return fn


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_pp")
    top2 = write_checkpoint("top2", root / "top2")
    return {"top2": top2, "top2_w8a8": str(write_compressed_tensors(top2, root / "top2_w8a8", experts=True))}


@pytest.fixture(scope="module")
def runs(odd_model, moe_paths):  # noqa: F811
    """Every generation the tests below compare, for one rank, PP=2, PP=2 with an uneven split,
    and PP=2 x TP=2."""
    tiny = dict(RUNNER)
    jobs = [job(tiny, PROMPTS, NEW, chunk=5), job(dict(RUNNER, model=odd_model), PROMPTS, NEW),
            job(tiny, PROMPTS, NEW, SEEDED), job(dict(RUNNER, model=moe_paths["top2"]), MOE_PROMPTS, NEW, chunk=3),
            job(dict(RUNNER, model=moe_paths["top2_w8a8"]), MOE_PROMPTS, NEW)]
    return {"one": run_ranks(1, jobs), "pp2": run_ranks(2, jobs, pipeline=2),
            "pp2_uneven": run_ranks(2, jobs[:1], pipeline=2, partition=[3, 1]),
            "pp2_tp2": run_ranks(4, jobs[:4], pipeline=2)}


@_marks
def test_two_stages_equal_one_rank_and_hf_dense(runs, odd_model):  # noqa: F811
    for i, path in enumerate((bundled_model_path(), odd_model)):
        expected = oracle.hf_greedy(path, PROMPTS, NEW)
        assert runs["one"][i][0] == expected
        assert runs["pp2"][i][0] == expected
        assert runs["pp2_tp2"][i][0] == expected
    assert runs["pp2_uneven"][0][0] == runs["one"][0][0]


@_marks
def test_two_stages_equal_one_rank_and_hf_moe(runs, moe_paths):
    expected = oracle.hf_greedy(moe_paths["top2"], MOE_PROMPTS, NEW)
    assert runs["pp2"][3][0] == expected
    assert runs["pp2_tp2"][3][0] == expected
    assert runs["pp2"][4][0] == runs["one"][4][0]  # int8 experts with their scales, per stage


@_marks
def test_seeded_sampling_is_the_same_for_every_layout(runs):
    assert runs["pp2"][2][0] == runs["one"][2][0]
    assert runs["pp2_tp2"][2][0] == runs["one"][2][0]
    assert len({tuple(o) for o in runs["one"][2][0]}) == len(PROMPTS)  # seeds differ: outputs differ


@_marks
def test_the_last_stage_holds_its_layers_and_half_the_kv(runs):
    one, last, uneven, quad = runs["one"][0][1], runs["pp2"][0][1], runs["pp2_uneven"][0][1], runs["pp2_tp2"][0][1]
    layers = one["layers"][1]
    assert last["layers"] == [layers // 2, layers] and uneven["layers"] == [3, 4]
    assert last["pipeline"]["stage"] == 1 and last["pipeline"]["stages"] == 2
    assert last["kv_blocks"] == one["kv_blocks"]  # one block table serves every stage
    assert last["kv_cache_bytes"] * 2 == one["kv_cache_bytes"]
    assert uneven["kv_cache_bytes"] * 4 == one["kv_cache_bytes"]
    assert quad["kv_cache_bytes"] * 4 == one["kv_cache_bytes"]  # half the layers, half the heads
    # what the last stage sent: only the ids (int64) of the rows it sampled, to the first stage
    assert last["pipeline"]["bytes_sent"] % 8 == 0 and last["pipeline"]["bytes_sent"] > 0


# -- what a stage holds and how layers split (no processes) ---------------------------------

def _stage(stage: int, stages: int = 2, partition=None) -> TensorParallel:
    return TensorParallel(pipeline=Pipeline(stage, stages, partition=partition))


def test_layers_split_by_count_or_by_the_given_partition():
    assert [(s.start, s.end) for s in (stage_layers(28, 3, i) for i in range(3))] == [(0, 10), (10, 19), (19, 28)]
    assert [(s.start, s.end) for s in (stage_layers(8, 2, i, "6,2") for i in range(2))] == [(0, 6), (6, 8)]
    assert stage_layers(8, 2, 1).is_last and not stage_layers(8, 2, 1).is_first


@pytest.mark.parametrize("partition, stages, layers, named", [
    ("4,x", 2, 8, "layer counts separated by commas, got '4,x'"),
    ([4], 2, 8, "2 positive layer counts"),
    ([8, 0], 2, 8, "2 positive layer counts"),
    ([5, 4], 2, 8, "must sum to the model's 8 layers, got 9"),
])
def test_a_bad_partition_is_named(partition, stages, layers, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_partition(partition, stages, layers)


def test_more_stages_than_layers_is_named():
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 exceeds the model's 4 layers"):
        stage_layers(4, 5, 0)


def test_each_stage_loads_only_its_layers_and_the_ends_it_uses():
    path = bundled_model_path()
    full = load_model(path, dtype="float32")
    layers = load_config(path).num_hidden_layers
    first, last = (load_model(path, dtype="float32", parallel=_stage(s)) for s in (0, 1))
    names = {n for n, p in full.named_parameters()}
    held = [{n for n, p in m.named_parameters() if p.numel()} for m in (first, last)]
    assert held[0] | held[1] == names
    assert all(f"model.layers.{i}.mlp.down_proj.weight" in held[0] for i in range(layers // 2))
    assert not any(n.startswith(f"model.layers.{i}.") for i in range(layers // 2) for n in held[1])
    for m in (first, last):
        for n, p in m.named_parameters():
            if p.numel():
                assert (p == full.get_parameter(n)).all(), n
    assert "model.embed_tokens.weight" in held[0]
    tied = full.config.tie_word_embeddings
    assert ("model.embed_tokens.weight" in held[1]) == tied  # the lm_head reads it
    middle = Qwen3ForCausalLM(full.config, _stage(1, 3))
    assert middle.model.embed_tokens.weight.numel() == 0 and middle.lm_head.weight.numel() == 0


class _Arrival:
    """A receive of the last stage's ids (torch.distributed.irecv's Work) that the test completes."""

    def __init__(self, buf):
        self.buf, self.done, self.waited = buf, False, False

    def is_completed(self):
        return self.done

    def wait(self):
        self.waited = True
        return True


def test_the_first_stage_waits_only_for_the_ids_its_rows_read(monkeypatch):
    """With 2 x P steps in flight the first stage applies the last stage's ids oldest first: every
    step up to the newest holding a slot the step reads (waiting for them), then only those that
    have arrived, so a batch's step never waits for the other batch's."""
    import torch

    arrivals = []

    def irecv(buf, src, group=None):
        arrivals.append(_Arrival(buf))
        return arrivals[-1]

    monkeypatch.setattr(torch.distributed, "irecv", irecv)
    first = Pipeline(stage=0, num_stages=2)
    last = torch.zeros(4, dtype=torch.int64)

    def step(slots):  # a step on the first stage that samples `slots`; its ids will come back
        first.expect_ids(torch.tensor(slots), slots)
        arrivals[-1].buf.copy_(torch.tensor([10 * len(arrivals) + s for s in slots]))

    step([0, 1])  # batch A
    step([2, 3])  # batch B
    first.take_ids(last, {0, 1})  # A's next step reads A's tokens: A's ids, not B's
    assert last.tolist() == [10, 11, 0, 0] and [a.waited for a in arrivals] == [True, False]
    step([0, 1])
    arrivals[2].done = True  # A's next step's ids have arrived, before B's were waited for
    first.take_ids(last, {2, 3})  # B's next step: B's ids (waited for), then A's that arrived
    assert last.tolist() == [30, 31, 22, 23] and all(a.waited for a in arrivals)
    step([3])
    first.take_ids(last, set())  # reads no resident token: nothing arrived, nothing taken
    assert not arrivals[3].waited
    first.take_ids(last)  # all (warmup's end): waits for every step
    assert arrivals[3].waited and last.tolist() == [30, 31, 22, 43]
