"""FP8 e4m3 arithmetic: per-row weight scales, per-token activation scales, dequantization.

A value x is stored as q = round(x / scale) clamped to +-448 (e4m3's largest finite value) and
read back as q * scale, in float32. The torch functions here are the reference; the Triton
kernel for activations does the same arithmetic in one launch on CUDA, and the kernels that
make a W8A8 layer's input can do it as they store it (`Fp8Rows`, `token_scale`, `to_fp8`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import next_power_of_2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in float32, clamped to e4m3's range and rounded to float8_e4m3fn."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (float8 [rows, cols], float32 scales [rows, 1]): one scale per row
    (per output channel of a weight), its largest magnitude mapped to 448."""
    scale = (w.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize(w, scale), scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group_size: int | None = None
) -> torch.Tensor:
    """float8 [rows, cols] with float32 scales [rows, groups] of `group_size` columns each (the
    last group may be short; None: one group) -> `dtype` [rows, cols]."""
    cols = q.shape[1]
    full = scale.repeat_interleave(group_size or cols, dim=1)[:, :cols]  # [rows, cols]
    return (q.float() * full).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token scales: [tokens, cols] -> (float8 [tokens, cols], float32 [tokens, 1]);
    a Triton kernel on CUDA, torch elsewhere (the same arithmetic)."""
    if x.is_cuda:
        return _quantize_tokens_triton(x)
    return quantize_rows(x)


class Fp8Rows(NamedTuple):
    """Activations already quantized per token for a W8A8 layer: what `quantize_tokens` makes
    of rows in `dtype`, made instead by the kernel that computed the rows (the add + RMSNorm or
    SiLU * up before the layer, `fused.py`), so the layer skips its own quantizing launch.
    `quant.linear.prepare` decides where they are made; `Fp8Linear` takes them for a tensor."""

    values: torch.Tensor  # [rows, cols] float8 e4m3
    scale: torch.Tensor  # [rows, 1] float32
    dtype: torch.dtype  # the rows' dtype before quantization: the product's

    @classmethod
    def of(cls, x: torch.Tensor) -> Fp8Rows:
        """[rows, cols] x quantized by `quantize_tokens` (the unfused path)."""
        return cls(*quantize_tokens(x), x.dtype)


def as_fp8_rows(x: torch.Tensor | Fp8Rows) -> Fp8Rows:
    """x quantized per token, unless it already is."""
    return x if isinstance(x, Fp8Rows) else Fp8Rows.of(x)


@functools.cache
def has_fp8_gemm(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores with the row-wise scaled GEMM torch ships (Hopper
    and newer)."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) >= (9, 0)


# The per-token arithmetic, shared by every kernel that quantizes rows (here and the fused
# norm and SiLU * up of `fused.py`), so that their codes and scales are the same bits.
@triton.jit
def token_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's float32 scale from its largest magnitude: amax / 448, at least MIN_SCALE."""
    return tl.maximum(amax / FP8_MAX, MIN_SCALE)


@triton.jit
def to_fp8(x, scale, q_ptr, FP8_MAX: tl.constexpr):
    """float32 x / scale, clamped to e4m3's range, in the element type of `q_ptr`."""
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)


@triton.jit
def quantize_tokens_kernel(
    x_ptr, q_ptr, scale_ptr, cols, x_stride, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    x = tl.load(x_ptr + row * x_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = token_scale(tl.max(tl.abs(x), axis=0), FP8_MAX, MIN_SCALE)
    tl.store(q_ptr + row * cols + offsets, to_fp8(x, scale, q_ptr, FP8_MAX), mask=mask)
    tl.store(scale_ptr + row, scale)


def _quantize_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    assert x.stride(1) == 1
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)  # [tokens, cols] e4m3
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)  # [tokens, 1]
    block = next_power_of_2(cols)
    quantize_tokens_kernel[(rows,)](
        x, q, scale, cols, x.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block,
        num_warps=min(16, max(4, block // 512)), **pdl.launch_args(x.device),
    )  # fmt: skip
    return q, scale
