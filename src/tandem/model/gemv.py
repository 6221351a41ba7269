"""Decode-step matmuls (up to 256 rows) as one Triton kernel each, with the small op before the
matmul folded into its loads: residual add + RMSNorm before qkv_proj and gate_up_proj,
SiLU(gate) * up before down_proj.

A decode step's matmuls read every weight once for a few rows, so at small batches they are bound
by weight bytes. Each program here streams a band of weight rows over the whole input dimension
(no split-K, so no reduce launch) for a block of rows, and computes its input tile on the way:
for the norm, a first pass over the block's rows (a few KB, read from L2 by every program) gives
each row's RMS. That removes the add + RMSNorm and SiLU * up launches of a layer (three of its
~12 at batch 1).

Off unless TANDEM_DECODE_GEMV=1: `benchmarks/gemm.py` measured cuBLAS beaten at one row (gate_up
and down_proj by 2 µs each) but not at 32, so the engine-level effect is still to be measured
(`DECODE_GEMV=1 scripts/gpu_check.sh`). Only fp16/bf16 models with at most MAX_ROWS rows use it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from tandem.model import fused

MAX_ROWS = 256  # a decode step's rows; the kernel tiles them by BLOCK_M
BLOCK_M = 64
ENABLED = os.environ.get("TANDEM_DECODE_GEMV", "0") == "1"

PLAIN, NORM, SILU = 0, 1, 2  # what the kernel does to its input before the matmul


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x` ([rows, in], rows of a decode step) times `weight` runs as the kernel here."""
    return (
        ENABLED
        and fused.use_kernels(x)
        and x.shape[0] <= MAX_ROWS
        and x.stride(-1) == 1
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.is_contiguous()
    )


@triton.jit
def _summed_tile(
    x_ptr, residual_ptr, r, cols, mask, x_stride, residual_stride, dtype: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Rows r, columns cols of x (+ residual), rounded to the model dtype."""
    xs = tl.load(x_ptr + r[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + r[:, None] * residual_stride + cols[None, :], mask=mask, other=0.0
        )
        xs = (xs.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    return xs


@triton.jit
def gemv_kernel(
    x_ptr, residual_ptr, norm_ptr, w_ptr, bias_ptr, y_ptr, summed_ptr, rows, rows_bucket, n, k,
    x_stride, residual_stride, eps, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[rows, band] = prologue(x) @ W[band, :]^T (+ bias) for BLOCK_M rows of x and one band
    of BLOCK_N weight rows. The row blocks of one band are neighbours in the grid, so a band
    read by one of them is still in L2 for the others (one block up to 64 rows).

    NORM: the input is RMSNorm(x + residual) * norm (the first band's programs also store
    x + residual to summed_ptr); SILU: x is [rows, 2k], gate | up, and the input is
    SiLU(gate) * up. Values are rounded to the model dtype where the torch versions in fused.py
    round them.
    """
    first_band = tl.program_id(1) == 0
    band = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    band_ok = band < n
    r = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = r < rows
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PROLOGUE == 1:  # each row's RMS first, so the matmul reads norm(x) * g rounded as torch
        sum_sq = tl.zeros([BLOCK_M], tl.float32)  # rounds it (g * x alone can overflow fp16)
        for start in range(0, k, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols < k)[None, :]
            xs = _summed_tile(x_ptr, residual_ptr, r, cols, mask, x_stride, residual_stride,
                              dtype, HAS_RESIDUAL)  # fmt: skip
            if HAS_RESIDUAL:
                tl.store(summed_ptr + r[:, None] * k + cols[None, :], xs, mask=mask & first_band)
            xf = xs.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
        inv_rms = 1.0 / tl.sqrt(sum_sq / k + eps)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        mask = row_ok[:, None] & col_ok[None, :]
        if PROLOGUE == 2:
            x_at = x_ptr + r[:, None] * x_stride + cols[None, :]
            gate = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_at + k, mask=mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            xs = (silu * up).to(dtype)
        else:
            xs = _summed_tile(x_ptr, residual_ptr, r, cols, mask, x_stride, residual_stride,
                              dtype, HAS_RESIDUAL and PROLOGUE == 1)  # fmt: skip
        if PROLOGUE == 1:
            normed = (xs.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
            g = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            xs = (normed * g[None, :]).to(dtype)
        w = tl.load(
            w_ptr + band[:, None].to(tl.int64) * k + cols[None, :],
            mask=band_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(xs, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + band, mask=band_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + r[:, None] * n + band[None, :],
        acc.to(dtype),
        mask=row_ok[:, None] & band_ok[None, :],
    )


CONFIGS = [
    triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=4, num_stages=stages)
    for block_n in (16, 32, 64)
    for block_k in (128, 256, 512)
    for stages in (3, 4)
]
# on a GPU each (matrix shape, row count, prologue) gets the fastest of CONFIGS, timed at its
# first call (the engine's warm-up before graph capture); row counts are bucketed by powers of
# two, so eager steps of new sizes rarely pay for tuning. The interpreter, and tests on a GPU
# (AUTOTUNE False: every config is a compile), run the one FIXED shape.
AUTOTUNE = True
_tuned = triton.autotune(
    CONFIGS,
    key=["n", "k", "rows_bucket", "PROLOGUE"],
    do_bench=lambda call, quantiles: triton.testing.do_bench(call, 5, 20, quantiles=quantiles),
)(gemv_kernel)
FIXED = {"BLOCK_N": 16, "BLOCK_K": 32}


def _launch(
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    residual: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, n = x.shape[0], weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = (
        torch.empty((rows, k), dtype=x.dtype, device=x.device) if residual is not None else None
    )
    # absent operands get a stand-in pointer the kernel never reads (its flags say so)
    args = (
        x, x if residual is None else residual, weight if norm is None else norm, weight,
        weight if bias is None else bias, y, y if summed is None else summed, rows,
        triton.next_power_of_2(rows), n, k, x.stride(0),
        0 if residual is None else residual.stride(0), eps,
    )  # fmt: skip
    block_m = min(max(16, triton.next_power_of_2(rows)), BLOCK_M)  # tl.dot wants >= 16
    flags = dict(
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
    )
    row_blocks = triton.cdiv(rows, block_m)
    if x.is_cuda and AUTOTUNE:
        _tuned[lambda meta: (row_blocks, triton.cdiv(n, meta["BLOCK_N"]))](*args, **flags)
    else:
        grid = (row_blocks, triton.cdiv(n, FIXED["BLOCK_N"]))
        gemv_kernel[grid](*args, **flags, **FIXED)
    return y, summed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), as the kernel when `use_gemv(x, weight)`."""
    if not use_gemv(x, weight):
        return F.linear(x, weight, bias)
    return _launch(PLAIN, x, weight, bias, x.shape[1])[0]


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(RMSNorm(x + residual) * norm, weight, bias), x + residual); without a
    residual, x is the sum."""
    if not use_gemv(x, weight):
        normed, summed = fused.add_rms_norm(x, residual, norm, eps)
        return F.linear(normed, weight, bias), summed
    y, summed = _launch(NORM, x, weight, bias, x.shape[1], residual, norm, eps)
    return y, x if summed is None else summed


def silu_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(SiLU(gate) * up, weight, bias) for gate_up = [rows, 2 * inter], gate | up."""
    if not use_gemv(gate_up, weight):
        return F.linear(fused.silu_and_mul(gate_up), weight, bias)
    return _launch(SILU, gate_up, weight, bias, gate_up.shape[1] // 2)[0]
