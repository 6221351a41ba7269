"""The LM head fused with its log-softmax reduction, for prompt logprobs with at most the top-1.

A scoring request wants one number per prompt row: logit[target] - logsumexp(logits), and the
target's rank. Written out, a row's logits are vocab x 2 bytes (256 KB for Llama-3), more memory
traffic than the whole rest of the row's prefill costs; so this kernel never writes them. A small
kernel first takes each row's target logit (one dot product a row); then each program multiplies
a tile of rows by a range of the vocabulary tile after tile (a GEMM's main loop) and keeps, per
row, an online max and sum of exponentials, the argmax and how many other ids score at least the
target; a few torch ops then combine the ranges. float32 accumulation: the logits are never
rounded to the model's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.config import cdiv, next_power_of_2
from tandem.model.fused import num_sms

# tile shape and launch (untuned; `benchmarks/prompt_logprobs.py --sweep` compares others)
BLOCK_V = 128
BLOCK_K = 64
MAX_BLOCK_R = 128
NUM_WARPS = 8
NUM_STAGES = 3
TARGET_BLOCK_R = 16  # the target logits' rows a program
TARGET_BLOCK_K = 128


@triton.jit
def _soft_capped(logits, softcap):
    """cap * tanh(logit / cap), as tanh(y) = 1 - 2 / (exp(2y) + 1): saturating without overflow harm."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * logits / softcap) + 1.0))


