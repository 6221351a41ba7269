"""benchmarks/cache_layout.py's emulation of a head-by-head KV cache: the folded cache, tables
and queries give each row the attention of the engine's layout (the torch reference)."""

from __future__ import annotations

import torch

from benchmark_script import import_benchmark
from tandem.attention.torch_ref import decode_attention

cache_layout = import_benchmark("cache_layout")


def test_head_by_head_blocks_hold_the_same_attention():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, size = 8, 4, 32, 16
    cache = torch.randn(2, 9, size, kv_heads, dim, generator=g)
    tables = torch.randperm(8, generator=g)[:8].view(2, 4).int()
    q = torch.randn(2, heads, dim, generator=g)
    lens = torch.tensor([60, 37], dtype=torch.int32)
    folded, per_head, q_heads = cache_layout.head_major(
        cache, tables, q.view(2, kv_heads, heads // kv_heads, dim)
    )
    assert folded.shape == (2, 9 * kv_heads, size, 1, dim) and per_head.shape == (8, 4)
    # block b's head h is block b * kv_heads + h, its keys contiguous
    assert torch.equal(folded[0, 5 * kv_heads + 2, :, 0], cache[0, 5, :, 2])
    expected = decode_attention(q, cache, tables, lens, 0.2)
    got = decode_attention(q_heads, folded, per_head, lens.repeat_interleave(kv_heads), 0.2)
    torch.testing.assert_close(got.view(2, heads, dim), expected, atol=1e-5, rtol=1e-5)
