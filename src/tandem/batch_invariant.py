"""Deterministic mode: every reduction's order fixed by the row's own shape, never the batch's.

A token's result then depends only on its own inputs, so a request gives bit-identical tokens
and logprobs alone or in any batch, sync or async, in any chunk size, after preemption and from
the prefix cache. The batch-dependent choices of the default mode, and what replaces them:
- GEMMs: cuBLAS picks its kernel (and split-K) by the number of rows M, and `splitk.plan` picks
  splits by rows. Here every linear layer and the LM head run the Triton GEMM of `splitk` with
  tiles and a split count that follow the weight's shape and the device alone
  (`invariant_tiles`): each output element sums its K in the same BLOCK_K steps and slices
  whatever M is. The o and down projections keep their float32 slices for the add + RMSNorm
  that follows, which adds them in a fixed order, as in the default mode. On CPU, a product
  per row.
- attention: the decode split count (`TritonAttention.num_splits`) and tiles (`tiles_for`)
  follow the batch size, prefill tokens take another kernel, and shared-prefix (cascade)
  groups split a row's keys by its group. Here every query token, prefill or decode, is a row
  of the decode kernel with its own context length: one split, one tile shape, no cascade.
- the add + RMSNorm warps (`fused.norm_warps`) follow the row count: fixed here.
- tensor parallelism: the all-reduce's algorithm follows the message size, so deterministic
  mode runs on one device only (EngineConfig.validate).
The sampler is per row already: Gumbel noise keyed by seed, position and token, and an argmax
that is exact however the vocabulary is chunked (the smallest token wins a tie). Sample
logprobs sum each row's exponentials in vocabulary chunks of a fixed length, in every mode
(`sampling_kernel.sampled_logprobs`). Prompt logprobs take the invariant LM head and a
log-softmax per row here, not the fused LM-head kernel, whose vocabulary splits and row tiles
follow the step's rows (`prompt_logprobs.fused_lm_head`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.attention.torch_ref import decode_attention
from tandem.config import cdiv
from tandem.model import fused, splitk
from tandem.model.decoder import Decoder, RMSNorm
from tandem.model.moe import SparseMoeBlock
from tandem.quant.int4 import Int4Linear
from tandem.quant.linear import Fp8Linear

BLOCK_M = 64  # rows per program, for every M: one tensor-core instruction shape throughout


@functools.cache
def invariant_tiles(
    out_features: int, in_features: int, device: torch.device, residual: bool
) -> splitk.SplitTiles:
    """The one launch shape of a weight's GEMM, from its shape and the device: 128-feature K
    steps where they divide the width; 32-wide output tiles where 64-wide ones would not give
    every SM a program; and for a `residual` product (its slices added by the norm) the most
    K slices that divide the steps and keep two programs per SM at a decode step's one row
    tile. Llama-3-8B on 132 SMs: qkv 192 programs, o and down 128 tiles x 2 slices, gate_up
    448; a single 64-wide tile and slice left 64 programs on the o and down matrices. 32-wide
    tiles take four pipeline stages (H200, 32 rows: qkv 20.4 -> 18.1 µs, down 36.0 -> 31.9;
    64-wide ones were slower with four)."""
    block_k = next((b for b in (128, 64, 32, 16) if in_features % b == 0), None)
    if block_k is None:
        raise ValueError(
            f"deterministic=True needs layer widths divisible by 16, got {in_features}"
        )
    sms = fused.num_sms(device)
    block_n = 64 if cdiv(out_features, 64) >= sms else 32
    splits = 1
    if residual:
        k_steps, tiles = in_features // block_k, cdiv(out_features, block_n)
        wanted = max(1, 2 * sms // tiles)
        splits = max(s for s in range(1, min(wanted, k_steps) + 1) if k_steps % s == 0)
    return splitk.SplitTiles(
        BLOCK_M, block_n, block_k, splits, num_stages=4 if block_n == 32 else 3
    )


def make_batch_invariant(model: Decoder) -> None:
    """Every linear layer of `model`, and its LM head, computed batch-invariantly. FP8 layers
    (cuBLASLt's FP8 GEMM picks kernels by rows) and mixture-of-experts blocks (the grouped
    GEMM's row blocks follow the batch's routing) and int4 layers (their kernel's tiles follow
    the rows) are not covered: refused."""
    covered_not = Fp8Linear | Int4Linear | SparseMoeBlock
    uncovered = sorted({type(m).__name__ for m in model.modules() if isinstance(m, covered_not)})
    if uncovered:
        raise ValueError(
            f"deterministic=True covers dense 16- and 32-bit models; this one has {uncovered}"
        )
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_linear_forward, module)
            # decoder.to_residual: the slices of the weight's own split count
            module.residual_partials = functools.partial(residual_partials, module)
        if isinstance(module, RMSNorm):
            module.fixed_warps = True  # the norm's warps stop following the rows
    model.linear = invariant_linear


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return invariant_linear(x, module.weight, module.bias)


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T (+ bias), each row's sums in an order that the other
    rows do not change."""
    if not fused.use_kernels(x):
        rows = [F.linear(row, weight, bias) for row in x.split(1)]
        return torch.cat(rows) if rows else F.linear(x, weight, bias)
    tiles = invariant_tiles(*weight.shape, x.device, residual=False)
    if bias is None:  # the kernel rounds its float32 sums to x's dtype as it stores them
        return splitk.linear_partials(x.contiguous(), weight.contiguous(), tiles, out_dtype=x.dtype)
    out = splitk.linear_partials(x.contiguous(), weight.contiguous(), tiles)[0]
    return (out + bias).to(x.dtype)


