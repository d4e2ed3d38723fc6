"""The requests a benchmark runs: seeded random prompts and output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        lens = [len(p) for p in self.prompts]
        return {"num_requests": self.num_requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "prompt_len_min": min(lens), "prompt_len_max": max(lens),
                "output_len_min": min(self.output_lens), "output_len_max": max(self.output_lens)}


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    """Seeded random prompts (token ids uniform in the vocab) and output lengths."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*input_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(n)])
        outs.append(rng.randint(*output_len))
    return Workload(prompts, outs)


def blocks_needed(prompts: list[list[int]], output_lens: list[int], block_size: int) -> int:
    """KV blocks of `block_size` tokens that every request needs at its longest."""
    return sum(-(-(len(p) + o) // block_size) for p, o in zip(prompts, output_lens))


def kv_blocks_for(wl: Workload, block_size: int) -> int:
    """Enough KV blocks for every request at once (no preemption), plus the warm-up."""
    return blocks_needed(wl.prompts, wl.output_lens, block_size) + 8
