"""The FP8 linear layer: e4m3 weights with float32 scales, computed as W8A8 or W8A16.

W8A8 (CUDA with FP8 tensor cores, bfloat16 models): each call quantizes its input per token
(`fp8.quantize_tokens`) and multiplies with `torch._scaled_mm`, cuBLASLt/CUTLASS's FP8 GEMM with
a scale per input row and per weight row, into bfloat16. Decode sizes take Triton kernels
instead: one row the matrix-vector kernel of `gemv` (W8A16), up to SPLITK_W8A8_ROWS rows the
split-K kernel over e4m3 activations and weights (`w8a8_splitk`). W8A16 (CPU, other GPUs, other dtypes):
the weight is dequantized to the input's dtype and F.linear runs, so on CPU in float32 the
result equals F.linear over the dequantized weight exactly.

A W8A8 layer also takes its input already quantized (`fp8.Fp8Rows`) and then skips its own
quantizing launch: where the output of a norm or SiLU * up feeds this layer alone, `prepare`
has that kernel store it quantized (`fuse_input_quantization`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem import envs
from tandem.config import cdiv
from tandem.model import splitk
from tandem.model.fused import num_sms
from tandem.quant import gemv, int4
from tandem.quant.checkpoint import Fp8Config
from tandem.quant.fp8 import (
    FP8_DTYPE,
    Fp8Rows,
    as_fp8_rows,
    dequantize,
    has_fp8_gemm,
    quantize_rows,
)
from tandem.quant.int4 import Int4Config

logger = logging.getLogger(__name__)


class Fp8Linear(nn.Module):
    """y = x W^T + b, W float8 e4m3 [out, in] with float32 scales [out, groups]: one scale per
    output row and group of `group_size` input columns (one group: per-channel scales)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group_size: int | None = None
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size  # None: one scale per row
        groups = 1 if group_size is None else cdiv(in_features, group_size)
        # [out, in] float8 e4m3 and [out, groups] float32, filled by the loader
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, groups, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.w8a8 = False  # set by `prepare` once the weights are in

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.shape[1] == 1

    def forward(self, x: torch.Tensor | Fp8Rows, add_bias: bool = True) -> torch.Tensor:
        """x: [..., in], or [rows, in] rows quantized already (W8A8 only, see
        `takes_fp8_rows`)."""
        bias = self.bias if add_bias else None
        if isinstance(x, Fp8Rows):
            y = self._w8a8(x)
            return y if bias is None else y + bias
        if not self.w8a8:
            weight = dequantize(self.weight, self.weight_scale, x.dtype, self.group_size)
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, self.in_features).contiguous()
        if rows.shape[0] <= gemv.MAX_ROWS:
            y = gemv.fp8_gemv(rows, self.weight, self.weight_scale)
        else:
            y = self._w8a8(rows)
        y = y if bias is None else y + bias
        return y.view(*x.shape[:-1], self.out_features)

    def _w8a8(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """[rows, in] (bf16, quantized per token here, or `Fp8Rows`) -> [rows, out] bf16."""
        if rows_of(x) <= SPLITK_W8A8_ROWS and splitk.ENABLED:
            return w8a8_splitk(x, self.weight, self.weight_scale)
        return w8a8_linear(x, self.weight, self.weight_scale)

    def residual_partials(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """The o or down projection (`decoder.to_residual`) on one device: the matrix-vector
        kernel's product at one row; float32 slices of split-K over e4m3 activations and
        weights (W8A8) up to SPLITK_W8A8_ROWS rows, or over e4m3 weights alone (W8A16) past
        them, where split-K's plan takes the shape; else this layer's product. Quantized rows
        take the W8A8 ways (past SPLITK_W8A8_ROWS only where `takes_fp8_rows` says)."""
        rows = rows_of(x)
        if (self.w8a8 and rows <= gemv.MAX_ROWS) or not splitk.ENABLED:
            return self(x)
        if self.w8a8 and rows <= SPLITK_W8A8_ROWS:
            x8 = as_fp8_rows(x)  # [rows, in] e4m3, [rows, 1] float32
            return splitk.linear_partials(
                x8.values, self.weight, weight_scale=self.weight_scale, x_scale=x8.scale,
                fallback=lambda _: self(x8),
            )  # fmt: skip
        if isinstance(x, Fp8Rows):
            return self(x)
        return splitk.linear_partials(x, self.weight, weight_scale=self.weight_scale, fallback=self)

    def takes_fp8_rows(self, rows: int, residual: bool = False) -> bool:
        """Whether this layer's product of `rows` rows starts by quantizing them per token
        (W8A8 past the matrix-vector kernel's one row, which reads bf16), so the kernel that
        makes them may hand them over quantized (`Fp8Rows`) at no change to the result.
        `residual`: the product as `residual_partials` computes it, whose split-K past
        SPLITK_W8A8_ROWS reads bf16 rows (W8A16) where its plan takes the shape."""
        if not self.w8a8 or rows <= gemv.MAX_ROWS:
            return False
        if not residual or not splitk.ENABLED or rows <= SPLITK_W8A8_ROWS:
            return True
        return splitk.plan(rows, self.out_features, self.in_features, self.weight.device) is None

    def to_per_channel(self) -> None:
        """Group scales -> one scale per row: the weight dequantized and quantized again."""
        if self.per_channel:
            return
        full = dequantize(self.weight, self.weight_scale, torch.float32, self.group_size)
        weight, scale = quantize_rows(full)
        self.group_size = None
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)


# Decode sizes: up to here the split-K kernel multiplies e4m3 by e4m3 (W8A8) in place of
# `torch._scaled_mm`, whose 128 x 128 tiles leave SMs idle at few rows. H200, 32 rows, µs,
# quantization included (`benchmarks/gemm.py --fp8`): Llama-3-8B's qkv 14.3 against 19.3, o 10.0
# against 10.7 (W8A16 split-K), gate_up 37.0 against 47.8, down 25.6 against 28.9 (W8A16).
SPLITK_W8A8_ROWS = 64


def rows_of(x: torch.Tensor | Fp8Rows) -> int:
    return x.values.shape[0] if isinstance(x, Fp8Rows) else x.shape[0]


def w8a8_splitk(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """[rows, in] bf16 x (e4m3 [out, in] with float32 [out, 1] scales)^T -> [rows, out] bf16 at
    decode sizes: x quantized per token (unless given as `Fp8Rows`), then the split-K kernel
    over both e4m3 operands in one split (rounded to bf16 as it stores), with 32-wide output
    tiles where 64-wide ones would leave SMs without a program; `torch._scaled_mm` where
    split-K's plan declines."""
    rows, out_features = rows_of(x), weight.shape[0]
    tiles = splitk.plan(rows, out_features, weight.shape[1], weight.device, fp8_input=True)
    if tiles is None:
        return w8a8_linear(x, weight, weight_scale)
    programs = cdiv(rows, tiles.block_m) * cdiv(out_features, 64)
    tiles = tiles._replace(splits=1, block_n=32 if programs < num_sms(weight.device) else 64)
    x8 = as_fp8_rows(x)  # [rows, in] e4m3, [rows, 1] float32
    return splitk.linear_partials(
        x8.values, weight, tiles, weight_scale=weight_scale, x_scale=x8.scale, out_dtype=x8.dtype
    )


def w8a8_linear(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """[rows, in] bf16 x (e4m3 [out, in] with float32 [out, 1] scales)^T -> [rows, out] bf16:
    x quantized per token (unless given as `Fp8Rows`), then the FP8 GEMM with both scales
    applied to its float32 sums."""
    x8 = as_fp8_rows(x)  # [rows, in] e4m3, [rows, 1] float32
    return torch._scaled_mm(
        x8.values,
        weight.t(),  # [in, out], column-major as the FP8 GEMM wants
        scale_a=x8.scale,
        scale_b=weight_scale.view(1, -1),  # [1, out]
        out_dtype=x8.dtype,
    )


def prepare(model: nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """After loading: W8A8 where the device and dtype allow it (block scales turned into
    per-channel ones for the GEMM), W8A16 elsewhere, with a warning. Returns which."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    w8a8 = has_fp8_gemm(device) and dtype == torch.bfloat16
    if not w8a8:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        logger.warning(
            "FP8 weights on %s in %s: the FP8 GEMM needs a GPU of compute capability 9.0 "
            "(Hopper) and bfloat16, so the weights are dequantized for each matmul (W8A16)",
            where,
            str(dtype).removeprefix("torch."),
        )
    for layer in layers:
        # the FP8 GEMM takes sizes in multiples of 16
        layer.w8a8 = w8a8 and layer.in_features % 16 == 0 and layer.out_features % 16 == 0
        if layer.w8a8:
            layer.to_per_channel()
    if w8a8 and envs.fp8_fused_quant():
        fuse_input_quantization(model)
    return "w8a8" if w8a8 else "w8a16"


def fuse_input_quantization(model: nn.Module) -> None:
    """Where the output of a norm or of SiLU * up feeds one W8A8 layer alone, its kernel
    stores it quantized for that layer at the row counts the layer quantizes at (the norm's
    and the MLP's `quantize_out`, the layer's `takes_fp8_rows`), one launch and pass fewer.
    Llama-style layers on one device: the input norm before the qkv projection; in a dense MLP
    the post-attention norm before gate_up, and SwiGLU before down. Not: a mixture-of-experts
    block (its router reads the normed rows in the model dtype), Gemma's layers (GeGLU in
    torch, norms around each projection), tensor parallelism (the down projection's partial
    sums go to an all-reduce). Deterministic mode refuses FP8 layers (`batch_invariant`)."""
    from tandem.model.decoder import MLP, DecoderLayer  # the decoder builds us: imported late

    for layer in model.modules():
        if type(layer) is not DecoderLayer or layer.self_attn.tp.size != 1:
            continue
        layer.input_layernorm.quantize_out = _w8a8_input(layer.self_attn.qkv_proj)
        mlp = layer.mlp
        if type(mlp) is not MLP:
            continue
        layer.post_attention_layernorm.quantize_out = _w8a8_input(mlp.gate_up_proj)
        down = _w8a8_input(mlp.down_proj)
        if down is not None and mlp.hidden_act == "silu":  # the product of `to_residual`
            mlp.quantize_out = functools.partial(down, residual=True)


def _w8a8_input(linear: nn.Module) -> Callable[..., bool] | None:
    return linear.takes_fp8_rows if isinstance(linear, Fp8Linear) and linear.w8a8 else None


def linear_factory(scheme: Fp8Config | Int4Config | None) -> Callable[..., nn.Module]:
    """What the decoder builds its projections with: (in, out, bias=) -> a linear layer."""
    if scheme is None:
        return nn.Linear
    if isinstance(scheme, Int4Config):
        return int4.layer_factory(scheme)
    return functools.partial(Fp8Linear, group_size=scheme.group_size)
