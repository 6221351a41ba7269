"""Top-k routing of a mixture-of-experts layer: router logits -> each token's experts and weights.

As Qwen3-MoE and Mixtral define it (transformers' routers): softmax over the experts in float32,
the k largest, divided by their sum where the model asks (`norm_topk_prob`; Mixtral always).
`route` is that in torch (CPU engines, and the reference); `fused_topk` is the same in one Triton
launch on CUDA, instead of softmax, topk, sum and div kernels. It picks by the logits (softmax is
monotonic, so the same experts as the probabilities, without exp's rounding making ties) and among
equal logits the lowest expert, so its choice never varies between runs or batches.

`fused_topk_align` adds the next step, the pairs sorted by expert for the grouped GEMMs
(`fused_moe.align_by_expert`): at a decode step's few pairs both run in one program, one launch
where there were two. At one token `moe_one_token` goes further: each program of the first
grouped GEMM routes the token itself, and the routing launch is gone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv, next_power_of_2
from tandem.model.fused_moe import (
    ALIGN_CHUNK,
    ExpertBlocks,
    align_bins,
    align_by_expert,
    align_in_one_program,
    empty_blocks,
)

# the routing's key of an expert taken or not in the row, below every logit's (`_topk_tile`):
# of a float32 logit's int64 keys, and of a 16-bit logit's int32 ones
TAKEN = tl.constexpr(-(2**63))
TAKEN16 = tl.constexpr(-(2**31))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, experts] logits -> (weights [tokens, top_k] float32, expert ids [tokens, top_k])."""
    probs = router_logits.softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit
