"""FP8 weights times one row (a batch-1 decode step): a matrix-vector kernel without tensor
cores.

At one row `torch._scaled_mm` launches 128 x 128 tiles, so Llama-3-8B's qkv matrix gets 48
programs for 132 SMs. Here each program reads BLOCK_N whole weight rows, e4m3 widened to
float32 in registers, and multiplies them by the input row kept in bf16 (W8A16: no activation
quantization, no extra launch): every product is an FMA, and each output element's sum runs
over K in BLOCK_K steps, then across the step's lanes. On the H200 (`benchmarks/gemm.py
--fp8`), at one row, in µs: qkv 9.7 against the FP8 GEMM's 19.7, o 6.7 against 16.3, gate_up
33.5 against 48.7, down 16.7 against 47.0 (83% of the FP8 copy roofline). At four rows each
row reading the weight again took twice the GEMM's time (gate_up 97 against 49 µs), so only
one-row products come here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv

MAX_ROWS = 1  # more rows read the weight once each: the FP8 GEMM is faster from 4 (above)


class GemvTiles(NamedTuple):
    """Launch shape; the default was the fastest of five on all four of Llama-3-8B's
    matrices at one row (H200, `benchmarks/gemm.py --fp8`)."""

    block_n: int = 4  # weight rows (output features) per program
    block_k: int = 1024  # input features per loop step
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
    dtype, for at most MAX_ROWS rows (the kernel itself takes any number: benchmarks)."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("fp8_gemv takes a contiguous input row and weight")
    tiles = tiles or GemvTiles()
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)  # [rows, out]
    fp8_gemv_kernel[(rows, cdiv(out_features, tiles.block_n))](
        x, weight, weight_scale, out, out_features, in_features, x.stride(0), out.stride(0),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=in_features % tiles.block_k == 0,
        num_warps=tiles.num_warps, **pdl.launch_args(x.device),
    )  # fmt: skip
    return out
