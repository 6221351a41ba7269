"""Top-k routing of a mixture-of-experts layer: router logits -> each token's experts and weights.

As Qwen3-MoE and Mixtral define it (transformers' routers): softmax over the experts in float32,
the k largest, divided by their sum where the model asks (`norm_topk_prob`; Mixtral always).
`route` is that in torch (CPU engines, and the reference); `fused_topk` is the same in one Triton
launch on CUDA, instead of softmax, topk, sum and div kernels. It picks by the logits (softmax is
monotonic, so the same experts as the probabilities, without exp's rounding making ties) and among
equal logits the lowest expert, so its choice never varies between runs or batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv, next_power_of_2


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
def topk_softmax_kernel(
    logits_ptr,  # [tokens, experts]
    weights_ptr,  # [tokens, TOP_K] float32
    ids_ptr,  # [tokens, TOP_K] int32
    num_tokens,
    num_experts,
    logits_stride,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    in_rows, is_expert = rows < num_tokens, experts < num_experts
    logits_ptrs = logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + experts[None, :]
    x = tl.load(logits_ptrs, mask=in_rows[:, None] & is_expert[None, :], other=0.0)
    x = tl.where(is_expert[None, :], x.to(tl.float32), -float("inf"))  # [BLOCK_T, BLOCK_E]
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    # k rounds of argmax over the experts not yet taken, the lowest expert among equal logits
    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    free = is_expert[None, :] & (rows[:, None] >= 0)  # [BLOCK_T, BLOCK_E]
    for k in tl.static_range(TOP_K):
        candidates = tl.where(free, x, -float("inf"))
        best = tl.max(candidates, axis=1)
        at_best = free & (candidates == best[:, None])
        pick = tl.min(tl.where(at_best, experts[None, :], BLOCK_E), axis=1)
        pick = tl.minimum(pick, num_experts - 1)  # a NaN row still names an expert
        taken = experts[None, :] == pick[:, None]
        weight = tl.sum(tl.where(taken, probs, 0.0), axis=1)
        top_weights = tl.where(slots[None, :] == k, weight[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == k, pick[:, None], top_ids)
        free = free & ~taken
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    in_out = in_rows[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_weights, mask=in_out)
    tl.store(ids_ptr + out, top_ids, mask=in_out)


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` as one Triton launch: (weights [tokens, top_k] float32, ids [tokens, top_k] int32)."""
    tokens, num_experts = router_logits.shape
    assert router_logits.stride(-1) == 1 and 0 < top_k <= num_experts
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    block_e = next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // block_e))  # rows per program: independent of the batch
    topk_softmax_kernel[(cdiv(tokens, block_t),)](
        router_logits, weights, ids, tokens, num_experts, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k), num_warps=4, **pdl.launch_args(device),
    )  # fmt: skip
    return weights, ids
