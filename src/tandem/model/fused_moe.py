"""Experts of a mixture-of-experts layer as one grouped GEMM per projection (Triton).

The (token, expert) pairs of a step are sorted by expert, and each expert's run is padded to a
whole number of BLOCK_M rows (`align_by_expert`, one Triton launch; at decode sizes the same
steps run inside the routing's program, `align_in_one_program`; `align_by_expert_torch` is
their torch reference), so every block of sorted rows belongs to one expert: a program multiplies
its block by that expert's weights. No Python loop over experts, no host sync, fixed shapes
given the token count (CUDA-graph safe): the grid covers the most blocks any routing can need
(`max_sorted_rows`), and programs past the routed blocks return at once.

    gate_up = x[pair // top_k] @ w13[expert].T     [pairs, 2 * inter]   (grouped GEMM 1)
    act     = SiLU or GELU(gate) * up              [pairs, inter]       (SiLU: in GEMM 1)
    out     = weight[pair] * act @ w2[expert].T    [pairs, hidden]      (grouped GEMM 2)
    y       = out.view(tokens, top_k, hidden).sum(1)  (on one device: in the next add + RMSNorm)

`fused_experts_torch` is the same arithmetic in torch (CPU engines, and the reference).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem import envs, pdl
from tandem.config import cdiv, next_power_of_2
from tandem.model.fused import act_and_mul


class ExpertBlocks(NamedTuple):
    """Pairs sorted by expert, padded per expert to BLOCK_M rows."""

    sorted_pairs: torch.Tensor  # [max_rows] int32: pair index (token * top_k + k); num_pairs pads
    block_expert: torch.Tensor  # [max_rows // block_m] int32: the expert of each block
    num_rows: torch.Tensor  # [1] int32: rows in use (the padded runs' total)


def max_sorted_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted layout may need: each routed expert's run padded by up to block_m - 1, and
    at most min(pairs, experts) experts routed; every block holds a real pair, so at most
    num_pairs blocks. E.g. 8 pairs, 128 experts, block_m 16: 8 blocks, not the 121 that padding
    all 128 experts would take."""
    routed = min(num_pairs, num_experts)
    return min(num_pairs, (num_pairs + routed * (block_m - 1)) // block_m) * block_m


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids [tokens, top_k] -> the pairs sorted by expert in BLOCK_M-row runs. E.g. experts
    of 5 pairs [1, 0, 1, 1, 0], block_m 2: runs of expert 0 [1, 4], expert 1 [0, 2, 3, pad]
    -> sorted_pairs [1, 4, 0, 2, 3, 5, 5, ...], block_expert [0, 1, 1, ...], num_rows [6].
    In torch: the reference of `align_by_expert`."""
    flat = topk_ids.flatten()  # [pairs]
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))  # [experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [experts]
    order = flat.argsort(stable=True)  # [pairs] pair indices by expert
    expert_of = flat[order].long()
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    max_rows = max_sorted_rows(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, (padded_end - padded)[expert_of] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_expert, padded_end[-1:].to(torch.int32))


@triton.jit
def _expert_counts(topk_ids_ptr, num_pairs, first, BINS: tl.constexpr, SCAN: tl.constexpr):
    """([BINS] int32 pairs of each expert, [BINS] int32 those before pair `first`)."""
    counts = tl.zeros([BINS], tl.int32)
    before = tl.zeros([BINS], tl.int32)
    for start in range(0, num_pairs, SCAN):
        idx = start + tl.arange(0, SCAN)
        ids = tl.load(topk_ids_ptr + idx, mask=idx < num_pairs, other=0).to(tl.int32)
        counts += tl.histogram(ids, BINS, mask=idx < num_pairs)
        before += tl.histogram(ids, BINS, mask=idx < first)
    return counts, before


@triton.jit
def _place_chunk(
    topk_ids_ptr, sorted_pairs_ptr, first, next_row, num_pairs, BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Stores pairs [first, first + CHUNK) at their sorted rows: at `next_row` [BINS] of their
    expert (its run's start after its pairs before the chunk), after the chunk's earlier pairs
    of that expert (a stable sort). Returns the chunk's [CHUNK] expert ids (-1 past the pairs)."""
    experts = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK)
    pairs = first + lanes
    in_chunk = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=in_chunk, other=-1).to(tl.int32)
    mine = ids[:, None] == experts[None, :]  # [CHUNK, BINS]
    base = tl.sum(tl.where(mine, next_row[None, :], 0), axis=1)
    earlier_same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    tl.store(sorted_pairs_ptr + base + rank, pairs, mask=in_chunk)
    return ids


