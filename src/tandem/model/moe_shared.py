"""Qwen2-MoE's shared expert joined to the routed experts' outputs in one launch (CUDA).

A MoE block with a shared expert returns routed + sigmoid(x . w_gate) * shared for each token,
where routed is the sum of its top_k weighted expert outputs and shared the shared expert's
down projection. In torch that is five launches after the products (the gate's matrix-vector
product, its sigmoid, the scale, the sum over top_k, the add), and cuBLAS's split-K product of
the down projection adds its slices in a launch of its own. Here one launch reads the routed
partials, the down projection's float32 split-K slices (`splitk.residual_product`) and x, and
writes the block's output. Each intermediate is rounded to the output dtype where torch's ops
would round it, so that the result equals theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv, next_power_of_2
from tandem.model.fused import summed_partials

BLOCK = 1024  # output columns a program; each program also takes the gate's whole dot product


@triton.jit
def shared_join_kernel(
    routed_ptr,  # [tokens, TOP_K, hidden]: the routed experts' weighted outputs
    shared_ptr,  # [tokens, hidden], or float32 slices [SHARED_PARTS, tokens, hidden]
    x_ptr,  # [tokens, hidden]: the block's input
    gate_ptr,  # [hidden]: the shared expert's gate
    out_ptr,  # [tokens, hidden]
    hidden,
    routed_token_stride,
    routed_slot_stride,
    shared_part_stride,
    shared_token_stride,
    x_stride,
    TOP_K: tl.constexpr,
    SHARED_PARTS: tl.constexpr,  # 0: shared_ptr holds the product itself
    BLOCK_H: tl.constexpr,  # hidden's next power of two, for the gate's dot product
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + token * x_stride + h, mask=h < hidden, other=0.0)
    w = tl.load(gate_ptr + h, mask=h < hidden, other=0.0)
    logit = tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=0).to(dtype)
    gate = tl.sigmoid(logit.to(tl.float32)).to(dtype)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    routed = summed_partials(
        routed_ptr + token * routed_token_stride + cols, mask, routed_slot_stride, TOP_K, dtype
    )
    shared = summed_partials(
        shared_ptr + token * shared_token_stride + cols, mask, shared_part_stride,
        SHARED_PARTS, dtype,
    )  # fmt: skip
    scaled = (gate.to(tl.float32) * shared.to(tl.float32)).to(dtype)
    out = (routed.to(tl.float32) + scaled.to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * hidden + cols, out, mask=mask)


def join_shared(
    routed: torch.Tensor,  # [tokens, top_k, hidden]
    shared: torch.Tensor,  # [tokens, hidden], or float32 slices [parts, tokens, hidden]
    x: torch.Tensor,  # [tokens, hidden]
    gate: torch.Tensor,  # [1, hidden]: shared_expert_gate's weight
) -> torch.Tensor:
    """routed.sum(1) + sigmoid(x @ gate.T) * shared (shared's slices added first), [tokens,
    hidden] in x's dtype, rounded as torch rounds each of those ops."""
    tokens, top_k, hidden = routed.shape
    parts = shared.shape[0] if shared.dim() == 3 else 0
    assert routed.stride(-1) == shared.stride(-1) == x.stride(-1) == 1 and gate.is_contiguous()
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)  # [tokens, hidden]
    shared_join_kernel[(tokens, cdiv(hidden, BLOCK))](
        routed, shared, x, gate, out, hidden, routed.stride(0), routed.stride(1),
        shared.stride(0) if parts else 0, shared.stride(-2), x.stride(0), TOP_K=top_k,
        SHARED_PARTS=parts, BLOCK_H=next_power_of_2(hidden), BLOCK=BLOCK, num_warps=4,
        **pdl.launch_args(x.device),
    )  # fmt: skip
    return out
