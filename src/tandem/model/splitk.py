"""Split-K matmuls for the projections that feed the residual stream (o_proj, down_proj), and
for a MoE layer's router, whose slices the routing kernel adds up (`moe_routing`).

At decode sizes the o and down projections have few output tiles (64 for Llama-3-8B at 32 rows),
too few programs to fill 132 SMs, so cuBLAS reads their weights well below the copy rate. Here
each program computes one output tile over one slice of the input features, and writes float32
partial sums [splits, rows, out]; the residual add + RMSNorm kernel that always follows
(`fused.add_rms_norm`) adds the slices up as it reads them, so the split costs no extra launch.
On the H200 this took Llama-3-8B's batch-1 step from 4.48 to 4.37 ms (BENCHMARKS.md, eighth
run). Past 64 rows only matrices with few output columns split (Qwen3-0.6B's o and down: small's
256-row decode steps 5.10 -> 5.04 ms, eleventh run); larger ones fill the device alone and stay
with cuBLAS, except down projections, whose product cuBLAS splits by K itself and adds up in a
launch of its own: here cuBLAS's batched product over two halves of the input features, whose
float32 slices the norm adds up instead (`blas_slices`). TANDEM_SPLITK=0 keeps F.linear, for
comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem import envs, pdl
from tandem.config import cdiv, next_power_of_2
from tandem.model.fused import num_sms
from tandem.quant.fp8 import FP8_DTYPE

ENABLED = envs.splitk()
BLAS_SLICES = envs.blas_slices()
# past 64 rows: 64-row tiles, one program per SM, four stages, where that means 2 or more
# splits (BENCHMARKS.md, eleventh run: the best shapes of the sweep at 128 and 256 rows)
MAX_ROWS = 256


class SplitTiles(NamedTuple):
    block_m: int  # rows per program
    block_n: int  # output features per program
    block_k: int  # input features per loop step
    splits: int  # slices of the input features, one program each per output tile
    num_warps: int = 4
    num_stages: int = 3


@triton.jit(do_not_specialize=["rows"])  # per step: see attention.triton_kernels.prefill_kernel
def partials_kernel(
    x_ptr, w_ptr, w_scale_ptr, x_scale_ptr, out_ptr, rows, out_features, x_stride, w_stride,
    k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, FP8: tl.constexpr, X_SCALED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait(PDL)
    tile_n, tile_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = split * k_per_split + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * x_stride + k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + n[None, :].to(tl.int64) * w_stride + k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        a = tl.load(x_ptrs, mask=m[:, None] < rows, other=0.0)
        b = tl.load(w_ptrs, mask=n[None, :] < out_features, other=0.0)
        if FP8:  # e4m3 weights, exact in the activations' dtype (e4m3 too when X_SCALED:
            b = b.to(a.dtype)  # an FP8 product); their row scales come last
        # float32 weights: no TF32 rounding, as F.linear by default
        acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FP8:
        acc *= tl.load(w_scale_ptr + n, mask=n < out_features, other=0.0)[None, :]
    if X_SCALED:  # e4m3 activations with a scale per row
        acc *= tl.load(x_scale_ptr + m, mask=m < rows, other=0.0)[:, None]
    out = out_ptr + (split * rows + m[:, None]).to(tl.int64) * out_features + n[None, :]
    # float32 partial sums, or with one split the product in the output's dtype
    tl.store(
        out,
        acc.to(out_ptr.dtype.element_ty),
        mask=(m[:, None] < rows) & (n[None, :] < out_features),
    )


def plan(
    rows: int, out_features: int, in_features: int, device: torch.device, fp8_input: bool = False
) -> SplitTiles | None:
    """The tiles for a [rows, in] x [out, in]^T product, or None where F.linear is the better
    choice: more than MAX_ROWS rows, or no power-of-two step of 16-128 input features that
    divides `in_features`. Splits: the most that divide the input's steps and keep at most two
    programs per SM. An e4m3 input (`fp8_input`, W8A8) steps over 256 features where they
    divide: the same bytes a step as 128 of bfloat16 (H200, 32 rows, Llama-3-8B's matrices,
    `benchmarks/gemm.py --sweep-w8a8`: qkv 13.4 against 17.2 µs, down 19.6 against 23.4,
    gate_up 35.3 against 37.2, o 8.0 against 8.2)."""
    steps = (256, 128, 64, 32, 16) if fp8_input else (128, 64, 32, 16)
    block_k = next((b for b in steps if in_features % b == 0), None)
    if rows == 0 or rows > MAX_ROWS or block_k is None:
        return None
    block_m, block_n = max(16, min(64, next_power_of_2(rows))), 64
    tiles = cdiv(rows, block_m) * cdiv(out_features, block_n)
    k_steps = in_features // block_k
    wide = rows > 64
    wanted = max(1, (1 if wide else 2) * num_sms(device) // tiles)
    splits = max(s for s in range(1, min(wanted, k_steps) + 1) if k_steps % s == 0)
    if wide and splits == 1:  # the output tiles fill the device alone: cuBLAS's case
        return None
    return SplitTiles(block_m, block_n, block_k, splits, num_stages=4 if wide else 3)


def linear_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiles: SplitTiles | None = None,
    weight_scale: torch.Tensor | None = None,
    fallback: Callable[[torch.Tensor], torch.Tensor] | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[rows, in] x [out, in]^T -> [splits, rows, out] float32 partial sums (sum(0) is the
    product); `fallback(x)` (default F.linear) [rows, out] where `plan` says no. `tiles`
    overrides the plan (sweeps). FP8 e4m3 weights come with `weight_scale` [out, 1] float32
    (per-channel: other layouts take the fallback): W8A16, the weight widened in registers; or
    with an e4m3 x and its `x_scale` [rows, 1] float32 (`fp8.quantize_tokens`), W8A8: e4m3
    products on the tensor cores, both scales applied to the sums. With `out_dtype` (one
    split only) the product itself, [rows, out] in that dtype."""
    rows, out_features, in_features = x.shape[0], weight.shape[0], weight.shape[1]
    fp8 = weight_scale is not None
    tiles = tiles or plan(rows, out_features, in_features, x.device, x.dtype == FP8_DTYPE)
    per_channel = not fp8 or weight_scale.shape[1] == 1
    if tiles is None or x.stride(1) != 1 or not weight.is_contiguous() or not per_channel:
        return F.linear(x, weight) if fallback is None else fallback(x)
    if out_dtype is not None and tiles.splits != 1:
        raise ValueError(f"a product in {out_dtype} takes one split, got {tiles.splits}")
    dtype = torch.float32 if out_dtype is None else out_dtype
    out = torch.empty(tiles.splits, rows, out_features, dtype=dtype, device=x.device)
    grid = (
        cdiv(out_features, tiles.block_n),
        cdiv(rows, tiles.block_m),
        tiles.splits,
    )
    partials_kernel[grid](
        x, weight, weight if weight_scale is None else weight_scale,
        x if x_scale is None else x_scale, out, rows, out_features, x.stride(0), weight.stride(0),
        in_features // tiles.splits, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, IEEE=x.dtype == torch.float32, FP8=fp8, X_SCALED=x_scale is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.launch_args(x.device),
    )  # fmt: skip
    return out if out_dtype is None else out[0]


