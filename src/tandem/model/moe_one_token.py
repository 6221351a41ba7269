"""A batch-1 decode step's MoE block in two launches fewer (CUDA, one device, SiLU experts).

At one token every launch of the block is latency, not work: the routing reads 8 KB of logits,
the norm 70 KB. On the H200, Qwen3-30B-A3B's batch-1 step took 2.75 ms a token without the
routing's launch and 2.79 without the post-attention norm's, against 2.94 with both (the work
left out, for the measure only; BENCHMARKS.md, session 30). So both go into the launches after
them, whose programs each redo that little work:

1. `norm_and_router`: the router's split-K product (`splitk.linear_partials`' tiles), each
   program first adding the attention's output (o's split-K slices) to the residual stream
   and norming the row as `fused.add_rms_norm` does. The programs of the first column tile
   store the normed row and the sum, a slice each; the sum goes to a buffer of its own, as
   the other programs still read the residual stream;
2. `routed_expert_outputs`: each program of GEMM 1 (a slot of the top k, a tile of columns)
   routes the token itself from the router's slices (`moe_routing._topk_tile`, the routing
   kernels' arithmetic), then multiplies it by its slot's expert, SiLU(gate) * up. Program
   (0, 0) also stores the weights, the ids and their alignment for GEMM 2, and copies the sum
   into the residual stream, which no program of this launch reads;
3. GEMM 2, `fused_moe.grouped_gemm`, as at any batch.

The block's output is the top_k partials, as `moe.SparseMoeBlock` returns them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv, next_power_of_2
from tandem.model import splitk
from tandem.model.fused import scaled_rms, summed_partials
from tandem.model.fused_moe import (
    FLOAT32_TILES,
    TILES,
    block_m_for,
    empty_blocks,
    expert_tile,
    grouped_gemm,
)
from tandem.model.moe_routing import _align_one_token, _topk_tile, logits_layout, routing_tiles


@triton.jit
def _summed_slice(x_ptr, residual_ptr, cols, mask, part_stride, PARTS: tl.constexpr):
    """x + residual at `cols` of the one row, in the residual's dtype, as the add + RMSNorm
    kernel makes it: x's float32 slices added in order and rounded once (PARTS), then the sum
    rounded."""
    x = summed_partials(x_ptr + cols, mask, part_stride, PARTS, residual_ptr.dtype.element_ty)
    residual = tl.load(residual_ptr + cols, mask=mask, other=0.0)
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)


@triton.jit
def norm_router_kernel(
    x_ptr,  # [1, hidden], or float32 slices [PARTS, 1, hidden]: the attention's output
    residual_ptr,  # [1, hidden]: read only
    norm_weight_ptr,  # [hidden]
    router_ptr,  # [experts, hidden]
    normed_ptr,  # [1, hidden]: RMSNorm(x + residual) * weight
    summed_ptr,  # [1, hidden]: x + residual
    out_ptr,  # [splits, 1, experts] float32: the router's slices
    hidden,
    num_experts,
    part_stride,
    eps,
    k_per_split,
    PARTS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden's next power of two
    BLOCK_M: tl.constexpr,  # the product's rows (the one row, then zeros)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    tile_n, split = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    summed = _summed_slice(x_ptr, residual_ptr, cols, cols < hidden, part_stride, PARTS)
    sf = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / hidden + eps)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
        # this slice of the row again (from the L1), normed as `fused.add_rms_norm` norms it
        k = start + tl.arange(0, BLOCK_K)
        s = _summed_slice(x_ptr, residual_ptr, k, k < hidden, part_stride, PARTS)
        normed = scaled_rms(s, inv_rms, tl.load(norm_weight_ptr + k, mask=k < hidden, other=0.0))
        if tile_n == 0:
            tl.store(normed_ptr + k, normed, mask=k < hidden)
            tl.store(summed_ptr + k, s, mask=k < hidden)
        a = tl.where(rows == 0, normed[None, :], 0.0).to(s.dtype)  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            router_ptr + n[None, :].to(tl.int64) * hidden + k[:, None],
            mask=n[None, :] < num_experts,
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if a.dtype == tl.float32:  # no TF32 rounding, as F.linear by default
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    out = out_ptr + split * num_experts + n[None, :] + rows * 0
    tl.store(out, acc, mask=(rows == 0) & (n[None, :] < num_experts))


def norm_and_router(
    x: torch.Tensor,  # [1, hidden], or float32 slices [parts, 1, hidden]
    residual: torch.Tensor,  # [1, hidden]
    norm_weight: torch.Tensor,  # [hidden]
    eps: float,
    router: torch.Tensor,  # [experts, hidden]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * norm_weight [1, hidden], x + residual [1, hidden], the router's
    product of the normed row as float32 slices [splits, 1, experts]) in one launch: what
    `fused.add_rms_norm` then `splitk.linear_partials` make, the residual stream left as it is
    (the sum comes apart: `routed_expert_outputs` copies it in)."""
    hidden, num_experts = residual.shape[-1], router.shape[0]
    assert residual.shape == (1, hidden) and router.is_contiguous() and x.stride(-1) == 1
    tiles = splitk.plan(1, num_experts, hidden, x.device)
    assert tiles is not None  # `SparseMoeBlock.after_attention` asked
    parts = x.shape[0] if x.dim() == 3 else 0
    normed = torch.empty_like(residual)  # [1, hidden]
    summed = torch.empty_like(residual)  # [1, hidden]
    # [splits, 1, experts] float32
    out = torch.empty(tiles.splits, 1, num_experts, dtype=torch.float32, device=x.device)
    norm_router_kernel[(cdiv(num_experts, tiles.block_n), tiles.splits)](
        x, residual, norm_weight, router, normed, summed, out, hidden, num_experts,
        x.stride(0) if parts else 0, eps, hidden // tiles.splits, PARTS=parts,
        BLOCK_H=next_power_of_2(hidden), BLOCK_M=16, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=4, **pdl.launch_args(x.device),
    )  # fmt: skip
    return normed, summed, out


