"""Reference attention in plain torch: correct on CPU and CUDA, not fast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention import AttentionMetadata
from tandem.quant.fp8 import FP8_DTYPE, quantize


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v [tokens, kv_heads, head_dim] at their slots; an FP8 cache stores k / k_scale and
    v / v_scale in e4m3."""
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; its last slot takes padding rows
    flat = kv_cache.flatten(1, 2)
    slots = torch.where(slot_mapping < 0, flat.shape[1] - 1, slot_mapping)
    if kv_cache.dtype == FP8_DTYPE:  # as bytes: index_copy_ has no float8 CPU kernel
        flat, k, v = (
            t.view(torch.uint8) for t in (flat, quantize(k, k_scale), quantize(v, v_scale))
        )
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def read_kv(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries in `dtype`: an FP8 cache's e4m3 values times their scale (in float32)."""
    if cached.dtype != FP8_DTYPE:
        return cached
    return (cached.float() * scale).to(dtype)


def torch_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    scales = (k_scale, v_scale)
    if meta.decode_only:
        result = decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, scales)
    else:
        result = prefill_attention(q, kv_cache, meta, scale, scales)
    return result if out is None else out.copy_(result)


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Fixed-shape (CUDA-graph safe): gathers every table column and masks past each length."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    # [2, num_seqs, max_blocks * block_size, num_kv_heads, head_dim]
    kv = kv_cache[:, block_tables.long()].flatten(2, 3)
    k, v = (read_kv(kv[i], kv_scales[i], q.dtype) for i in (0, 1))
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k).float() * scale
    past_end = torch.arange(kv.shape[2], device=q.device) >= seq_lens[:, None]  # [num_seqs, slots]
    scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgs,bshd->bhgd", scores.softmax(dim=-1).to(v.dtype), v)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """One sequence at a time over host-known lengths: a cached prefix plus the new query tokens."""
    assert meta.query_start_loc_host is not None and meta.seq_lens_host is not None
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = starts[i], starts[i + 1]
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[i, :num_blocks].long()
        k, v = (
            read_kv(kv_cache[j, blocks].flatten(0, 1)[:seq_len], kv_scales[j], q.dtype).transpose(
                0, 1
            )
            for j in (0, 1)
        )
        num_new = end - start
        # query i sits at position seq_len - num_new + i and sees keys up to that position
        query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k, v, attn_mask=visible, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    return out