def blas_slice_count(rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                     device: torch.device) -> int:  # fmt: skip
    """How many slices of the input features `blas_slices` takes for a product past 64 rows
    that `plan` declines, or 0: cuBLAS's own product. Two where the input features are at least
    twice the outputs (a down projection, for which cuBLAS splits K itself and adds its slices
    in a launch of its own) and twice cuBLAS's 128 x 128 output tiles still fit one wave:
    Llama-3-8B's down at 256 rows 54.1 -> 49.3 µs with the norm after it, at 128 rows 39.8 ->
    38.2; its o (4,096 features) 20.1 -> 20.5 at 256 rows, and 4 or 8 slices slower everywhere
    (H200, `benchmarks/gemm.py --with-norm`, BENCHMARKS.md session 29)."""
    if rows <= 64 or rows > MAX_ROWS or dtype not in (torch.bfloat16, torch.float16):
        return 0
    if BLAS_SLICES is not None:
        return BLAS_SLICES if in_features % max(1, BLAS_SLICES) == 0 else 0
    tiles = cdiv(rows, 128) * cdiv(out_features, 128)
    down_shaped = in_features >= 2 * out_features and in_features % 128 == 0
    return 2 if down_shaped and 2 * tiles <= num_sms(device) else 0


def blas_slices(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """[rows, in] x [out, in]^T -> [slices, rows, out] float32 partial sums (sum(0) is the
    product), slice s over input features [s * in / slices, (s + 1) * in / slices): cuBLAS's
    batched product of strided views, no copies, its float32 outputs kept (on CUDA; elsewhere
    the same in float32). cuBLAS's own split-K adds its slices in a launch of its own; these the
    next add + RMSNorm adds as it reads them, as it does `linear_partials`'."""
    rows, in_features = x.shape
    part = in_features // slices
    # [slices, rows, part] and [slices, part, out], both views
    a = x.view(rows, slices, part).transpose(0, 1)
    b = weight.view(weight.shape[0], slices, part).permute(1, 2, 0)
    if x.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def residual_product(
    x: torch.Tensor, weight: torch.Tensor, fallback: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """An o or down projection whose output the next add + RMSNorm takes: split-K partial sums
    where `plan` takes them, cuBLAS's slices where `blas_slice_count` does, else `fallback(x)`
    [rows, out]."""
    rows, (out_features, in_features) = x.shape[0], weight.shape
    tiles = plan(rows, out_features, in_features, x.device)
    if tiles is not None:
        return linear_partials(x, weight, tiles, fallback=fallback)
    slices = blas_slice_count(rows, out_features, in_features, weight.dtype, x.device)
    contiguous = x.is_contiguous() and weight.is_contiguous() and x.dtype == weight.dtype
    return blas_slices(x, weight, slices) if slices and contiguous else fallback(x)
