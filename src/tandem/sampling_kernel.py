"""Fused sampling kernels: Gumbel-max sampling, and the sampled tokens' logprobs and ranks.

`gumbel_argmax`, for rows without top-k/top-p/min-p, computes per row argmax(logits /
temperature + gumbel(seed, position, token)) with the same counter-based hash as
`sampling.gumbel_noise`, or the plain argmax for temperature 0, without materializing the
[rows, vocab] noise. On CUDA the noise's two logs are the hardware's approximate log2 (2.3x
faster at 256 rows with 4-warp programs, BENCHMARKS.md eighth run): the torch sampler's tokens,
except where a row's two best scores lie within that approximation (millionths).

`sampled_logprobs`, in steps with sample logprobs, reads the logits once more for each row's
logsumexp and the sampled token's rank, where a log-softmax would write and read them again in
float32 (a [256, 128256] step: 131 MB each way).

Each row's vocabulary is cut into chunks so that a few rows still fill the device; a second,
small kernel combines each row's chunks. The argmax's chunks depend on the row count (a maximum
is the same in any order); the logsumexp's are a fixed length, so that a row's logprobs keep
their bits whatever rows share its step (deterministic mode's promise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tandem import pdl
from tandem.config import cdiv, next_power_of_2
from tandem.model.fused import num_sms

BLOCK = 2048
NUM_WARPS = 8  # per program, the engine's launch
LOGPROB_CHUNK_BLOCKS = 2  # BLOCKs of ids per logsumexp chunk: 63 chunks of Llama 3's vocabulary


@triton.jit
def _mix32(h):
    # every product is cut back to 32 bits, whatever width the constant promotes it to
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B).to(tl.uint32)
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35).to(tl.uint32)
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["num_chunks"])  # per step: see attention.triton_kernels
def gumbel_argmax_kernel(
    logits_ptr,  # [rows, vocab], any float dtype (read as float32)
    best_score_ptr,  # [rows, num_chunks] float32: each chunk's best score
    best_token_ptr,  # [rows, num_chunks] int32: and its token
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    logits_stride,
    vocab,
    chunk_len,  # a multiple of BLOCK
    num_chunks,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,  # on CUDA: the hardware's approximate log2 (the interpreter lacks it)
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    # FAST_LOG scores in log2 units: logit * log2(e) / T - log2(-log2(u)) is the natural-log
    # score over ln(2), less a constant, so the argmax is the same
    scale = 1.4426950408889634 / divisor
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    position = tl.load(positions_ptr + row).to(tl.uint32)
    row_key = _mix32(seed ^ _mix32(position))
    first = chunk * chunk_len
    end = tl.minimum(first + chunk_len, vocab)
    lane = tl.arange(0, BLOCK)
    # each lane keeps its own best over the blocks (no reduction inside the loop); a lane's
    # tokens only grow, so strict > keeps its first maximum
    best_score = tl.full([BLOCK], float("-inf"), tl.float32)
    best_token = first + lane
    for start in range(first, end, BLOCK):
        token = start + lane
        in_chunk = token < end
        logit = tl.load(
            logits_ptr + row.to(tl.int64) * logits_stride + token,
            mask=in_chunk,
            other=float("-inf"),
        ).to(tl.float32)
        h = _mix32((row_key + (token.to(tl.uint32) * 0x9E3779B9).to(tl.uint32)).to(tl.uint32))
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as sampling.uniform
        # -log2(u) is at least 8.6e-8 (u <= 1 - 2**-24); the approximate log2 may give 0 or less
        # so close to 1, whose log is then -inf or NaN: floored just under the exact least
        score = (
            logit * scale - libdevice.fast_log2f(tl.maximum(-libdevice.fast_log2f(u), 8.5e-8))
            if FAST_LOG
            else logit / divisor - tl.log(-tl.log(u))
        )
        score = tl.where(greedy, logit, score)
        score = tl.where(in_chunk, score, float("-inf"))
        better = score > best_score
        best_token = tl.where(better, token, best_token)
        best_score = tl.where(better, score, best_score)
    # the chunk's first maximum, as in torch.argmax: the smallest token among the lanes holding it
    chunk_best = tl.max(best_score, axis=0)
    is_best = best_score == chunk_best
    chunk_token = tl.min(tl.where(is_best, best_token, end), axis=0)
    tl.store(best_score_ptr + row * num_chunks + chunk, chunk_best)
    tl.store(best_token_ptr + row * num_chunks + chunk, chunk_token)


@triton.jit(do_not_specialize=["num_chunks"])  # per step: see attention.triton_kernels
def pick_best_chunk_kernel(
    best_score_ptr, best_token_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    pdl.wait(PDL)
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    used = chunks < num_chunks
    score = tl.load(best_score_ptr + row * num_chunks + chunks, mask=used, other=float("-inf"))
    token = tl.load(best_token_ptr + row * num_chunks + chunks, mask=used, other=0)
    best = tl.argmax(score, axis=0, tie_break_left=True)  # the earliest chunk among equals
    tl.store(out_ptr + row, tl.sum(tl.where(chunks == best, token, 0), axis=0).to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    num_chunks: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """[rows, vocab] logits (bf16, fp16 or fp32) -> [rows] int64 sampled (or greedy) token ids.

    `num_chunks` per row defaults to eight programs per SM: the hash and two logs per token
    make the kernel compute-bound, and more, wider programs hide their latency (BENCHMARKS.md,
    seventh run's sweep: 128 -> 116 µs for 256 rows of Qwen3's vocabulary)."""
    rows, vocab = logits.shape
    blocks = cdiv(vocab, BLOCK)
    if num_chunks is None:
        num_chunks = cdiv(8 * num_sms(logits.device), rows)
    chunk_len = cdiv(blocks, max(1, min(num_chunks, blocks))) * BLOCK
    num_chunks = cdiv(vocab, chunk_len)
    best_score = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_token = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    gumbel_argmax_kernel[(rows, num_chunks)](
        logits, best_score, best_token, temperature, seeds, positions, logits.stride(0), vocab,
        chunk_len, num_chunks, BLOCK=BLOCK, FAST_LOG=logits.is_cuda, num_warps=num_warps,
        **pdl.launch_args(logits.device),
    )  # fmt: skip
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    pick_best_chunk_kernel[(rows,)](
        best_score,
        best_token,
        out,
        num_chunks,
        CHUNKS=next_power_of_2(blocks),  # the most any row count gives: one kernel
        **pdl.launch_args(logits.device),
    )
    return out


@triton.jit(do_not_specialize=["num_chunks"])  # per step: see attention.triton_kernels
def logprob_stats_kernel(
    values_ptr,  # [rows, vocab], any float dtype (read as float32; -inf allowed)
    sampled_ptr,  # [rows] int64
    chunk_max_ptr,  # [rows, num_chunks] float32: each chunk's max value
    chunk_sum_ptr,  # [rows, num_chunks] float32: its sum of exp(value - max)
    chunk_above_ptr,  # [rows, num_chunks] int32: its ids valued at least the sampled one
    values_stride,
    vocab,
    chunk_len,  # a multiple of BLOCK
    num_chunks,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = values_ptr + row.to(tl.int64) * values_stride
    target = tl.load(row_ptr + tl.load(sampled_ptr + row)).to(tl.float32)
    first = chunk * chunk_len
    end = tl.minimum(first + chunk_len, vocab)
    lane = tl.arange(0, BLOCK)
    # each lane keeps its own online max and sum (log2 units), reduced once after the loop
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    above = tl.zeros([BLOCK], tl.int32)
    for start in range(first, end, BLOCK):
        token = start + lane
        value = tl.load(row_ptr + token, mask=token < end, other=float("-inf")).to(tl.float32)
        above += (value >= target).to(tl.int32)
        scaled = value * 1.4426950408889634
        new_max = tl.maximum(lane_max, scaled)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # lanes that saw only -inf
        lane_sum = lane_sum * tl.exp2(lane_max - safe) + tl.exp2(scaled - safe)
        lane_max = new_max
    best = tl.max(lane_max, axis=0)
    safe = tl.where(best == float("-inf"), 0.0, best)
    total = tl.sum(lane_sum * tl.exp2(lane_max - safe), axis=0)
    at = row * num_chunks + chunk
    tl.store(chunk_max_ptr + at, best * 0.6931471805599453)  # back to natural-log units
    tl.store(chunk_sum_ptr + at, total)
    tl.store(chunk_above_ptr + at, tl.sum(above, axis=0))


@triton.jit(do_not_specialize=["num_chunks"])  # per step: see attention.triton_kernels
def logprob_combine_kernel(
    values_ptr,
    sampled_ptr,
    chunk_max_ptr,
    chunk_sum_ptr,
    chunk_above_ptr,
    value_out_ptr,  # [rows] float32: the sampled id's value, less the row's logsumexp if LOGPROBS
    rank_out_ptr,  # [rows] int32: the ids valued at least the sampled one (itself included)
    shift_out_ptr,  # [rows] float32: the logsumexp if LOGPROBS, else 0
    values_stride,
    num_chunks,
    CHUNKS: tl.constexpr,
    LOGPROBS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    used = chunks < num_chunks
    at = row * num_chunks + chunks
    chunk_max = tl.load(chunk_max_ptr + at, mask=used, other=float("-inf"))
    chunk_sum = tl.load(chunk_sum_ptr + at, mask=used, other=0.0)
    above = tl.load(chunk_above_ptr + at, mask=used, other=0)
    sampled = tl.load(sampled_ptr + row)
    target = tl.load(values_ptr + row.to(tl.int64) * values_stride + sampled).to(tl.float32)
    shift = 0.0
    if LOGPROBS:
        best = tl.max(chunk_max, axis=0)
        weight = tl.where(chunk_max == float("-inf"), 0.0, tl.exp(chunk_max - best))
        shift = best + tl.log(tl.sum(chunk_sum * weight, axis=0))
    tl.store(value_out_ptr + row, target - shift)
    tl.store(rank_out_ptr + row, tl.sum(above, axis=0))
    tl.store(shift_out_ptr + row, shift)


def sampled_logprobs(
    values: torch.Tensor,
    sampled: torch.Tensor,
    logprobs: bool,
    value_out: torch.Tensor,
    rank_out: torch.Tensor,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """[rows, vocab] values (logits, any float dtype) and [rows] sampled ids -> value_out = the
    sampled id's value (less the row's logsumexp if `logprobs`: its log-probability), rank_out =
    the ids valued at least as high; returns each row's shift ([rows] float32: that logsumexp, or
    0). One read of the values, never a [rows, vocab] float32 copy. By default the chunks'
    length is fixed: a row's sums never depend on how many rows the step has."""
    rows, vocab = values.shape
    blocks = cdiv(vocab, BLOCK)
    if num_chunks is None:
        num_chunks = cdiv(blocks, LOGPROB_CHUNK_BLOCKS)
    chunk_len = cdiv(blocks, max(1, min(num_chunks, blocks))) * BLOCK
    num_chunks = cdiv(vocab, chunk_len)
    stats = torch.empty(2, rows, num_chunks, dtype=torch.float32, device=values.device)
    above = torch.empty(rows, num_chunks, dtype=torch.int32, device=values.device)
    logprob_stats_kernel[(rows, num_chunks)](
        values, sampled, stats[0], stats[1], above, values.stride(0), vocab, chunk_len,
        num_chunks, BLOCK=BLOCK, num_warps=NUM_WARPS, **pdl.launch_args(values.device),
    )  # fmt: skip
    shift = torch.empty(rows, dtype=torch.float32, device=values.device)
    logprob_combine_kernel[(rows,)](
        values, sampled, stats[0], stats[1], above, value_out, rank_out, shift, values.stride(0),
        num_chunks, CHUNKS=next_power_of_2(blocks), LOGPROBS=logprobs,
        **pdl.launch_args(values.device),
    )  # fmt: skip
    return shift