@triton.jit(do_not_specialize=["rows"])
def target_logits_kernel(
    hidden_ptr,  # [tokens, hidden]
    index_ptr,  # [rows] int64: each row's token in hidden
    weight_ptr,  # [>= vocab, hidden]
    targets_ptr,  # [rows] int64
    out_ptr,  # [rows] float32: each row's target logit
    rows,
    hidden_size,
    hidden_stride,
    softcap,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = row < rows
    token = tl.load(index_ptr + row, mask=in_rows, other=0).to(tl.int64)
    target = tl.load(targets_ptr + row, mask=in_rows, other=0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    products = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        mask = in_rows[:, None] & (k0 + k < hidden_size)[None, :]
        a = tl.load(
            hidden_ptr + token[:, None] * hidden_stride + (k0 + k)[None, :], mask=mask, other=0.0
        )
        b = tl.load(
            weight_ptr + target[:, None] * hidden_size + (k0 + k)[None, :], mask=mask, other=0.0
        )
        products += a.to(tl.float32) * b.to(tl.float32)
    logit = tl.sum(products, axis=1)
    if SOFTCAP:
        logit = _soft_capped(logit, softcap)
    tl.store(out_ptr + row, logit, mask=in_rows)


@triton.jit(do_not_specialize=["rows", "vocab_per_split"])
def lm_head_stats_kernel(
    hidden_ptr,  # [tokens, hidden]
    index_ptr,  # [rows] int64: each row's token in hidden (gathered here, not copied first)
    weight_ptr,  # [>= vocab, hidden]
    targets_ptr,  # [rows] int64
    target_logit_ptr,  # [rows] float32: target_logits_kernel's
    max_ptr,  # [splits, rows] float32: each range's max logit
    sum_ptr,  # [splits, rows] float32: its sum of exp(logit - max)
    argmax_ptr,  # [splits, rows] int32: the id of the range's max
    above_ptr,  # [splits, rows] int32: the range's ids other than the target scoring >= it
    rows,
    vocab,
    hidden_size,
    hidden_stride,
    vocab_per_split,  # a multiple of BLOCK_V
    softcap,  # Gemma 2's final soft cap: cap * tanh(logit / cap), with SOFTCAP
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # float32 inputs: "ieee", not TF32
    SOFTCAP: tl.constexpr,
):
    split = tl.program_id(1)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = row < rows
    target = tl.load(targets_ptr + row, mask=in_rows, other=-1)
    target_logit = tl.load(target_logit_ptr + row, mask=in_rows, other=float("inf"))
    token = tl.load(index_ptr + row, mask=in_rows, other=0)
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    argmax = tl.zeros([BLOCK_R], tl.int32)
    above = tl.zeros([BLOCK_R], tl.int32)
    first = split * vocab_per_split
    end = tl.minimum(first + vocab_per_split, vocab)
    k = tl.arange(0, BLOCK_K)
    for v0 in range(first, end, BLOCK_V):
        col = v0 + tl.arange(0, BLOCK_V)
        in_cols = col < end
        logits = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            in_k = k0 + k < hidden_size
            a = tl.load(
                hidden_ptr + token.to(tl.int64)[:, None] * hidden_stride + (k0 + k)[None, :],
                mask=in_rows[:, None] & in_k[None, :],
                other=0.0,
            )
            b = tl.load(
                weight_ptr + col.to(tl.int64)[None, :] * hidden_size + (k0 + k)[:, None],
                mask=in_cols[None, :] & in_k[:, None],
                other=0.0,
            )
            logits = tl.dot(a, b, logits, input_precision=PRECISION)
        if SOFTCAP:
            logits = _soft_capped(logits, softcap)
        logits = tl.where(in_cols[None, :], logits, float("-inf"))
        tile_best = tl.max(logits, axis=1)
        tile_arg = tl.argmax(logits, axis=1, tie_break_left=True).to(tl.int32) + v0
        argmax = tl.where(tile_best > best, tile_arg, argmax)  # strict: the first maximum
        new_best = tl.maximum(best, tile_best)
        total = total * tl.exp(best - new_best) + tl.sum(tl.exp(logits - new_best[:, None]), 1)
        best = new_best
        # the target itself is left out: its logit here may round apart from target_logit
        at_least = (logits >= target_logit[:, None]) & (col[None, :] != target[:, None])
        above += tl.sum(at_least.to(tl.int32), axis=1)
    out = split * rows + row
    tl.store(max_ptr + out, best, mask=in_rows)
    tl.store(sum_ptr + out, total, mask=in_rows)
    tl.store(argmax_ptr + out, argmax, mask=in_rows)
    tl.store(above_ptr + out, above, mask=in_rows)


def lm_head_logprobs(
    hidden: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    values: torch.Tensor,
    ids: torch.Tensor,
    ranks: torch.Tensor,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> None:
    """The rows `index` [rows] of hidden [tokens, hidden] through the LM head `weight` ->
    values[:, 0] = log_softmax[target] and ranks = the ids scoring at least the target (itself
    included, vLLM's rank); with a second column (the top-1), values[:, 1] = the max logprob and
    ids[:, 0] = its id. `softcap`: the logits are cap * tanh(logit / cap)."""
    rows, hidden_size = index.shape[0], hidden.shape[1]
    assert hidden.stride(1) == 1 and weight.is_contiguous()
    index, targets = index.contiguous(), targets.contiguous()
    block_r = min(MAX_BLOCK_R, max(16, next_power_of_2(rows)))
    row_blocks = cdiv(rows, block_r)
    vocab_blocks = cdiv(vocab, BLOCK_V)
    if num_splits is None:  # two programs per SM
        num_splits = cdiv(2 * num_sms(hidden.device), row_blocks)
    vocab_per_split = cdiv(vocab_blocks, max(1, min(num_splits, vocab_blocks))) * BLOCK_V
    num_splits = cdiv(vocab, vocab_per_split)
    target_logit = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    target_logits_kernel[(cdiv(rows, TARGET_BLOCK_R),)](
        hidden, index, weight, targets, target_logit, rows, hidden_size, hidden.stride(0),
        float(softcap or 0.0), BLOCK_R=TARGET_BLOCK_R, BLOCK_K=TARGET_BLOCK_K,
        SOFTCAP=bool(softcap),
    )  # fmt: skip
    stats = torch.empty(2, num_splits, rows, dtype=torch.float32, device=hidden.device)
    counts = torch.empty(2, num_splits, rows, dtype=torch.int32, device=hidden.device)
    lm_head_stats_kernel[(row_blocks, num_splits)](
        hidden, index, weight, targets, target_logit, stats[0], stats[1], counts[0], counts[1],
        rows, vocab, hidden_size, hidden.stride(0), vocab_per_split, float(softcap or 0.0),
        BLOCK_R=block_r, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        SOFTCAP=bool(softcap), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    split_max, best_split = stats[0].max(dim=0)  # [rows]
    lse = split_max + (stats[1] * torch.exp(stats[0] - split_max)).sum(dim=0).log()
    values[:, 0] = target_logit - lse
    ranks.copy_(counts[1].sum(dim=0) + 1)
    if values.shape[1] > 1:
        values[:, 1] = split_max - lse
        ids[:, 0] = counts[0].gather(0, best_split[None])[0]
