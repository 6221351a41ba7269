"""FP8 weights times a few rows (a batch-1 decode step): a matrix-vector kernel without tensor
cores.

At one row `torch._scaled_mm` launches 128 x 128 tiles, so Llama-3-8B's qkv matrix gets 48
programs for 132 SMs, and its batch-1 products ran near half the FP8 roofline on the H200
(BENCHMARKS.md). Here each program reads BLOCK_N whole weight rows, e4m3 widened to float32 in
registers, and multiplies them by one input row kept in bf16 (W8A16: no activation
quantization, no extra launch): every product is an FMA, and each output element's sum runs
over K in BLOCK_K steps, then across the step's lanes. The rows of a few-row batch are the
grid's fastest axis, so they read each weight tile while it is in L2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv

MAX_ROWS = 4  # past this, each row reading the weight (from L2) costs more than a GEMM


class GemvTiles(NamedTuple):
    block_n: int = 16  # weight rows (output features) per program
    block_k: int = 512  # input features per loop step
    num_warps: int = 4


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, out_features, in_features, x_stride, out_stride,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait(PDL)
    row, tile = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < out_features
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * in_features + k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + row.to(tl.int64) * x_stride + k  # [BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for start in range(0, in_features, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs, mask=in_n[:, None], other=0.0)
        else:
            in_k = start + k < in_features
            x = tl.load(x_ptrs, mask=in_k, other=0.0)
            w = tl.load(w_ptrs, mask=in_n[:, None] & in_k[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1) * tl.load(w_scale_ptr + n, mask=in_n, other=0.0)
    out = out_ptr + row.to(tl.int64) * out_stride + n
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=in_n)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """[rows, in] x (e4m3 [out, in] with float32 [out, 1] scales)^T -> [rows, out] in x's
    dtype, for at most MAX_ROWS rows."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if rows > MAX_ROWS or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"fp8_gemv takes up to {MAX_ROWS} contiguous rows, got {rows}")
    tiles = tiles or GemvTiles()
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)  # [rows, out]
    fp8_gemv_kernel[(rows, cdiv(out_features, tiles.block_n))](
        x, weight, weight_scale, out, out_features, in_features, x.stride(0), out.stride(0),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=in_features % tiles.block_k == 0,
        num_warps=tiles.num_warps, **pdl.launch_args(x.device),
    )  # fmt: skip
    return out
