"""BlockManager: paged KV accounting over a fixed pool of blocks, with a prefix cache.

A block is an id in [0, num_blocks); on the worker it holds the K/V of `block_size`
consecutive tokens of one sequence. The manager only counts: who holds which block
(reference counts) and which full blocks hold known content (the prefix cache).

Prefix cache: a full block's hash chains its parent's hash and its token ids
(`hash_block`, blake2b: the same in every process, unlike Python's `hash()`). A block
is published to the cache by the scheduler once the worker confirmed the step that
filled it. Cached blocks whose reference count drops to zero stay reusable until they
are evicted, least recently used first; blocks that were never cached are handed out
before any cached block is evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

ROOT_HASH = b""  # the parent of a sequence's first block


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Content hash of a full block given its parent's hash: 16 bytes, stable across processes."""
    return hashlib.blake2b(parent + array("i", token_ids).tobytes(), digest_size=16).digest()


def extend_chain(hashes: list[bytes], prompt: Sequence[int], outputs: Sequence[int], num_blocks: int,
                 block_size: int) -> None:
    """Extend `hashes` (a sequence's chain memo) to cover its first num_blocks full blocks,
    where the sequence is prompt + outputs (kept apart to avoid copying them)."""
    n_prompt = len(prompt)
    for i in range(len(hashes), num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        if end <= n_prompt:
            tokens = prompt[start:end]
        elif start >= n_prompt:
            tokens = outputs[start - n_prompt:end - n_prompt]
        else:
            tokens = list(prompt[start:]) + list(outputs[:end - n_prompt])
        hashes.append(hash_block(hashes[i - 1] if i else ROOT_HASH, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.reset()

    def reset(self) -> None:
        """Forget every allocation and the whole cache (the worker lost its KV)."""
        self._ref = [0] * self.num_blocks
        self._hash: list[bytes | None] = [None] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))  # never cached; pop() gives 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, oldest first
        self._cached: dict[bytes, int] = {}  # hash -> block id
        self._num_used = 0

    # ---- counts -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (never-cached plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash[block_id] is not None

    # ---- allocation -----------------------------------------------------------------
    def can_allocate(self, num_new: int, hits: Sequence[int] = ()) -> bool:
        """Whether `num_new` fresh blocks fit after taking references on the cache `hits`."""
        revived = sum(1 for b in hits if self._ref[b] == 0)  # hits that leave the free pool
        return num_new + revived <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with reference count 1; evicts LRU cached blocks when needed."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash[b]]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        self._num_used += n
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on each block (prefix-cache hits)."""
        for b in blocks:
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    raise ValueError(f"block {b} is free and not cached; it cannot be acquired")
                del self._evictable[b]
                self._num_used += 1
            self._ref[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. Walked from the tail, so a sequence's last
        blocks become least recently used and are evicted before its prefix."""
        for b in reversed(blocks):
            r = self._ref[b] - 1
            if r < 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._ref[b] = r
            if r == 0:
                self._num_used -= 1
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    # ---- prefix cache -----------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], hashes: list[bytes], max_blocks: int) -> list[int]:
        """Cached blocks holding the longest prefix of token_ids, at most max_blocks of them.

        `hashes` is the caller's memo of the chain hashes of token_ids' full blocks; it is
        extended as far as this walk computed. Touches no counters and no reference counts.
        """
        if not self.enable_caching:
            return []
        bs = self.block_size
        out = []
        for i in range(max_blocks):
            if i < len(hashes):
                h = hashes[i]
            else:
                h = hash_block(hashes[i - 1] if i else ROOT_HASH, token_ids[i * bs:(i + 1) * bs])
                hashes.append(h)
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Read-only: how many leading tokens an admission of token_ids would find cached."""
        max_blocks = (len(token_ids) - 1) // self.block_size if token_ids else 0
        return len(self.match_prefix(token_ids, [], max_blocks)) * self.block_size

    def publish_chain(self, block_ids: Sequence[int], hashes: list[bytes], prompt: Sequence[int],
                      outputs: Sequence[int], start: int, end: int) -> None:
        """Publish a sequence's full blocks [start, end), extending its chain memo as needed."""
        if self.enable_caching:
            extend_chain(hashes, prompt, outputs, end, self.block_size)
            for i in range(start, end):
                self.publish(block_ids[i], hashes[i])

    def publish(self, block_id: int, block_hash: bytes) -> None:
        """Offer a full, confirmed block to the cache under its chain hash.

        A block already cached keeps its hash; if another block already holds the same
        content, this one stays uncached (it is freed like any other block).
        """
        if not self.enable_caching or self._hash[block_id] is not None or block_hash in self._cached:
            return
        if self._ref[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only held blocks can be published")
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash
