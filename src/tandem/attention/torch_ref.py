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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    options = {
        "kv_scales": (k_scale, v_scale),
        "sliding_window": sliding_window,
        "logits_soft_cap": logits_soft_cap,
    }
    if meta.decode_only:
        result = decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, **options)
    else:
        result = prefill_attention(q, kv_cache, meta, scale, **options)
    return result if out is None else out.copy_(result)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2's attention and final logits); unchanged for None."""
    return scores if not cap else torch.tanh(scores / cap) * cap


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Fixed-shape (CUDA-graph safe): gathers every table column and masks past each length
    (and before each window)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    # [2, num_seqs, max_blocks * block_size, num_kv_heads, head_dim]
    kv = kv_cache[:, block_tables.long()].flatten(2, 3)
    k, v = (read_kv(kv[i], kv_scales[i], q.dtype) for i in (0, 1))
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = soft_cap(torch.einsum("bhgd,bshd->bhgs", qg, k).float() * scale, logits_soft_cap)
    key_pos = torch.arange(kv.shape[2], device=q.device)
    hidden = key_pos >= seq_lens[:, None]  # [num_seqs, slots]
    if sliding_window is not None:
        hidden |= key_pos <= seq_lens[:, None] - 1 - sliding_window
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgs,bshd->bhgd", scores.softmax(dim=-1).to(v.dtype), v)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
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
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= query_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos > query_pos[:, None] - sliding_window
        query = q[start:end].transpose(0, 1)
        if logits_soft_cap:
            attended = capped_attention(query, k, v, visible, scale, logits_soft_cap)
        else:
            attended = F.scaled_dot_product_attention(
                query, k, v, attn_mask=visible, scale=scale, enable_gqa=True
            )
        out[start:end] = attended.transpose(0, 1)
    return out


def capped_attention(
    q: torch.Tensor,  # [num_heads, queries, head_dim]
    k: torch.Tensor,  # [num_kv_heads, keys, head_dim], and v
    v: torch.Tensor,
    visible: torch.Tensor,  # [queries, keys] bool
    scale: float,
    cap: float,
) -> torch.Tensor:
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = soft_cap((q @ k.transpose(1, 2)).float() * scale, cap)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs.to(v.dtype) @ v).to(q.dtype)
