"""SchedulerConfig: one replica's scheduling limits."""

from __future__ import annotations

from dataclasses import dataclass


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SchedulerConfig:
    """One replica's scheduling limits. Validated on construction."""

    num_blocks: int  # KV blocks in the worker's pool
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 64  # requests on the worker at once; also the number of slots
    max_num_batched_tokens: int = 2048  # tokens computed per step, all rows together
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name, lowest in (
            ("num_blocks", 1),
            ("block_size", 1),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_model_len", 2),
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")

    @property
    def max_total_tokens(self) -> int:
        """Longest a request may grow: max_model_len, or what the whole pool can hold
        (a token at position p needs K/V for positions 0..p-1)."""
        return min(self.max_model_len, self.num_blocks * self.block_size + 1)
