"""PrefixAwareRouter: Serve's request router for the engine deployment.

A request goes to the engine that most likely holds its prompt's leading KV blocks, unless
that engine is busier than the least loaded one by more than `imbalanced_threshold` ongoing
requests; without such an engine, to the least loaded one (Serve's queue-length probes).
What an engine holds is not asked of it: the router remembers the prompts it sent to each
engine (PrefixTable, chained hashes of full `block_size`-token blocks; text prompts in chunks
of `chars_per_block` characters), at most `max_blocks_per_engine` blocks each, oldest
forgotten first, as an engine's prefix cache evicts its least recently used blocks. Each
router (one per ingress replica) remembers what it sent; Ray Serve LLM's PrefixCacheAffinityRouter
is the same idea over text with a shared tree actor.

PrefixTable is plain Python (tested without Serve); PrefixAwareRouter is the Serve glue.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CHARS_PER_BLOCK = 64
DEFAULT_MAX_BLOCKS_PER_ENGINE = 1 << 16
DEFAULT_IMBALANCED_THRESHOLD = 16


def prompt_blocks(prompt, block_size: int = DEFAULT_BLOCK_SIZE, chars_per_block: int = DEFAULT_CHARS_PER_BLOCK):
    """Chained hashes of the prompt's full blocks: token ids by block_size, text by chars_per_block."""
    step = chars_per_block if isinstance(prompt, str) else block_size
    out, h = [], 0
    for i in range(0, len(prompt) - step + 1, step):
        h = hash((h, prompt[i:i + step] if isinstance(prompt, str) else tuple(prompt[i:i + step])))
        out.append(h)
    return out


class PrefixTable:
    """Which engine was sent which prompt blocks, newest last per engine."""

    def __init__(self, max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE):
        self.max_blocks = max_blocks_per_engine
        self._held: dict[object, OrderedDict] = {}

    def record(self, engine, blocks: list) -> None:
        held = self._held.setdefault(engine, OrderedDict())
        for b in blocks:
            held[b] = None
            held.move_to_end(b)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def matched(self, engine, blocks: list) -> int:
        """How many of `blocks`, from the first, `engine` holds."""
        held = self._held.get(engine)
        if not held:
            return 0
        n = 0
        for b in blocks:
            if b not in held:
                break
            n += 1
        return n

    def best(self, engines: list, blocks: list) -> tuple[list, int]:
        """The engines holding the longest run of the prompt's leading blocks, and its length."""
        scores = {e: self.matched(e, blocks) for e in engines}
        top = max(scores.values(), default=0)
        return ([e for e, s in scores.items() if s == top] if top else []), top

    def forget(self, engine) -> None:
        self._held.pop(engine, None)

    def keep_only(self, engines) -> None:
        for e in set(self._held) - set(engines):
            del self._held[e]


def request_prompt(pending: PendingRequest | None):
    """The prompt of a call to the engine deployment's `generate` ([id, prompt, params, group])."""
    if pending is None or not pending.args:
        return None
    request = pending.args[0]
    if isinstance(request, list) and len(request) == 4 and isinstance(request[1], (str, list)):
        return request[1]
    return None


class PrefixAwareRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, block_size: int = DEFAULT_BLOCK_SIZE, chars_per_block: int = DEFAULT_CHARS_PER_BLOCK,
                         max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE,
                         imbalanced_threshold: int = DEFAULT_IMBALANCED_THRESHOLD):
        for name, v in (("block_size", block_size), ("chars_per_block", chars_per_block),
                        ("max_blocks_per_engine", max_blocks_per_engine)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(imbalanced_threshold, int) or isinstance(imbalanced_threshold, bool) \
                or imbalanced_threshold < 0:
            raise ValueError(f"imbalanced_threshold must be an integer >= 0, got {imbalanced_threshold!r}")
        self.block_size, self.chars_per_block = block_size, chars_per_block
        self.imbalanced_threshold = imbalanced_threshold
        self.table = PrefixTable(max_blocks_per_engine)

    def _blocks(self, pending) -> list:
        prompt = request_prompt(pending)
        return prompt_blocks(prompt, self.block_size, self.chars_per_block) if prompt else []

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """The engines holding the prompt's longest cached run when load allows, else every
        candidate (the base router then takes the one with the shortest queue)."""
        if not candidate_replicas:
            return []
        blocks = self._blocks(pending_request)
        if blocks:
            holders, run = self.table.best([r.replica_id for r in candidate_replicas], blocks)
            if run:
                loads = await self._queue_lengths(candidate_replicas)
                least = min(loads.values())
                chosen = [r for r in candidate_replicas
                          if r.replica_id in holders and loads[r.replica_id] - least <= self.imbalanced_threshold]
                if chosen:
                    return [chosen]
        return [list(candidate_replicas)]

    async def _queue_lengths(self, replicas) -> dict:
        """Each replica's ongoing requests: the router's cache, probed where it has none."""
        loads, unknown = {}, []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                unknown.append(r)
            else:
                loads[r.replica_id] = q
        if unknown:
            for r, q in await self._probe_queue_lens(unknown, 0):
                loads[r.replica_id] = q if q is not None else r.max_ongoing_requests
        for r in replicas:
            loads.setdefault(r.replica_id, r.max_ongoing_requests)
        return loads

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        blocks = self._blocks(pending_request)
        if blocks:
            self.table.record(replica_id, blocks)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        self.table.keep_only(self._replica_id_set)
