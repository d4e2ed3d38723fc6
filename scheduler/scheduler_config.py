"""SchedulerConfig: one replica's scheduling limits.

A plain dataclass that trusts its input: the engine derives it from a validated
EngineConfig and what the worker reported (EngineConfig.scheduler_config).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    num_blocks: int  # KV blocks in the worker's pool
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 64  # requests on the worker at once; also the number of slots
    max_num_batched_tokens: int = 2048  # tokens computed per step, all rows together
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_prefix_caching: bool = True
    # batches of disjoint requests in turn (pipeline stages): >1 keeps a request out of the next
    # B - 1 steps after one that samples it and gives each step at most 1/B of the decodes
    max_concurrent_batches: int = 1
    # speculative decoding: the most drafted tokens a decode row may verify (0: none); such a row
    # reserves KV and budget for them, and its request waits for its result before its next row
    num_lookahead_tokens: int = 0
    lookahead_below: int | None = None  # speculate only while fewer requests than this run (None: always)

    @property
    def max_total_tokens(self) -> int:
        """Longest a request may grow: max_model_len, or what the whole pool can hold
        (a token at position p needs K/V for positions 0..p-1)."""
        return min(self.max_model_len, self.num_blocks * self.block_size + 1)
