"""Tensor parallelism at the runner level: two ranks (spawned processes, gloo, one thread
each) against one rank and HF transformers; how weights split; shapes that do not divide."""

from __future__ import annotations

import shutil

import pytest
import torch

from scheduler.protocol import WorkerSampling
from tests import oracle
from tests.workers.tp_ranks import job, run_ranks
from workers.loader import bundled_model_path, load_config, load_model
from workers.models.qwen3 import Qwen3Config
from workers.parallel import SINGLE, ShardedShape, TensorParallel, check_shardable, padded_vocab, shard_of

SPAWNS = (pytest.mark.multiprocess, pytest.mark.timeout(900))  # the first test waits for `runs`: minutes


def _marks(fn):
    for m in SPAWNS:
        fn = m(fn)
    return fn


PROMPTS = [[5, 100, 200, 1000, 7, 9, 11], [42, 43, 44], list(range(1, 19))]
NEW = 12
RUNNER = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4)
SEEDED = [WorkerSampling(temperature=1.0, top_k=50, seed=1234 + i) for i in range(len(PROMPTS))]
TOP_P = [WorkerSampling(temperature=0.8, top_p=0.9, seed=7), WorkerSampling(), WorkerSampling(temperature=1.0, seed=8)]


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    """Untied embeddings, grouped-query attention (6 heads, 2 KV heads), head_dim 16 while
    hidden / heads is 8, an odd vocab larger than the tokenizer's; saved by HF."""
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=1861, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                   max_position_embeddings=512, initializer_range=0.5, rope_theta=10000.0)
    d = tmp_path_factory.mktemp("odd_qwen3")
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{bundled_model_path()}/{name}", d / name)
    return str(d)


@pytest.fixture(scope="module")
def runs(odd_model):
    """Every generation the tests below compare, run once for TP=1 and once for TP=2."""
    tiny = dict(RUNNER)
    odd = dict(RUNNER, model=odd_model)
    jobs = [job(tiny, PROMPTS, NEW, chunk=5), job(odd, PROMPTS, NEW), job(tiny, PROMPTS, NEW, SEEDED),
            job(tiny, PROMPTS, NEW, TOP_P, chunk=3)]
    return {tp: run_ranks(tp, jobs) for tp in (1, 2)}


@_marks
def test_tp2_greedy_matches_tp1_and_hf_on_the_tiny_model(runs):
    expected = oracle.hf_greedy(bundled_model_path(), PROMPTS, NEW)
    assert runs[2][0][0] == expected
    assert runs[1][0][0] == expected


@_marks
def test_tp2_greedy_matches_hf_with_untied_embeddings_gqa_and_a_wide_head_dim(runs, odd_model):
    expected = oracle.hf_greedy(odd_model, PROMPTS, NEW)
    assert runs[2][1][0] == expected
    assert runs[1][1][0] == expected


@_marks
def test_seeded_sampling_is_the_same_for_every_tp_size(runs):
    assert runs[2][2][0] == runs[1][2][0]
    assert runs[2][3][0] == runs[1][3][0]
    assert len({tuple(o) for o in runs[1][2][0]}) == len(PROMPTS)  # seeds differ: outputs differ


@_marks
def test_each_rank_holds_half_the_kv_pool(runs):
    one, two = runs[1][0][1], runs[2][0][1]
    assert two["tensor_parallel_size"] == 2 and two["tensor_parallel_rank"] == 0
    assert two["kv_blocks"] == one["kv_blocks"]  # the same block tables serve every rank
    assert two["kv_cache_bytes"] * 2 == one["kv_cache_bytes"]


# -- how weights split (no processes) ----------------------------------------------------

