"""Decode attention over two KV cache layouts, the same kernels and bytes (CUDA, bf16).

The engine's cache holds a block's keys token by token, each token's KV heads side by side
([blocks, block_size, kv_heads, head_dim]): a program of one KV head reads 256-byte rows two
kilobytes apart. Held head by head ([blocks, kv_heads, block_size, head_dim]), a program would
read each block's keys of its head as one contiguous run of block_size x 256 bytes. That layout
is emulated here without new kernels: the head folds into the block, so that block b's head h
is block b * kv_heads + h of a one-head cache, and each sequence becomes kv_heads sequences of
one KV head each, whose tables are b * kv_heads + h. Grid, tiles and bytes stay as they are.

Timed on rollout's shapes (Llama-3-8B heads, 32 prompts x 8 samples): the decode kernel alone
over 256 rows' own keys, and the whole call with the shared-prefix kernel over 1,024 shared
keys. Each call is checked against the torch reference first.
Usage: PYTHONPATH=src python benchmarks/cache_layout.py [--own 64 256 500]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tandem.attention import AttentionMetadata, SharedPrefixes
from tandem.attention.torch_ref import decode_attention
from tandem.attention.triton_backend import TritonAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def head_major(cache: torch.Tensor, tables: torch.Tensor, q: torch.Tensor) -> tuple:
    """The same keys and queries held head by head: (cache [2, blocks * kv_heads, block_size, 1,
    head_dim], tables [seqs * kv_heads, max_blocks], q [seqs * kv_heads, group, head_dim]);
    sequence s's KV head h is sequence s * kv_heads + h."""
    two, blocks, size, heads, dim = cache.shape
    folded = cache.permute(0, 1, 3, 2, 4).contiguous().view(two, blocks * heads, size, 1, dim)
    per_head = tables[:, None, :] * heads + torch.arange(heads, device=tables.device)[None, :, None]
    seqs = q.shape[0]
    return folded, per_head.reshape(seqs * heads, -1).int(), q.view(seqs * heads, -1, dim)


def rollout_call(own: int, groups: int = 32, n: int = 8, prefix: int = 1024):
    """(cache, tables, q, lens) of rollout's decode call: `groups` prompts of
    `prefix` tokens, `n` samples each with `own` keys after it, on scattered blocks."""
    rows, shared_blocks, own_blocks = groups * n, prefix // BLOCK_SIZE, -(-own // BLOCK_SIZE)
    num_blocks = groups * shared_blocks + rows * own_blocks
    cache = torch.randn(2, num_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                        dtype=torch.bfloat16)  # fmt: skip
    blocks = torch.randperm(num_blocks, device="cuda").int()
    common = blocks[: groups * shared_blocks].view(groups, 1, shared_blocks).expand(groups, n, -1)
    owned = blocks[groups * shared_blocks :].view(groups, n, own_blocks)
    tables = torch.cat([common, owned], dim=2).reshape(rows, -1).contiguous()
    lens = torch.full((rows,), prefix + own, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return cache, tables, q, lens


def shared_meta(lens: torch.Tensor, tables: torch.Tensor, group_size: int, prefix: int):
    """Metadata of rows in groups of `group_size` consecutive rows sharing `prefix` keys, under
    the engine's bound of half the rows on groups."""
    rows = lens.shape[0]
    groups, max_groups = rows // group_size, rows // 2
    starts = torch.full((max_groups + 1,), rows, dtype=torch.int32, device="cuda")
    starts[: groups + 1] = torch.arange(0, rows + 1, group_size, dtype=torch.int32, device="cuda")
    group_prefix = torch.zeros(max_groups, dtype=torch.int32, device="cuda")
    group_prefix[:groups] = prefix
    return AttentionMetadata(lens, lens, lens, tables, decode_only=True, shared=SharedPrefixes(
        prefix_lens=torch.full_like(lens, prefix), group_rows=torch.arange(rows, dtype=torch.int32,
        device="cuda"), group_starts=starts, group_prefix=group_prefix,
        num_groups=torch.tensor([groups], dtype=torch.int32, device="cuda"), max_groups=max_groups,
    ))  # fmt: skip


def time_call(cache, tables, q, lens, kv_heads: int, meta: AttentionMetadata) -> float:
    """µs of one graph-replayed decode call (q [seqs, heads, head_dim]), after a check against
    the torch reference."""
    backend = TritonAttention(q.shape[1], kv_heads, HEAD_DIM, q.shape[0], torch.device("cuda"))
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    backend.decode(q, out, cache, meta, scale)
    expected = decode_attention(q.float(), cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(
        lambda: backend.decode(q, out, cache, meta, scale), return_mode="median"
    )
    return 1000 * ms


def compare(own: int) -> None:
    cache, tables, q, lens = rollout_call(own)
    rows = q.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    folded, per_head, q_heads = head_major(cache, tables, q.view(rows, NUM_KV_HEADS, group, -1))
    lens_heads = lens.repeat_interleave(NUM_KV_HEADS)
    prefix = int(lens[0]) - own
    # the decode kernel alone over each row's own keys (its table past the shared blocks)
    own_tables = tables[:, prefix // BLOCK_SIZE :].contiguous()
    own_heads = per_head[:, prefix // BLOCK_SIZE :].contiguous()
    own_lens = torch.full_like(lens, own)
    own_meta = AttentionMetadata(own_lens, own_lens, own_lens, own_tables, decode_only=True)
    own_lens_h = own_lens.repeat_interleave(NUM_KV_HEADS)
    own_meta_h = AttentionMetadata(own_lens_h, own_lens_h, own_lens_h, own_heads,
                                   decode_only=True)  # fmt: skip
    token_own = time_call(cache, own_tables, q, own_lens, NUM_KV_HEADS, own_meta)
    head_own = time_call(folded, own_heads, q_heads, own_lens_h, 1, own_meta_h)
    # the whole call: rows in groups of 8 samples (head by head: 8 samples of one KV head)
    rows_h = rows * NUM_KV_HEADS
    order = torch.arange(rows_h, device="cuda").view(-1, 8, NUM_KV_HEADS).transpose(1, 2)
    order = order.reshape(-1)  # group (prompt, head): its 8 samples' sequences of that head
    meta_t = shared_meta(lens, tables, 8, prefix)
    meta_h = shared_meta(lens_heads, per_head, 8, prefix)
    meta_h.shared.group_rows.copy_(order.int())
    token_all = time_call(cache, tables, q, lens, NUM_KV_HEADS, meta_t)
    head_all = time_call(folded, per_head, q_heads, lens_heads, 1, meta_h)
    mb_own = 2 * rows * own * NUM_KV_HEADS * HEAD_DIM * 2 / 1e6
    mb_all = mb_own + 2 * 32 * prefix * NUM_KV_HEADS * HEAD_DIM * 2 / 1e6
    print(f"own={own:4d}  decode alone ({mb_own:.0f} MB): token-major {token_own:6.1f} µs "
          f"({mb_own / token_own:.2f} TB/s), head-major {head_own:6.1f} ({mb_own / head_own:.2f})"
          f"  |  with the shared prefix ({mb_all:.0f} MB): {token_all:6.1f} "
          f"({mb_all / token_all:.2f}), {head_all:6.1f} ({mb_all / head_all:.2f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--own", type=int, nargs="+", default=[64, 256, 500])
    args = parser.parse_args()
    for own in args.own:
        compare(own)


if __name__ == "__main__":
    main()
