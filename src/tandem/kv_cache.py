"""Paged KV cache: block tensors per layer and the allocator that hands blocks to requests."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from tandem.config import ModelConfig


class BlockAllocator:
    """Free list plus reference counts; a block is free exactly when its count is zero."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        assert self.can_allocate(n), f"asked for {n} blocks, {self.num_free} free"
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        self.ref_counts[blocks] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Another owner holds these blocks too."""
        assert (self.ref_counts[blocks] > 0).all()
        self.ref_counts[blocks] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"block {block} freed twice"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.kv_size * dtype.itemsize


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Per layer [2, num_blocks + 1, block_size, num_kv_heads, head_dim]; the extra block absorbs padding writes."""
    cache = torch.zeros(
        cfg.num_layers,
        2,
        num_blocks + 1,
        block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype=dtype,
        device=device,
    )
    return list(cache.unbind(0))