@triton.jit
def _fill_rest(
    sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, counts, padded, ends, num_pairs,
    num_experts, max_rows, program, programs, BLOCK_M: tl.constexpr, BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """What is not a pair's row, spread over the programs (no slot is written twice): the rows
    in use, padding after each run and past the runs, and each block's expert."""
    num_rows = tl.sum(padded, axis=0)
    lanes = tl.arange(0, CHUNK)
    if program == 0:
        tl.store(num_rows_ptr, num_rows)
        js = tl.arange(0, BLOCK_M)
        pad_slots = (ends - padded + counts)[:, None] + js[None, :]  # [BINS, BLOCK_M]
        pad = tl.zeros([BINS, BLOCK_M], tl.int32) + num_pairs
        tl.store(sorted_pairs_ptr + pad_slots, pad, mask=js[None, :] < (padded - counts)[:, None])
    for row in range(program * CHUNK + num_rows, max_rows, programs * CHUNK):
        rows = row + lanes
        tl.store(
            sorted_pairs_ptr + rows, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=rows < max_rows
        )
    for block in range(program * CHUNK, max_rows // BLOCK_M, programs * CHUNK):
        blocks = block + lanes
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        expert = tl.minimum(expert, num_experts - 1)  # blocks past the runs
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_rows // BLOCK_M)


@triton.jit
def align_kernel(
    topk_ids_ptr,  # [pairs]
    sorted_pairs_ptr,  # [max_rows] int32
    block_expert_ptr,  # [max_rows // BLOCK_M] int32
    num_rows_ptr,  # [1] int32
    num_pairs,
    num_experts,
    max_rows,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,  # pairs each program places
    SCAN: tl.constexpr,  # pairs counted per step
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    program, programs = tl.program_id(0), tl.num_programs(0)
    first = program * CHUNK
    # every program counts the pairs of each expert, all of them and those before its chunk
    counts, before = _expert_counts(topk_ids_ptr, num_pairs, first, BINS, SCAN)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [BINS]: where each expert's run ends
    _place_chunk(topk_ids_ptr, sorted_pairs_ptr, first, ends - padded + before, num_pairs, BINS,
                 CHUNK)  # fmt: skip
    _fill_rest(
        sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, counts, padded, ends, num_pairs,
        num_experts, max_rows, program, programs, BLOCK_M, BINS, CHUNK,
    )  # fmt: skip


@triton.jit
def align_in_one_program(
    topk_ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, num_pairs, num_experts,
    max_rows, BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
    SCAN: tl.constexpr,
):  # fmt: skip
    """`align_kernel`'s blocks made by one program (the tail of `moe_routing.topk_align_kernel`):
    the counts once, then the chunks in order, each after the pairs placed before it."""
    counts, _ = _expert_counts(topk_ids_ptr, num_pairs, 0, BINS, SCAN)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    next_row = ends - padded  # [BINS]: where each expert's next pair goes
    for first in range(0, num_pairs, CHUNK):
        ids = _place_chunk(topk_ids_ptr, sorted_pairs_ptr, first, next_row, num_pairs, BINS, CHUNK)
        next_row += tl.histogram(ids, BINS, mask=ids >= 0)
    _fill_rest(
        sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, counts, padded, ends, num_pairs,
        num_experts, max_rows, 0, 1, BLOCK_M, BINS, CHUNK,
    )  # fmt: skip


ALIGN_CHUNK = 64
ALIGN_SCAN = 1024
# A decode step's pairs (up to ALIGN_SCAN) are placed in chunks this small: more programs, each
# a quarter of the serial work (sm_90 code at 256 pairs: 1,224 instructions a thread against
# 2,632), and every program's count of all the pairs is short. Prefills keep ALIGN_CHUNK, where
# each program's count of every pair grows with the pairs.
ALIGN_DECODE_CHUNK = 16


def align_chunk_and_scan(num_pairs: int) -> tuple[int, int]:
    """`align_kernel`'s (pairs each program places, pairs counted per step) at num_pairs."""
    if num_pairs > ALIGN_SCAN:
        return ALIGN_CHUNK, ALIGN_SCAN
    return ALIGN_DECODE_CHUNK, max(ALIGN_DECODE_CHUNK, next_power_of_2(num_pairs))


def align_bins(num_experts: int) -> int:
    """The alignment's histogram bins: the experts' next power of two, at least 32 (one per
    lane of a warp; Triton's histogram pads to that anyway)."""
    return max(32, next_power_of_2(num_experts))


def empty_blocks(
    num_pairs: int, num_experts: int, block_m: int, device: torch.device
) -> ExpertBlocks:
    """The alignment's buffers, fixed by the pair count (`max_sorted_rows`)."""
    max_rows = max_sorted_rows(num_pairs, num_experts, block_m)
    return ExpertBlocks(
        torch.empty(max_rows, dtype=torch.int32, device=device),  # [max_rows] int32
        torch.empty(max_rows // block_m, dtype=torch.int32, device=device),  # [blocks] int32
        torch.empty(1, dtype=torch.int32, device=device),  # [1] int32
    )


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`align_by_expert_torch` as one Triton launch: the same blocks, fixed shapes, no host sync.
    Each program places a chunk of pairs after counting every pair (the counts are a histogram
    per scan of pairs), so no program waits on another."""
    flat = topk_ids.flatten()  # [pairs]
    assert flat.is_contiguous()
    num_pairs, device = flat.numel(), flat.device
    blocks = empty_blocks(num_pairs, num_experts, block_m, device)
    chunk, scan = align_chunk_and_scan(num_pairs)
    align_kernel[(cdiv(num_pairs, chunk),)](
        flat, *blocks, num_pairs, num_experts, blocks.sorted_pairs.numel(), BLOCK_M=block_m,
        BINS=align_bins(num_experts), CHUNK=chunk, SCAN=scan, num_warps=4,
        **pdl.launch_args(device),
    )  # fmt: skip
    return blocks


@triton.jit
def grouped_gemm_kernel(
    a_ptr,  # [rows of a, K]: tokens (A_PER_TOKEN) or pairs
    w_ptr,  # [experts, N, K]; [experts, 2 * N, K] with SILU_AND_MUL: gate rows, then up rows
    c_ptr,  # [pairs, N]
    sorted_pairs_ptr,
    block_expert_ptr,
    num_rows_ptr,
    topk_weights_ptr,  # [pairs] float32, read when MUL_WEIGHT
    num_pairs,
    N,
    K,
    a_stride,
    w_expert_stride,
    w_row_stride,
    c_stride,
    TOP_K: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,  # a's row of pair p is p // TOP_K (else p)
    MUL_WEIGHT: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,  # c = SiLU(a @ gate.T) * (a @ up.T)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    block = tl.program_id(0)
    if block * BLOCK_M < tl.load(num_rows_ptr):
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        expert_tile(
            a_ptr, w_ptr, c_ptr, pairs, expert, topk_weights_ptr, num_pairs, N, K, a_stride,
            w_expert_stride, w_row_stride, c_stride, TOP_K, A_PER_TOKEN, MUL_WEIGHT,
            SILU_AND_MUL, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


@triton.jit
def expert_tile(
    a_ptr, w_ptr, c_ptr, pairs, expert, topk_weights_ptr, num_pairs, N, K, a_stride,
    w_expert_stride, w_row_stride, c_stride, TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, SILU_AND_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program's tile of a grouped GEMM: the pairs [BLOCK_M] (num_pairs: padding) of one
    expert, times its weight's columns of program_id(1)."""
    valid = pairs < num_pairs
    a_rows = pairs // TOP_K if A_PER_TOKEN else pairs
    if SILU_AND_MUL:  # the tile's columns interleave gate and up: E.g. rows g0 u0 g1 u1 ..
        lanes = tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * (BLOCK_N // 2) + lanes // 2
        w_rows = cols + (lanes % 2) * N
    else:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * a_stride + ks[None, :]
    w_ptrs = w_ptr + expert * w_expert_stride + w_rows[None, :] * w_row_stride + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        in_k = ks + k < K
        a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = acc.to(c_ptr.dtype.element_ty)
    if SILU_AND_MUL:  # rounded where gate_up's store and `silu_and_mul` would round
        gate, up = tl.split(tl.reshape(out, [BLOCK_M, BLOCK_N // 2, 2]))
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        cols = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * c_stride + cols[None, :]
    tl.store(c_ptrs, out, mask=valid[:, None] & (cols[None, :] < N))


class MoeTiles(NamedTuple):
    """Launch shape of the grouped GEMMs (TANDEM_MOE_TILES="block_n,block_k,num_warps,num_stages"
    sets it for 16-bit weights, to compare shapes on a GPU)."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


TILES = MoeTiles(*(envs.moe_tiles() or MoeTiles()))
FLOAT32_TILES = MoeTiles(block_n=32, block_k=32, num_warps=4, num_stages=1)  # fits shared memory


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small where few pairs reach each expert (decode), so padding is little."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    blocks: ExpertBlocks,
    block_m: int,
    num_pairs: int,
    top_k: int,
    topk_weights: torch.Tensor | None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """[pairs, N] = a's row of each pair @ w[its expert].T (times its weight when given). With
    `silu_and_mul`, w [experts, 2 * N, K] holds gate rows, then up rows, and the product is
    SiLU(gate) * up, as `fused.silu_and_mul` would make of it (one launch less)."""
    n, k = w.shape[1] // (2 if silu_and_mul else 1), w.shape[2]
    assert a.stride(-1) == 1 and w.is_contiguous()
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    tiles = FLOAT32_TILES if a.dtype == torch.float32 else TILES
    cols_per_tile = tiles.block_n // 2 if silu_and_mul else tiles.block_n
    grid = (blocks.sorted_pairs.numel() // block_m, cdiv(n, cols_per_tile))
    grouped_gemm_kernel[grid](
        a, w, c, blocks.sorted_pairs, blocks.block_expert, blocks.num_rows,
        c if topk_weights is None else topk_weights, num_pairs, n, k, a.stride(0), w.stride(0),
        w.stride(1), c.stride(0), TOP_K=top_k, A_PER_TOKEN=topk_weights is None,
        MUL_WEIGHT=topk_weights is not None, SILU_AND_MUL=silu_and_mul, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl.launch_args(a.device),
    )  # fmt: skip
    return c


def expert_outputs(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [experts, hidden, inter]
    topk_weights: torch.Tensor,  # [tokens, top_k] float32
    blocks: ExpertBlocks,
    block_m: int,
    hidden_act: str = "silu",
) -> torch.Tensor:
    """Each (token, expert) pair's weighted output [tokens, top_k, hidden] in x's dtype, by the
    grouped GEMMs over the aligned pairs: two launches with SiLU (GEMM 1 with SiLU * up, GEMM 2
    times the routing weight)."""
    tokens, top_k = topk_weights.shape
    num_pairs = tokens * top_k
    if hidden_act == "silu":
        act = grouped_gemm(x, w13, blocks, block_m, num_pairs, top_k, None, silu_and_mul=True)
    else:
        gate_up = grouped_gemm(x, w13, blocks, block_m, num_pairs, top_k, None)
        act = act_and_mul(gate_up, hidden_act)
    weights = topk_weights.flatten().float().contiguous()  # no copy from `fused_topk`
    out = grouped_gemm(act, w2, blocks, block_m, num_pairs, top_k, weights)
    return out.view(tokens, top_k, -1)


def fused_experts(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [experts, hidden, inter]
    topk_weights: torch.Tensor,  # [tokens, top_k] float32
    topk_ids: torch.Tensor,  # [tokens, top_k]
    hidden_act: str = "silu",
) -> torch.Tensor:
    """The routed experts' weighted sum [tokens, hidden] from given routing: the alignment,
    `expert_outputs` and the sum over each token's top_k in a fixed order (no atomics:
    deterministic). The model's block leaves that sum to the add + RMSNorm after it on one
    device (`moe.SparseMoeBlock`)."""
    num_experts, num_pairs = w13.shape[0], topk_ids.numel()
    block_m = block_m_for(num_pairs, num_experts)
    blocks = align_by_expert(topk_ids, num_experts, block_m)
    return expert_outputs(x, w13, w2, topk_weights, blocks, block_m, hidden_act).sum(1)


def fused_experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    hidden_act: str = "silu",
) -> torch.Tensor:
    """The same as `fused_experts` in torch: each pair's expert weights gathered, batched matmuls."""
    tokens, top_k = topk_ids.shape
    ids = topk_ids.flatten().long()  # [pairs]
    rows = x.repeat_interleave(top_k, dim=0)  # [pairs, hidden]
    gate_up = torch.bmm(w13[ids], rows[:, :, None])[:, :, 0]  # [pairs, 2 * inter]
    act = act_and_mul(gate_up, hidden_act)
    out = torch.bmm(w2[ids], act[:, :, None])[:, :, 0]  # [pairs, hidden]
    out = (out.float() * topk_weights.flatten().float()[:, None]).to(x.dtype)
    return out.view(tokens, top_k, -1).sum(1)