def _float_order(bits):
    """int32 bits of a float32 -> an int32 that orders as the float does (negative floats'
    magnitude bits flipped), and back: the map is its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _half_order(bits):
    """int32 bits of a 16-bit float (sign-extended) -> an int32 in [-2**15, 2**15) that orders
    as the float does, and back: `_float_order` at 16 bits."""
    return bits ^ ((bits >> 15) & 0x7FFF)


@triton.jit
def _topk_rows(
    logits_ptr, weights_ptr, ids_ptr, first, num_tokens, num_experts, logits_stride, part_stride,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, PARTS: tl.constexpr, ROUND_TO: tl.constexpr,
):  # fmt: skip
    """The routing of rows [first, first + BLOCK_T) (`_topk_tile`) stored at [row, k] of
    weights and ids [tokens, TOP_K]."""
    top_weights, top_ids = _topk_tile(
        logits_ptr, first, num_tokens, num_experts, logits_stride, part_stride, TOP_K,
        RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, PARTS, ROUND_TO,
    )  # fmt: skip
    rows = first + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, BLOCK_K)
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    in_out = (rows < num_tokens)[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_weights, mask=in_out)
    tl.store(ids_ptr + out, top_ids, mask=in_out)


@triton.jit
def _topk_tile(
    logits_ptr, first, num_tokens, num_experts, logits_stride, part_stride, TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, PARTS: tl.constexpr, ROUND_TO: tl.constexpr,
):  # fmt: skip
    """The routing of rows [first, first + BLOCK_T) (those past num_tokens masked): their
    weights [BLOCK_T, BLOCK_K] float32 and expert ids [BLOCK_T, BLOCK_K] int32, slot k of a
    row its k-th pick (slots past TOP_K zero). With PARTS, the logits are that many float32
    split-K slices of the router's product, added in order and rounded once to ROUND_TO, as
    the product stored in the model dtype would be."""
    rows = first + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    in_rows, is_expert = rows < num_tokens, experts < num_experts
    logits_ptrs = logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + experts[None, :]
    mask = in_rows[:, None] & is_expert[None, :]
    if PARTS == 0:
        x = tl.load(logits_ptrs, mask=mask, other=0.0)
    else:
        x = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for part in tl.static_range(PARTS):
            x += tl.load(logits_ptrs + part * part_stride, mask=mask, other=0.0)
        x = x.to(ROUND_TO)
    compared = x  # the logits as the routing compares them: 16-bit in a 16-bit model
    x = tl.where(is_expert[None, :], x.to(tl.float32), -float("inf"))  # [BLOCK_T, BLOCK_E]
    row_max = tl.max(x, axis=1)
    denom = tl.sum(tl.exp(x - row_max[:, None]), axis=1)
    # k rounds of argmax over the experts not yet taken, the lowest expert among equal logits:
    # each logit and its expert as one integer key, so that a round is one max. The float's
    # bits, made to order as an integer (negative floats' magnitude bits flipped; -0.0 as
    # 0.0), sit above BLOCK_E - 1 - expert: a 16-bit logit's in an int32 key (half the
    # shuffles and selects of a round), a float32 logit's in an int64 one.
    index = (BLOCK_E - 1 - experts)[None, :]
    free = is_expert[None, :] & (rows[:, None] >= 0)  # [BLOCK_T, BLOCK_E]
    half_keys: tl.constexpr = compared.dtype.primitive_bitwidth == 16
    if half_keys:
        tl.static_assert(BLOCK_E <= 2**16, "a 16-bit logit's key holds its expert in 16 bits")
        zero = tl.zeros_like(compared)  # -0.0 as 0.0
        bits = tl.where(compared == zero, zero, compared).to(tl.int16, bitcast=True)
        keys = (_half_order(bits.to(tl.int32)) << 16) | index
        taken = TAKEN16
    else:
        ordered = _float_order(tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True))
        keys = (ordered.to(tl.int64) << 32) | index.to(tl.int64)
        taken = TAKEN
    keys = tl.where(free, keys, taken)
    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)  # [BLOCK_T]
        pick = BLOCK_E - 1 - (best & (BLOCK_E - 1)).to(tl.int32)
        pick = tl.minimum(pick, num_experts - 1)  # an expert even were every key taken
        if half_keys:
            half = _half_order(best >> 16).to(tl.int16)
            logit = half.to(compared.dtype, bitcast=True).to(tl.float32)
        else:
            logit = _float_order((best >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
        keys = tl.where(experts[None, :] == pick[:, None], taken, keys)
        # its softmax probability, as the row's would be computed: exp(x - max) / sum
        weight = tl.exp(logit - row_max) / denom
        top_weights = tl.where(slots[None, :] == k, weight[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == k, pick[:, None], top_ids)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    return top_weights, top_ids


@triton.jit
def topk_softmax_kernel(
    logits_ptr,  # [tokens, experts], or float32 slices [PARTS, tokens, experts]
    weights_ptr,  # [tokens, TOP_K] float32
    ids_ptr,  # [tokens, TOP_K] int32
    num_tokens,
    num_experts,
    logits_stride,
    part_stride,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr,
    ROUND_TO: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    _topk_rows(
        logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, num_tokens, num_experts,
        logits_stride, part_stride, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, PARTS, ROUND_TO,
    )  # fmt: skip


@triton.jit
def topk_align_kernel(
    logits_ptr,  # [tokens, experts], or float32 slices [PARTS, tokens, experts]
    weights_ptr,  # [tokens, TOP_K] float32
    ids_ptr,  # [tokens, TOP_K] int32
    sorted_pairs_ptr,  # [max_rows] int32
    block_expert_ptr,  # [max_rows // BLOCK_M] int32
    num_rows_ptr,  # [1] int32
    num_tokens,
    num_experts,
    logits_stride,
    part_stride,
    max_rows,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr,
    ROUND_TO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,
    SCAN: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
    ONE_TOKEN_ROWS: tl.constexpr,  # TOP_K * BLOCK_M's next power of two
    PDL: tl.constexpr,
):
    """`topk_softmax_kernel` and `fused_moe.align_kernel` in one program: the rows' routing in
    the same [BLOCK_T, BLOCK_E] tiles (so the same bits), then the alignment of the ids just
    stored (by ranks alone for ONE_TOKEN)."""
    pdl.wait(PDL)
    for first in range(0, num_tokens, BLOCK_T):
        _topk_rows(
            logits_ptr, weights_ptr, ids_ptr, first, num_tokens, num_experts, logits_stride,
            part_stride, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, PARTS, ROUND_TO,
        )  # fmt: skip
    tl.debug_barrier()  # the ids stored by each thread, visible to the program's other threads
    if ONE_TOKEN:
        _align_one_token(
            ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, TOP_K, BLOCK_K, BLOCK_M,
            ONE_TOKEN_ROWS,
        )  # fmt: skip
    else:
        align_in_one_program(
            ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, num_tokens * TOP_K,
            num_experts, max_rows, BLOCK_M, BINS, CHUNK, SCAN,
        )  # fmt: skip


@triton.jit
def _align_one_token(
    ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """The alignment of one token's pairs (a batch-1 decode step), without the histograms: its
    top_k experts are distinct, so each pair is a run of its own, BLOCK_M rows (the pair, then
    padding), the runs in expert order: a pair's run is its rank among the token's experts.
    (Equal ids, which only NaN logits make, rank by slot: each pair still gets a run.)"""
    slots = tl.arange(0, BLOCK_K)
    in_k = slots < TOP_K
    ids = tl.load(ids_ptr + slots, mask=in_k, other=0)
    below = (ids[None, :] < ids[:, None]) | (
        (ids[None, :] == ids[:, None]) & (slots < slots[:, None])
    )
    rank = tl.sum((below & in_k[None, :]).to(tl.int32), axis=1)  # [BLOCK_K]
    tl.store(block_expert_ptr + rank, ids, mask=in_k)
    rows = tl.arange(0, ROWS)
    # each run's first row holds its pair, the rest the padding index (the pair count)
    starts = (rank[None, :] * BLOCK_M == rows[:, None]) & in_k[None, :]  # [ROWS, BLOCK_K]
    pairs = tl.sum(tl.where(starts, slots[None, :], 0), axis=1)
    pairs = tl.where(rows % BLOCK_M == 0, pairs, TOP_K)
    tl.store(sorted_pairs_ptr + rows, pairs, mask=rows < TOP_K * BLOCK_M)
    tl.store(num_rows_ptr, TOP_K * BLOCK_M)


def routing_tiles(num_experts: int, top_k: int) -> dict:
    """The routing kernels' tile shape: rows per tile independent of the batch (so a token's
    weights never depend on it), experts and top_k padded to powers of two. A tile holds 512
    logits, 4 a thread of the 4 warps: its k rounds are a chain of dependent instructions, so
    small tiles in more programs finish sooner (Qwen3-30B's 128 experts: 4 rows a tile, sm_90
    code of 672 instructions a thread, against 2,192 at 16 rows)."""
    block_e = next_power_of_2(num_experts)
    return {
        "BLOCK_T": max(1, min(16, 512 // block_e)),
        "BLOCK_E": block_e,
        "BLOCK_K": next_power_of_2(top_k),
    }


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def logits_layout(router_logits: torch.Tensor, dtype: torch.dtype | None) -> dict:
    """The routing kernels' arguments that describe the logits: [tokens, experts], or float32
    split-K slices [parts, tokens, experts] of the router's product (`splitk.linear_partials`)
    whose sum rounds to `dtype` (the model's, that of the product they stand for)."""
    assert router_logits.stride(-1) == 1
    if router_logits.dim() == 2:
        return {"part_stride": 0, "PARTS": 0, "ROUND_TO": tl.float32}
    assert router_logits.dtype == torch.float32 and dtype is not None
    return {
        "part_stride": router_logits.stride(0),
        "PARTS": router_logits.shape[0],
        "ROUND_TO": _TL_DTYPES[dtype],
    }


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` as one Triton launch: (weights [tokens, top_k] float32, ids [tokens, top_k] int32).
    router_logits: [tokens, experts], or float32 slices [parts, tokens, experts] of the
    router's product in `dtype` (see `logits_layout`)."""
    tokens, num_experts = router_logits.shape[-2:]
    assert 0 < top_k <= num_experts
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    tiles = routing_tiles(num_experts, top_k)
    topk_softmax_kernel[(cdiv(tokens, tiles["BLOCK_T"]),)](
        router_logits, weights, ids, tokens, num_experts, router_logits.stride(-2), TOP_K=top_k,
        RENORMALIZE=renormalize, **tiles, **logits_layout(router_logits, dtype), num_warps=4,
        **pdl.launch_args(device),
    )  # fmt: skip
    return weights, ids


# Up to 64 pairs (Qwen3-30B's 8-token decode steps at top 8, Mixtral's 32 at top 2) the routing
# and the alignment are one program: at decode sizes both kernels are latency, not work (H200,
# Qwen3-30B: about 5 µs each at 1 and at 32 tokens). At batch 1 (8 pairs) one launch less a
# layer took `moe1` from 3.67 to 3.36 ms a token, with the top-k sum folded into the norm
# (BENCHMARKS.md, session 18). At 256 pairs the one program's serial share (2 routing tiles,
# 4 placement chunks that the two kernels run side by side) cost more than the launch it saves:
# `moe` at 32 tokens 2,044 tok/s against 2,105 before, 2,132 with this bound (the two kernels
# there). Past it, prefills and larger batches take the two kernels' grids.
ONE_PROGRAM_MAX_PAIRS = 64


def fused_topk_align(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """`route`, then the pairs aligned by expert in BLOCK_M-row runs: (weights [tokens, top_k]
    float32, ids [tokens, top_k] int32, `fused_moe.ExpertBlocks`), the same as `fused_topk`
    then `fused_moe.align_by_expert`. One launch up to ONE_PROGRAM_MAX_PAIRS pairs, those two
    past it; fixed shapes given the token count, no host sync. The logits as `fused_topk`
    takes them."""
    tokens, num_experts = router_logits.shape[-2:]
    num_pairs = tokens * top_k
    if num_pairs > ONE_PROGRAM_MAX_PAIRS:
        weights, ids = fused_topk(router_logits, top_k, renormalize, dtype)
        return weights, ids, align_by_expert(ids, num_experts, block_m)
    assert 0 < top_k <= num_experts
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    blocks = empty_blocks(num_pairs, num_experts, block_m, device)
    topk_align_kernel[(1,)](
        router_logits, weights, ids, *blocks, tokens, num_experts, router_logits.stride(-2),
        max_rows=blocks.sorted_pairs.numel(), TOP_K=top_k, RENORMALIZE=renormalize,
        **routing_tiles(num_experts, top_k), **logits_layout(router_logits, dtype),
        BLOCK_M=block_m, BINS=align_bins(num_experts), CHUNK=ALIGN_CHUNK,
        SCAN=ONE_PROGRAM_MAX_PAIRS, ONE_TOKEN=tokens == 1,
        ONE_TOKEN_ROWS=next_power_of_2(top_k * block_m), num_warps=4, **pdl.launch_args(device),
    )  # fmt: skip
    return weights, ids, blocks
