"""Paged K/V tensors: written token by token through a slot mapping, read block by block.

Each layer has a K and a V tensor of shape [num_blocks, block_size, kv_heads, head_dim]
(all layers live in one allocation). A token's *slot* is block_id * block_size + offset;
the scheduler's block tables say which blocks hold a request's tokens, in order.
"""

from __future__ import annotations

import torch

from scheduler.checks import check_int
from workers.device import host_zeros


class KVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(name, value, 1)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]; zeros so padded reads are finite
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            self.data = host_zeros(shape, dtype)  # on huge pages where the OS grants them
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def key(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]

    def value(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim]; slot_mapping: [T] int64 flat slots."""
        shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.data[layer, 0].view(shape).index_copy_(0, slot_mapping, k)
        self.data[layer, 1].view(shape).index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [..., n] -> K, V of shape [..., n * block_size, kv_heads, head_dim]."""
        lead = block_ids.shape[:-1]
        n = block_ids.shape[-1] * self.block_size
        flat = block_ids.reshape(-1)
        k = self.data[layer, 0].index_select(0, flat).view(*lead, n, self.num_kv_heads, self.head_dim)
        v = self.data[layer, 1].index_select(0, flat).view(*lead, n, self.num_kv_heads, self.head_dim)
        return k, v
