"""BlockManager: allocation, reference counts, the prefix cache's hash chain and LRU eviction."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.blocks import ROOT_HASH, BlockManager, extend_chain, hash_block


def chain(tokens, bs):
    hashes = []
    extend_chain(hashes, tokens, [], len(tokens) // bs, bs)
    return hashes


def filled(bm, tokens):
    """Allocate blocks for `tokens` and publish each full one, as the scheduler does on confirmation."""
    blocks = bm.allocate(-(-len(tokens) // bm.block_size))
    for b, h in zip(blocks, chain(tokens, bm.block_size)):
        bm.publish(b, h)
    return blocks


def test_allocate_and_free_keep_counts():
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a + b)) == 8 and bm.num_free == 0 and bm.num_used == 8
    with pytest.raises(ValueError, match="cannot allocate 1"):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free == 3 and bm.num_used == 5
    assert all(bm.ref_count(x) == 0 for x in a) and all(bm.ref_count(x) == 1 for x in b)


def test_double_free_is_refused():
    bm = BlockManager(4, 4)
    blocks = bm.allocate(2)
    bm.free(blocks)
    with pytest.raises(ValueError, match="freed more often"):
        bm.free(blocks[:1])


def test_hash_chain_depends_on_parent_and_tokens():
    h1 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h1 != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])
    # splitting a sequence between prompt and outputs does not change its chain
    seq = list(range(10, 22))
    for cut in range(len(seq) + 1):
        hashes = []
        extend_chain(hashes, seq[:cut], seq[cut:], 3, 4)
        assert hashes == chain(seq, 4)


def test_hash_is_stable_across_processes():
    code = "from scheduler.blocks import hash_block, ROOT_HASH; print(hash_block(ROOT_HASH, [1, 2, 3]).hex())"
    root = Path(__file__).resolve().parents[2]
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}).stdout
            for seed in ("1", "2")}
    assert outs == {hash_block(ROOT_HASH, [1, 2, 3]).hex() + "\n"}


def test_lookup_returns_longest_cached_chain():
    bm = BlockManager(16, 4)
    tokens = list(range(100, 112))  # three full blocks
    blocks = filled(bm, tokens)
    assert bm.match_prefix(tokens + [1], [], 3) == blocks
    assert bm.match_prefix(tokens, [], 2) == blocks[:2]  # the caller's cap is honoured
    diverging = tokens[:4] + [0] + tokens[5:]
    assert bm.match_prefix(diverging, [], 3) == blocks[:1]  # stops at the first differing block
    assert bm.match_prefix([0] + tokens[1:], [], 3) == []


def test_cached_prefix_tokens_never_covers_the_last_token_and_touches_no_counters():
    bm = BlockManager(16, 4)
    tokens = list(range(100, 112))
    filled(bm, tokens)
    # the last token must be computed to sample, so only whole blocks before it count
    assert bm.cached_prefix_tokens(tokens) == (len(tokens) - 1) // 4 * 4
    assert bm.cached_prefix_tokens(tokens + [5]) == len(tokens)
    assert bm.cached_prefix_tokens([]) == 0
    assert (bm.queried_tokens, bm.hit_tokens) == (0, 0)


def test_freed_cached_blocks_stay_reusable_until_evicted():
    bm = BlockManager(4, 4)
    tokens = list(range(8))
    blocks = filled(bm, tokens)
    bm.free(blocks)
    assert bm.num_free == 4 and bm.num_used == 0
    hits = bm.match_prefix(tokens + [9], [], 2)
    assert hits == blocks
    bm.acquire(hits)
    assert bm.num_used == 2 and all(bm.ref_count(b) == 1 for b in blocks)
    bm.acquire(hits)  # a second sharer
    assert all(bm.ref_count(b) == 2 for b in blocks) and bm.num_used == 2
    bm.free(blocks)
    bm.free(blocks)
    assert bm.num_used == 0 and bm.num_cached == 2


def test_uncached_blocks_are_handed_out_before_evicting_cached_ones():
    bm = BlockManager(4, 4)
    cached = filled(bm, list(range(8)))
    bm.free(cached)
    fresh = bm.allocate(2)
    assert set(fresh).isdisjoint(cached) and bm.num_cached == 2
    bm.allocate(1)  # now one cached block must go
    assert bm.num_cached == 1


def test_eviction_is_least_recently_used_and_drops_the_hash():
    bm = BlockManager(3, 2)
    a = filled(bm, [1, 2])
    b = filled(bm, [3, 4])
    c = filled(bm, [5, 6])
    bm.free(a)
    bm.free(c)
    bm.free(b)  # LRU order now a, c, b
    bm.acquire(bm.match_prefix([1, 2, 0], [], 1))  # reusing a takes it off the free list
    assert bm.allocate(1) == c  # c is the least recently freed of those left
    assert bm.match_prefix([5, 6, 0], [], 1) == []  # its content is gone from the cache
    assert bm.match_prefix([3, 4, 0], [], 1) == b


def test_a_freed_sequence_loses_its_tail_before_its_prefix():
    bm = BlockManager(3, 2)
    blocks = filled(bm, [1, 2, 3, 4, 5, 6])
    bm.free(blocks)
    bm.allocate(1)
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7], [], 3) == blocks[:2]


def test_publishing_the_same_content_twice_keeps_the_first_block():
    bm = BlockManager(4, 2)
    first = filled(bm, [1, 2])
    second = filled(bm, [1, 2])
    assert bm.match_prefix([1, 2, 3], [], 1) == first
    assert not bm.is_cached(second[0])
    bm.free(second)
    assert bm.num_cached == 1 and bm.num_free == 3


def test_can_allocate_counts_hits_that_leave_the_free_pool():
    bm = BlockManager(4, 2)
    blocks = filled(bm, [1, 2, 3, 4])
    bm.free(blocks)
    hits = bm.match_prefix([1, 2, 3, 4, 5], [], 2)
    assert bm.can_allocate(2, hits) and not bm.can_allocate(3, hits)
    bm.acquire(hits)
    assert bm.can_allocate(2) and not bm.can_allocate(3)


def test_caching_disabled_never_hits():
    bm = BlockManager(4, 2, enable_caching=False)
    filled(bm, [1, 2, 3, 4])
    assert bm.match_prefix([1, 2, 3, 4, 5], [], 2) == [] and bm.num_cached == 0


def test_reset_forgets_allocations_and_cache():
    bm = BlockManager(4, 2)
    filled(bm, [1, 2, 3, 4])
    bm.reset()
    assert bm.num_free == 4 and bm.num_used == 0 and bm.num_cached == 0


def test_publish_refuses_a_free_block():
    bm = BlockManager(2, 2)
    [b] = bm.allocate(1)
    bm.free([b])
    with pytest.raises(ValueError, match="free"):
        bm.publish(b, hash_block(ROOT_HASH, [1, 2]))
