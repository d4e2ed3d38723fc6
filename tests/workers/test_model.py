"""The Qwen3 forward over the paged cache against HF transformers (the oracle), fp32."""

from __future__ import annotations

import pytest
import torch

from workers.kv_cache import KVCache
from workers.loader import bundled_model_path, load_model
from workers.models.qwen3 import Qwen3Config
from workers.ops.metadata import SequenceRows, build_metadata

BS = 4


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen3ForCausalLM

    path = bundled_model_path()
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path), hf


def make_cache(model, num_blocks=32):
    c = model.config
    return KVCache(num_layers=c.num_hidden_layers, num_blocks=num_blocks, block_size=BS,
                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype)


def slots_for(blocks, start, n):
    return torch.tensor([blocks[p // BS] * BS + p % BS for p in range(start, start + n)])


def run(model, cache, ids, positions, attn):
    with torch.inference_mode():
        hidden = torch.empty(len(ids), model.config.hidden_size)
        model.embed(torch.tensor(ids), out=hidden)
        out = model(hidden, torch.tensor(positions), cache, attn)
        logits = torch.empty(len(ids), model.config.vocab_size)
        return model.compute_logits(out, out=logits)


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


PROMPT = [5, 100, 200, 1000, 7, 9, 11, 13, 17, 19, 23]


def test_prefill_matches_hf(models):
    model, hf = models
    cache = make_cache(model)
    blocks = [7, 3, 9]
    attn = build_metadata([SequenceRows(0, len(PROMPT), blocks)], num_decode=0, block_size=BS)
    logits = run(model, cache, PROMPT, range(len(PROMPT)), attn)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_chunk_after_cached_prefix_matches_hf(models):
    model, hf = models
    cache = make_cache(model)
    blocks = [2, 11, 5]
    k = 2 * BS  # two full cached blocks, then a chunk that reads them through the block table
    run(model, cache, PROMPT[:k], range(k), build_metadata([SequenceRows(0, k, blocks)], num_decode=0,
                                                           block_size=BS))
    n = len(PROMPT) - k
    attn = build_metadata([SequenceRows(k, n, blocks)], num_decode=0, block_size=BS)
    logits = run(model, cache, PROMPT[k:], range(k, len(PROMPT)), attn)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT)[k:], atol=1e-4, rtol=1e-4)


def test_mixed_batch_of_decode_rows_and_a_chunk_matches_hf(models):
    """Two decode rows of different context lengths (padded block tables) and a prefill chunk."""
    model, hf = models
    cache = make_cache(model)
    seqs = [PROMPT, PROMPT[:6][::-1], [42, 43, 44, 45, 46]]
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    for seq, table in zip(seqs[:2], tables):  # prefill all but the last token of the decode rows
        n = len(seq) - 1
        run(model, cache, seq[:n], range(n), build_metadata([SequenceRows(0, n, table)], num_decode=0,
                                                            block_size=BS))
    ids = [seqs[0][-1], seqs[1][-1]] + seqs[2]
    positions = [len(seqs[0]) - 1, len(seqs[1]) - 1] + list(range(len(seqs[2])))
    attn = build_metadata([SequenceRows(positions[0], 1, tables[0]), SequenceRows(positions[1], 1, tables[1]),
                           SequenceRows(0, len(seqs[2]), tables[2])], num_decode=2, block_size=BS)
    logits = run(model, cache, ids, positions, attn)
    torch.testing.assert_close(logits[0], hf_logits(hf, seqs[0])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(hf, seqs[1])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[2:], hf_logits(hf, seqs[2]), atol=1e-4, rtol=1e-4)


def test_logits_can_be_limited_to_the_real_vocab(models):
    model, _ = models
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        full = model.compute_logits(hidden, out=torch.empty(3, model.config.vocab_size))
        part = model.compute_logits(hidden, out=torch.empty(3, 100))
    torch.testing.assert_close(part, full[:, :100])


def test_kv_cache_writes_by_slot_and_reads_by_block():
    cache = KVCache(num_layers=2, num_blocks=6, block_size=BS, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    table = [4, 1]
    cache.write(1, k, v, slots_for(table, 0, 5))
    keys, values = cache.gather(1, torch.tensor(table))
    torch.testing.assert_close(keys[:5], k)
    torch.testing.assert_close(values[:5], v)
    assert cache.key(0).abs().sum() == 0  # other layers untouched
    assert cache.nbytes == KVCache.bytes_per_block(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=8,
                                                   dtype=torch.float32) * 6


@pytest.mark.parametrize("field,value", [("num_attention_heads", 3), ("head_dim", 7), ("hidden_size", 0),
                                         ("rope_theta", -1.0)])
def test_config_rejects_bad_shapes(field, value):
    with pytest.raises(ValueError, match=field):
        Qwen3Config(**{field: value})