def residual_partials(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The o or down projection on CUDA: float32 slices [splits, rows, out] of its product, in
    `invariant_tiles`' fixed split count, for the add + RMSNorm to add up."""
    tiles = invariant_tiles(*module.weight.shape, x.device, residual=True)
    return splitk.linear_partials(x.contiguous(), module.weight.contiguous(), tiles)


class InvariantAttention:
    """Every query token as its own decode row (its context: the keys up to its position),
    through one decode path with a fixed split count and tile shape."""

    def __init__(self, decode: AttentionBackend):
        self.decode = decode
        # the forward pass's rows, made at its first layer and read by the others: one set of
        # small kernels a step, not one a layer
        self.rows_of: tuple[AttentionMetadata, AttentionMetadata] | None = None

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        **options,  # k_scale, v_scale, sliding_window, logits_soft_cap: the backend's own
    ) -> torch.Tensor:
        if self.rows_of is None or self.rows_of[0] is not meta:  # a new forward pass
            self.rows_of = (meta, token_rows(meta, q.shape[0]))
        return self.decode(q, kv_cache, self.rows_of[1], scale, out, **options)


def token_rows(meta: AttentionMetadata, num_tokens: int) -> AttentionMetadata:
    """One row per query token: its sequence's block table, its own context length.
    E.g. query_start_loc [0, 1, 4], seq_lens [9, 6] -> rows of sequences [0, 1, 1, 1] with
    context lengths [9, 4, 5, 6].
    Padding tokens past the last sequence's (a graph's padded rows; its capture, on zeroed
    inputs) count as that sequence's last token, so no index leaves the tables."""
    starts = meta.query_start_loc
    tokens = torch.arange(num_tokens, device=starts.device, dtype=starts.dtype)
    seq = torch.searchsorted(starts[1:], tokens, right=True)  # [num_tokens]
    seq = seq.clamp_(max=starts.numel() - 2)
    last = starts[1:][seq] - 1  # each token's sequence's last query token
    seq_lens = (meta.seq_lens[seq] - (last - tokens).clamp(min=0)).to(meta.seq_lens.dtype)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.arange(num_tokens + 1, device=starts.device, dtype=starts.dtype),
        seq_lens=seq_lens,
        block_tables=meta.block_tables[seq],
        decode_only=True,
    )


def invariant_attention(name: str, attend: AttentionBackend) -> AttentionBackend:
    """The engine's attention made batch-invariant: the Triton decode pinned to one split and
    one tile shape, or the torch reference's decode one row at a time (its batched einsum sums
    in an order that follows the batch on CPU)."""
    if name == "triton":
        attend.fixed_splits = 1
        attend.single_sequence_tiles = attend.large_batch_tiles = attend.decode_tiles
        return InvariantAttention(attend)
    return InvariantAttention(decode_rows)


def decode_rows(
    q,
    kv_cache,
    meta: AttentionMetadata,
    scale: float,
    out=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """The torch reference decode, one row at a time (every call the same shapes)."""
    options = {
        "kv_scales": (k_scale, v_scale),
        "sliding_window": sliding_window,
        "logits_soft_cap": logits_soft_cap,
    }
    rows = [
        decode_attention(
            q[i : i + 1],
            kv_cache,
            meta.block_tables[i : i + 1],
            meta.seq_lens[i : i + 1],
            scale,
            **options,
        )
        for i in range(q.shape[0])
    ]
    result = torch.cat(rows) if rows else torch.empty_like(q)
    return result if out is None else out.copy_(result)
