"""Fused Gumbel-max sampling for rows without top-k/top-p/min-p: one pass over the logits.

Computes, per row, argmax(logits / temperature + gumbel(seed, position, token)) with the same
counter-based hash as `sampling.gumbel_noise`, or the plain argmax for temperature 0, without
materializing the [rows, vocab] noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _mix32(h):
    # every product is cut back to 32 bits, whatever width the constant promotes it to
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B).to(tl.uint32)
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35).to(tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def gumbel_argmax_kernel(
    logits_ptr,  # [rows, vocab] float32
    out_ptr,  # [rows] int64
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    logits_stride,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    position = tl.load(positions_ptr + row).to(tl.uint32)
    row_key = _mix32(seed ^ _mix32(position))
    best_score = float("-inf")
    best_token = 0
    for start in range(0, vocab, BLOCK):
        token = start + tl.arange(0, BLOCK)
        in_vocab = token < vocab
        logit = tl.load(
            logits_ptr + row.to(tl.int64) * logits_stride + token,
            mask=in_vocab,
            other=float("-inf"),
        )
        h = _mix32((row_key + (token.to(tl.uint32) * 0x9E3779B9).to(tl.uint32)).to(tl.uint32))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noise = -tl.log(-tl.log(u))
        score = tl.where(greedy, logit, logit / divisor + noise)
        score = tl.where(in_vocab, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_token = tl.argmax(score, axis=0) + start
        better = block_best > best_score  # strictly: the first maximum wins, as in torch.argmax
        best_token = tl.where(better, block_token, best_token)
        best_score = tl.where(better, block_best, best_score)
    tl.store(out_ptr + row, best_token.to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """[rows, vocab] float32 -> [rows] int64 sampled (or greedy) token ids."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    gumbel_argmax_kernel[(logits.shape[0],)](
        logits, out, temperature, seeds, positions, logits.stride(0), logits.shape[1], BLOCK=BLOCK
    )
    return out