@triton.jit
def routed_gate_up_kernel(
    logits_ptr,  # [1, experts], or float32 slices [PARTS, 1, experts]
    x_ptr,  # [1, K]
    w_ptr,  # [experts, 2 * N, K]: gate rows, then up rows
    c_ptr,  # [TOP_K, N]: SiLU(gate) * up of each slot's expert
    weights_ptr,  # [1, TOP_K] float32, stored by program (0, 0)
    ids_ptr,  # [1, TOP_K] int32, stored by program (0, 0)
    sorted_pairs_ptr,  # the alignment of the pairs for GEMM 2, stored by program (0, 0)
    block_expert_ptr,
    num_rows_ptr,
    summed_ptr,  # [1, K]: copied by program (0, 0) over the residual stream, with COPY
    residual_ptr,  # [1, K]
    num_experts,
    logits_stride,
    part_stride,
    N,
    K,
    w_expert_stride,
    w_row_stride,
    c_stride,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,  # TOP_K's next power of two
    PARTS: tl.constexpr,
    ROUND_TO: tl.constexpr,
    ROWS: tl.constexpr,  # TOP_K * BLOCK_M's next power of two
    COPY: tl.constexpr,
    BLOCK_H: tl.constexpr,  # K's next power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token's routing and GEMM 1 of its experts in one launch (a batch-1 decode step):
    each program routes the token itself, from the router's logits (`_topk_tile`, as the
    routing kernels do), then multiplies it by its slot's expert (program_id(0): slot,
    program_id(1): columns), SiLU(gate) * up as `fused_moe.grouped_gemm` does. Program (0, 0)
    also stores the weights, the ids and their alignment (`_align_one_token`) for GEMM 2, and
    with COPY the residual stream's new row (`norm_and_router`'s sum)."""
    pdl.wait(PDL)
    slot = tl.program_id(0)
    top_weights, top_ids = _topk_tile(
        logits_ptr, 0, 1, num_experts, logits_stride, part_stride, TOP_K, RENORMALIZE, 1,
        BLOCK_E, BLOCK_TOP, PARTS, ROUND_TO,
    )  # fmt: skip
    slots = tl.arange(0, BLOCK_TOP)[None, :]  # [1, BLOCK_TOP]
    if slot == 0 and tl.program_id(1) == 0:
        tl.store(weights_ptr + slots, top_weights, mask=slots < TOP_K)
        tl.store(ids_ptr + slots, top_ids, mask=slots < TOP_K)
        tl.debug_barrier()  # the ids stored, visible to the program's other threads
        _align_one_token(
            ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_rows_ptr, TOP_K, BLOCK_TOP, BLOCK_M,
            ROWS,
        )  # fmt: skip
        if COPY:
            cols = tl.arange(0, BLOCK_H)
            row = tl.load(summed_ptr + cols, mask=cols < K)
            tl.store(residual_ptr + cols, row, mask=cols < K)
    expert = tl.sum(tl.where(slots == slot, top_ids, 0)).to(tl.int64)
    pairs = tl.where(tl.arange(0, BLOCK_M) == 0, slot, TOP_K)  # the slot's pair, then padding
    expert_tile(
        x_ptr, w_ptr, c_ptr, pairs, expert, weights_ptr, TOP_K, N, K, 0, w_expert_stride,
        w_row_stride, c_stride, TOP_K, True, False, True, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


def routed_expert_outputs(
    x: torch.Tensor,  # [1, hidden]
    w13: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [experts, hidden, inter]
    router_logits: torch.Tensor,  # as `fused_topk` takes them
    top_k: int,
    renormalize: bool,
    summed: torch.Tensor | None = None,  # [1, hidden], copied over `residual`
    residual: torch.Tensor | None = None,  # [1, hidden]
) -> torch.Tensor:
    """A batch-1 decode step's SiLU experts: each slot's weighted expert output [1, top_k,
    hidden] in x's dtype, as `moe_routing.fused_topk_align` then `fused_moe.expert_outputs`
    make them, in two launches where those are three: the routing runs inside GEMM 1's
    programs, each routing the one token again. With `summed`, GEMM 1's launch also copies
    it over `residual` (see `norm_and_router`)."""
    num_experts, device = w13.shape[0], x.device
    assert x.shape[0] == 1 and 0 < top_k <= num_experts and x.stride(-1) == 1
    assert w13.is_contiguous()
    block_m = block_m_for(top_k, num_experts)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=device)  # [1, top_k]
    ids = torch.empty(1, top_k, dtype=torch.int32, device=device)  # [1, top_k]
    blocks = empty_blocks(top_k, num_experts, block_m, device)  # stored by program (0, 0)
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    act = torch.empty(top_k, inter, dtype=x.dtype, device=device)  # [top_k, inter]
    tiles = FLOAT32_TILES if x.dtype == torch.float32 else TILES
    tiling = routing_tiles(num_experts, top_k)
    routed_gate_up_kernel[(top_k, cdiv(inter, tiles.block_n // 2))](
        router_logits, x, w13, act, weights, ids, *blocks, x if summed is None else summed,
        x if residual is None else residual, num_experts, router_logits.stride(-2),
        N=inter, K=hidden, w_expert_stride=w13.stride(0), w_row_stride=w13.stride(1),
        c_stride=act.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_E=tiling["BLOCK_E"], BLOCK_TOP=tiling["BLOCK_K"],
        **logits_layout(router_logits, x.dtype),
        ROWS=next_power_of_2(top_k * block_m), COPY=summed is not None,
        BLOCK_H=next_power_of_2(hidden), BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl.launch_args(device),
    )  # fmt: skip
    out = grouped_gemm(act, w2, blocks, block_m, top_k, top_k, weights.flatten())
    return out.view(1, top_k, -1)
