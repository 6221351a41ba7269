"""Small fused ops of the decoder: residual add + RMSNorm, SiLU(gate) * up, rotary embedding.

Each has a torch version (CPU, and the reference) and a Triton kernel used on CUDA that does
the same arithmetic in one launch instead of five to twenty, rounding to the model dtype at the
same points as the torch version (values agree up to float32 rounding inside).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# On CUDA the Triton kernels run (here and in the sampler) unless TANDEM_FUSED_KERNELS=0, which
# keeps the torch versions: the "before" side of a fusion measurement.
KERNELS = os.environ.get("TANDEM_FUSED_KERNELS", "1") != "0"


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); x: [rows, hidden]. Without a residual, x."""
    if x.is_cuda and KERNELS:
        return _add_rms_norm_triton(x, residual, weight, eps)
    summed = x if residual is None else x + residual
    xf = summed.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] -> [rows, inter]: SiLU of the first half times the second half."""
    if gate_up.is_cuda and KERNELS:
        return _silu_and_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the "rotate half" layout. x: [tokens, heads, head_dim];
    cos, sin: [tokens, head_dim // 2] float32."""
    half = x.shape[-1] // 2
    if (
        x.is_cuda and KERNELS and half & (half - 1) == 0
    ):  # the kernel's tiles need a power-of-two half
        return _rotate_triton(x, cos, sin)
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, x_stride, residual_stride, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (
            x.to(tl.float32)
            + tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(
                tl.float32
            )
        ).to(x.dtype)
        tl.store(summed_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * hidden + cols, out, mask=mask)


def _add_rms_norm_triton(x, residual, weight, eps):
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(out)
    add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed, x.stride(0),
        (residual if residual is not None else x).stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
    )  # fmt: skip
    return out, summed


@triton.jit
def silu_and_mul_kernel(gate_up_ptr, out_ptr, stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(
        out_ptr + row * inter + cols,
        (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
        mask=mask,
    )


def _silu_and_mul_triton(gate_up):
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block
    )
    return out


@triton.jit
def rotate_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, token_stride, head_stride, num_heads, cos_stride,
    HALF: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    base = x_ptr + token * token_stride + heads * head_stride + dims
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    c = tl.load(cos_ptr + token * cos_stride + dims)
    s = tl.load(sin_ptr + token * cos_stride + dims)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out = out_ptr + token * num_heads * 2 * HALF + heads * 2 * HALF + dims
    tl.store(out, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(out + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


def _rotate_triton(x, cos, sin):
    tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(0) == cos.stride(0)
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    rotate_kernel[(tokens,)](
        x, cos, sin, out, x.stride(0), x.stride(1), heads, cos.stride(0),
        HALF=head_dim // 2, HEADS=triton.next_power_of_2(heads),
    )  # fmt: skip
    return out