class _Rank(TensorParallel):
    """A rank's view for shape and slicing checks; its collectives are never called."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size, group=None)


def test_each_ranks_shards_put_back_together_are_the_checkpoint():
    path = bundled_model_path()
    full = load_model(path)
    vocab = full.config.vocab_size
    ranks = [_Rank(r, 2) for r in range(2)]
    for name, whole in full.named_parameters():
        parts = [shard_of(name, whole, tuple(whole.shape), p, vocab) for p in ranks]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=0)
        elif name.endswith(("norm.weight",)):
            assert all(torch.equal(p, whole) for p in parts)
        else:  # column-parallel and vocab rows; the vocab is padded with zero rows
            joined = torch.cat(parts, 0)
            assert joined.shape[0] == (padded_vocab(vocab, 2) if "embed" in name else whole.shape[0])
            torch.testing.assert_close(joined[: whole.shape[0]], whole, rtol=0, atol=0)
            assert not joined[whole.shape[0]:].any()


def test_a_sharded_load_reads_each_ranks_slice_from_the_file():
    path = bundled_model_path()
    full = load_model(path)
    part = load_model(path, parallel=_Rank(1, 2))
    c = full.config
    q = part.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (c.num_attention_heads // 2 * c.head_dim, c.hidden_size)
    torch.testing.assert_close(q, full.model.layers[0].self_attn.q_proj.weight[q.shape[0]:], rtol=0, atol=0)
    down = part.model.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(down, full.model.layers[0].mlp.down_proj.weight[:, down.shape[1]:], rtol=0, atol=0)
    rows = padded_vocab(c.vocab_size, 2) // 2
    emb = part.model.embed_tokens.weight
    assert emb.shape == (rows, c.hidden_size) and part.lm_head.weight is emb  # tied: one tensor
    torch.testing.assert_close(emb[: c.vocab_size - rows], full.model.embed_tokens.weight[rows:], rtol=0, atol=0)


def test_the_tiny_model_splits_over_two_ranks_with_a_padded_vocab():
    config = load_config(bundled_model_path())
    shape = ShardedShape.of(config, _Rank(1, 2))
    assert shape.num_heads * 2 == config.num_attention_heads
    assert shape.num_kv_heads * 2 == config.num_key_value_heads
    assert shape.vocab_rows == padded_vocab(config.vocab_size, 2) // 2 and shape.vocab_start == shape.vocab_rows
    assert ShardedShape.of(config, SINGLE).vocab_rows == config.vocab_size


@pytest.mark.parametrize("world,named", [
    (3, ["num_attention_heads (4)", "num_key_value_heads (2)"]),
    (4, ["num_key_value_heads (2)"]),
    (5, ["num_attention_heads (4)", "num_key_value_heads (2)", "intermediate_size (192)"]),
])
def test_shapes_that_do_not_divide_are_named(world, named):
    config = Qwen3Config(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, vocab_size=1851, num_hidden_layers=1)
    with pytest.raises(ValueError, match=f"tensor_parallel_size {world}") as e:
        check_shardable(config, world)
    for part in named:
        assert part in str(e.value)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ShardedShape.of(config, _Rank(0, 4))


def _shared_choices(rank: int, port: int, out) -> None:
    """One rank: prepares weights whose kernel choice it measures its own way (a fake measurement,
    different on each rank) and whose values qualify for the narrow copy on rank 0 only."""
    from workers.ops import cpu, cpu_kernels, get_op_table
    from workers.parallel import ParallelConfig

    cpu._PLAIN.clear()
    cpu.choose_rows = lambda *a, **kw: cpu.ALL if rank == 0 else 0  # rank 0: F.linear / narrow always
    parallel = TensorParallel.join(ParallelConfig(rank, 2, "127.0.0.1", port, timeout_s=120), "cpu")
    try:
        ops = get_op_table("cpu", "cpu")
        parallel.share_choices(ops)
        gen = torch.Generator().manual_seed(rank)
        router = torch.randn(64, 32, generator=gen)  # small: F.linear or packed, by measurement
        shard = torch.randn(1024, 512, generator=gen).bfloat16().float()  # bf16 values: narrow qualifies
        if rank == 1:
            shard[0, 0] += 1e-3  # no longer a bf16 value: this rank's shard does not qualify
        both = torch.randn(512, 1024, generator=gen).bfloat16().float()  # qualifies on every rank
        kinds = [type(ops.prepare_linear(w)).__name__ for w in (router, shard, both)]
        out.put((rank, (parallel.first_rank_value(10 + rank), parallel.every_rank(rank == 0),
                        parallel.every_rank(True), kinds, cpu_kernels.load() is not None)))
    finally:
        parallel.close()


@_marks
def test_every_rank_takes_the_groups_kernel_choices():
    """A tensor-parallel group's measured kernel choices (OpTable.agree / agree_all): rank 0's
    measurement on every rank, so a replicated weight (a MoE router, a drafter) computes alike; a
    path only some ranks' shard values qualify for taken by none."""
    import multiprocessing as mp

    from cluster.ports import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_shared_choices, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    (first, some, every, kinds, built), rank1 = got[0], got[1]
    assert (first, some, every) == (10, False, True) and rank1[:3] == (10, False, True)
    assert kinds == rank1[3]  # one kernel per weight on both ranks, though each measured its own
    assert kinds[0] == "tuple"  # rank 0's choice (F.linear) for the small weight
    assert kinds[1] != "NarrowWeight"  # rank 1's shard cannot take the bf16 copy: neither rank does
    assert kinds[2] == ("NarrowWeight" if built else kinds[1])
    assert SINGLE.first_rank_value(7) == 7 and SINGLE.every_rank(False) is False
