"""The LM head fused with its log-softmax reduction, for prompt logprobs with at most the top-1.

A scoring request wants one number per prompt row: logit[target] - logsumexp(logits). Written
out, a row's logits are vocab x 2 bytes (256 KB for Llama-3), more memory traffic than the whole
rest of the row's prefill costs; so this kernel never writes them. Each program multiplies a tile
of rows by a range of the vocabulary tile after tile (a GEMM's main loop) and keeps, per row,
an online max and sum of exponentials, the target's logit and the argmax; a few torch ops then
combine the ranges. float32 accumulation: the logits are never rounded to the model's dtype.
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


@triton.jit(do_not_specialize=["rows", "vocab_per_split"])
def lm_head_stats_kernel(
    hidden_ptr,  # [tokens, hidden]
    index_ptr,  # [rows] int64: each row's token in hidden (gathered here, not copied first)
    weight_ptr,  # [>= vocab, hidden]
    targets_ptr,  # [rows] int64
    max_ptr,  # [splits, rows] float32: each range's max logit
    sum_ptr,  # [splits, rows] float32: its sum of exp(logit - max)
    target_ptr,  # [splits, rows] float32: the target's logit where the range holds it, else 0
    argmax_ptr,  # [splits, rows] int32: the id of the range's max
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
    token = tl.load(index_ptr + row, mask=in_rows, other=0)
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    target_logit = tl.zeros([BLOCK_R], tl.float32)
    argmax = tl.zeros([BLOCK_R], tl.int32)
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
        if SOFTCAP:  # tanh(y) = 1 - 2 / (exp(2y) + 1), saturating at +-1 without overflow harm
            logits = softcap * (1.0 - 2.0 / (tl.exp(2.0 * logits / softcap) + 1.0))
        logits = tl.where(in_cols[None, :], logits, float("-inf"))
        tile_best = tl.max(logits, axis=1)
        tile_arg = tl.argmax(logits, axis=1, tie_break_left=True).to(tl.int32) + v0
        argmax = tl.where(tile_best > best, tile_arg, argmax)  # strict: the first maximum
        new_best = tl.maximum(best, tile_best)
        total = total * tl.exp(best - new_best) + tl.sum(tl.exp(logits - new_best[:, None]), 1)
        best = new_best
        target_logit += tl.sum(tl.where(col[None, :] == target[:, None], logits, 0.0), axis=1)
    out = split * rows + row
    tl.store(max_ptr + out, best, mask=in_rows)
    tl.store(sum_ptr + out, total, mask=in_rows)
    tl.store(target_ptr + out, target_logit, mask=in_rows)
    tl.store(argmax_ptr + out, argmax, mask=in_rows)


def lm_head_logprobs(
    hidden: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    values: torch.Tensor,
    ids: torch.Tensor,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> None:
    """The rows `index` [rows] of hidden [tokens, hidden] through the LM head `weight` ->
    values[:, 0] = log_softmax[target]; with a second column (the top-1), values[:, 1] = the
    max logprob and ids[:, 0] = its id. `softcap`: the logits are cap * tanh(logit / cap)."""
    rows, hidden_size = index.shape[0], hidden.shape[1]
    assert hidden.stride(1) == 1 and weight.is_contiguous()
    block_r = min(MAX_BLOCK_R, max(16, next_power_of_2(rows)))
    row_blocks = cdiv(rows, block_r)
    vocab_blocks = cdiv(vocab, BLOCK_V)
    if num_splits is None:  # two programs per SM
        num_splits = cdiv(2 * num_sms(hidden.device), row_blocks)
    vocab_per_split = cdiv(vocab_blocks, max(1, min(num_splits, vocab_blocks))) * BLOCK_V
    num_splits = cdiv(vocab, vocab_per_split)
    stats = torch.empty(3, num_splits, rows, dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(num_splits, rows, dtype=torch.int32, device=hidden.device)
    lm_head_stats_kernel[(row_blocks, num_splits)](
        hidden, index.contiguous(), weight, targets.contiguous(), stats[0], stats[1], stats[2], argmax,
        rows, vocab, hidden_size, hidden.stride(0), vocab_per_split, float(softcap or 0.0),
        BLOCK_R=block_r, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        SOFTCAP=bool(softcap), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    split_max, best_split = stats[0].max(dim=0)  # [rows]
    lse = split_max + (stats[1] * torch.exp(stats[0] - split_max)).sum(dim=0).log()
    values[:, 0] = stats[2].sum(dim=0) - lse
    if values.shape[1] > 1:
        values[:, 1] = split_max - lse
        ids[:, 0] = argmax.gather(0, best_split[None])[0]
