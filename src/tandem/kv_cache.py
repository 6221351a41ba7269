"""Paged KV cache: block tensors per layer and the allocator that hands blocks to requests."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.config import ModelConfig


class BlockAllocator:
    """Reference counts plus a free queue; a block is in the queue exactly when its count is zero.

    The queue is ordered least recently freed first. Freed blocks may still hold cached KV
    (prefix_cache.py): `allocate` reuses from the front and tells `on_reuse`, so the cache
    forgets a block before its new owner writes it, and `take` pulls a cached block back out.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.on_reuse: Callable[[int], None] = lambda block: None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        assert self.can_allocate(n), f"asked for {n} blocks, {self.num_free} free"
        blocks = [self.free_queue.popitem(last=False)[0] for _ in range(n)]
        for block in blocks:
            self.on_reuse(block)
        self.ref_counts[blocks] = 1
        return blocks

    def take(self, blocks: list[int]) -> None:
        """One more owner for each block, free (cached) or held already."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of these blocks sit in the free queue (taking them uses up free blocks)."""
        return int((self.ref_counts[blocks] == 0).sum()) if blocks else 0

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds join the back of the queue.
        Callers pass a sequence's blocks last first, so its tail is reused before its head."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"block {block} freed twice"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write (prefix_cache.py): a cached block's KV copied into a block of one request."""

    src: int
    dst: int


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's K and V of blocks `src` into blocks `dst` ([n] int32 each, on the cache's
    device), on the current stream; bytes, so any cache dtype (FP8 too) copies alike."""
    src, dst = src.long(), dst.long()
    for cache in kv_caches:  # [2, num_blocks + 1, block_size, kv_heads, head_dim]
        raw = cache.view(torch.uint8)
        raw.index_copy_(1, dst, raw.index_select(1, src))


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
