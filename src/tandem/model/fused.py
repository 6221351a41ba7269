"""Small fused ops of the decoder: residual add + RMSNorm, SiLU(gate) * up, and q/k norm + rotary
+ the K/V cache store.

Each has a torch version (CPU, and the reference) and a Triton kernel used on CUDA that does
the same arithmetic in one launch instead of five to twenty, rounding to the model dtype at the
same points as the torch version (values agree up to float32 rounding inside).

Ahead of a W8A8 layer the add + RMSNorm and SiLU * up can store their output quantized per
token (`fp8_out`, an `fp8.Fp8Rows`): the codes and scales `fp8.quantize_tokens` would make of
the output in the model dtype, bit for bit, without its launch and its pass over the rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem import envs, pdl
from tandem.attention.torch_ref import write_kv
from tandem.config import cdiv, next_power_of_2
from tandem.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Rows, to_fp8, token_scale

# On CUDA the Triton kernels run (here and in the sampler) unless TANDEM_FUSED_KERNELS=0, which
# keeps the torch versions: the "before" side of a fusion measurement.
KERNELS = envs.fused_kernels()


def use_kernels(x: torch.Tensor) -> bool:
    """Whether ops on `x` run as Triton kernels (tests patch this to run them interpreted on CPU)."""
    return KERNELS and x.is_cuda


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SMs, which size the split kernels' grids; 8 in the interpreter, so that CPU
    tests still cover splits."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    fixed_warps: bool = False,
    fp8_out: bool = False,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); x: [rows, hidden]. The sum is written
    over `residual`: the residual stream advances in place, so it stays in one buffer through a
    step (a step cut into CUDA graphs at its attentions hands it from graph to graph, see
    `piecewise`). Without a residual, the sum is x itself.

    x may also be partials [parts, rows, hidden], with a residual: float32 partial sums of a
    split-K matmul (`splitk.linear_partials`), or a MoE block's weighted expert outputs in the
    model dtype, [top_k, tokens, hidden] (a strided view, `moe.SparseMoeBlock`). Their sum, in
    float32 in part order and rounded to the residual's dtype as a matmul's output or torch's
    sum would be, is the x added. With `fixed_warps` (deterministic mode) the kernel's warps
    follow the width alone, never the rows. With `fp8_out` the normed rows come quantized per
    token (the kernel stores them so; torch quantizes its output)."""
    if use_kernels(x):
        return _add_rms_norm_triton(x, residual, weight, eps, None, fixed_warps, fp8_out)
    if x.dim() == 3:
        x = x.sum(0).to(residual.dtype)
    summed = x if residual is None else residual.add_(x)
    xf = summed.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return (Fp8Rows.of(out) if fp8_out else out), summed


def silu_and_mul(gate_up: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Rows:
    """[rows, 2 * inter] -> [rows, inter]: SiLU of the first half times the second half; with
    `fp8_out` quantized per token (`fp8.Fp8Rows`)."""
    if use_kernels(gate_up):
        return _silu_and_mul_fp8_triton(gate_up) if fp8_out else _silu_and_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return Fp8Rows.of(out) if fp8_out else out


def act_and_mul(
    gate_up: torch.Tensor, hidden_act: str, fp8_out: bool = False
) -> torch.Tensor | Fp8Rows:
    """[rows, 2 * inter] -> act(gate) * up: SwiGLU (`silu`) or GeGLU (`gelu_tanh`, in torch);
    with `fp8_out` quantized per token (fused into SwiGLU's kernel)."""
    if hidden_act == "silu":
        return silu_and_mul(gate_up, fp8_out)
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.gelu(gate, approximate="tanh") * up
    return Fp8Rows.of(out) if fp8_out else out


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    q_out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Per-head RMSNorm of q and k (when norm weights are given, as in Qwen3), then the rotary
    embedding ("rotate half" layout); k and v are stored at their slots of the paged cache
    ([2, blocks, block_size, kv_heads, head_dim]; slot -1 stores nothing that is read; an FP8
    cache stores k / k_scale and v / v_scale) and the new contiguous q is returned (in `q_out`
    when given). q, k, v: [tokens, heads, head_dim], possibly strided views; cos_sin:
    [max_position, head_dim] float32, cos | sin, looked up by `positions` [tokens]."""
    if use_kernels(q):
        return _rope_qk_triton(
            q, k, v, positions, cos_sin, kv_cache, slot_mapping, q_norm_weight, k_norm_weight, eps,
            q_out, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    if q_norm_weight is not None:
        q, k = _head_norm(q, q_norm_weight, eps), _head_norm(k, k_norm_weight, eps)
    write_kv(kv_cache, rotate(k, cos, sin), v, slot_mapping, k_scale, v_scale)
    rotated = rotate(q, cos, sin)
    return rotated if q_out is None else q_out.copy_(rotated)


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x.reshape(-1, x.shape[-1]), None, weight, eps)[0].view(x.shape)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the "rotate half" layout (torch). x: [tokens, heads, head_dim];
    cos, sin: [tokens, head_dim // 2] float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@triton.jit
def summed_partials(ptrs, mask, part_stride, PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """The values at `ptrs`; with PARTS, that many partials (float32 split-K slices, or a MoE
    block's top_k expert outputs) part_stride apart, added in order in float32 and rounded once
    to DTYPE, as the product or torch's sum would be."""
    if PARTS == 0:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        parts = tl.zeros(ptrs.shape, tl.float32)
        for part in tl.static_range(PARTS):
            parts += tl.load(ptrs + part * part_stride, mask=mask, other=0.0).to(tl.float32)
        x = parts.to(DTYPE)
    return x


@triton.jit
def scaled_rms(x, inv_rms, weight):
    """weight * (x * inv_rms), each product rounded to x's dtype as torch's RMSNorm, then its
    weight, would round it."""
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
    return (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, x_stride, residual_stride, hidden, eps,
    part_stride, HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
    FP8_OUT: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = summed_partials(
        x_ptr + row * x_stride + cols, mask, part_stride, PARTS, residual_ptr.dtype.element_ty
    )
    if HAS_RESIDUAL:  # the sum over the residual: each program reads its row before writing it
        residual = residual_ptr + row * residual_stride + cols
        x = (x.to(tl.float32) + tl.load(residual, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    out = scaled_rms(x, inv_rms, tl.load(weight_ptr + cols, mask=mask, other=0.0))
    if FP8_OUT:  # the rounded output quantized per token, still in registers
        out = out.to(tl.float32)
        scale = token_scale(tl.max(tl.abs(out), axis=0), FP8_MAX, MIN_SCALE)
        tl.store(out_ptr + row * hidden + cols, to_fp8(out, scale, out_ptr, FP8_MAX), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * hidden + cols, out, mask=mask)


def norm_warps(block: int, rows: int, device: torch.device, fixed: bool = False) -> int:
    """Warps of the add + RMSNorm kernel's one program per row of `block` columns. Where the
    rows are fewer than the SMs (a decode step), each row's loads (up to four split-K partials
    and the residual) are what the step waits for, so they get 8 columns per thread, up to 16
    warps: at 4,096 columns that took Llama-3-8B's 32-row step from 5.34 to 5.26 ms
    (BENCHMARKS.md, twelfth run). Many rows (a prefill chunk) fill the device with 4 warps each,
    and more warps are slower there (8,192 x 1,024: 15.3 µs with 4, 25.3 with 16)."""
    if rows > num_sms(device) and not fixed:  # fixed: deterministic mode, the width alone
        return 4
    return min(16, max(4, block // 256))


def _add_rms_norm_triton(
    x, residual, weight, eps, num_warps=None, fixed_warps=False, fp8_out=False
):  # fmt: skip
    parts = x.shape[0] if x.dim() == 3 else 0
    rows, hidden = x.shape[-2:]
    dtype = x.dtype if residual is None else residual.dtype
    # [rows, hidden] in the model dtype, or e4m3 with float32 scales [rows, 1]
    out = torch.empty((rows, hidden), dtype=FP8_DTYPE if fp8_out else dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8_out else out
    summed = x if residual is None else residual
    assert x.stride(-1) == 1 and summed.stride(-1) == 1
    block = next_power_of_2(hidden)
    add_rms_norm_kernel[(rows,)](
        x, summed, weight, out, scale, x.stride(-2), summed.stride(0), hidden, eps, x.stride(0),
        HAS_RESIDUAL=residual is not None, PARTS=parts, BLOCK=block, FP8_OUT=fp8_out,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        num_warps=num_warps or norm_warps(block, rows, x.device, fixed_warps),
        **pdl.launch_args(x.device),
    )  # fmt: skip
    return (Fp8Rows(out, scale, dtype) if fp8_out else out), summed


@triton.jit
def _silu_mul(gate_up_ptr, row, stride, inter, cols, mask):
    """SiLU(gate) * up at columns `cols` of a row, rounded to the model dtype as torch does."""
    gate = tl.load(gate_up_ptr + row * stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    tl.store(out_ptr + row * inter + cols, _silu_mul(gate_up_ptr, row, stride, inter, cols, mask),
             mask=mask)  # fmt: skip


def _silu_and_mul_triton(gate_up):
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    silu_and_mul_kernel[(rows, cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, **pdl.launch_args(gate_up.device)
    )
    return out


@triton.jit
def silu_and_mul_fp8_kernel(
    gate_up_ptr, q_ptr, scale_ptr, stride, inter, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    out = _silu_mul(gate_up_ptr, row, stride, inter, cols, mask).to(tl.float32)
    scale = token_scale(tl.max(tl.abs(out), axis=0), FP8_MAX, MIN_SCALE)
    tl.store(q_ptr + row * inter + cols, to_fp8(out, scale, q_ptr, FP8_MAX), mask=mask)
    tl.store(scale_ptr + row, scale)


# The widest row the quantizing SiLU * up keeps in registers (Llama-3-8B's 14,336 columns pad
# to it); wider rows take the plain kernel and `quantize_tokens` after it.
FP8_SILU_MAX_BLOCK = 16384


def _silu_and_mul_fp8_triton(gate_up: torch.Tensor, num_warps: int | None = None) -> Fp8Rows:
    """SiLU * up quantized per token. A row's scale needs the row's largest magnitude, so one
    program takes a whole row, loaded once and kept in registers (16 warps at 16,384 columns:
    32 values of gate and of up a thread), and stores its codes and scale: one pass over the
    input and one launch. The other shapes considered: the plain kernel's (rows, columns / 1024)
    grid cannot see a row's maximum without a second launch or a grid-wide sync, which is what
    this removes; one program per row looping over column blocks twice (a maximum, then the
    codes) keeps few registers but runs its loads one block at a time, each waiting on memory,
    where the one-pass program issues the whole row's loads at once. A decode step's few rows
    (2-64 programs for 132 SMs) are latency-bound, so those loads in flight are what count; a
    prefill chunk's thousands of rows fill every SM either way."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    block = next_power_of_2(inter)
    if block > FP8_SILU_MAX_BLOCK:
        return Fp8Rows.of(_silu_and_mul_triton(gate_up))
    q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=gate_up.device)  # [rows, inter] e4m3
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)  # [rows, 1]
    silu_and_mul_fp8_kernel[(rows,)](
        gate_up, q, scale, gate_up.stride(0), inter, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        BLOCK=block, num_warps=num_warps or min(16, max(4, block // 1024)),
        **pdl.launch_args(gate_up.device),
    )  # fmt: skip
    return Fp8Rows(q, scale, gate_up.dtype)


@triton.jit
def _norm_rotate_heads(
    x_ptr, out_ptr, weight_ptr, cos_sin_ptr, token, out_row, write, position, token_stride,
    head_stride, num_heads, eps, out_scale, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HEADS: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One token's heads, [HEADS, HALF_PAD] tiles for the two halves of each head (HALF_PAD:
    HALF's next power of two, the columns past HALF masked), to row `out_row` of a contiguous
    [rows, num_heads, 2 * HALF] output (nothing stored unless `write`); with FP8, an e4m3
    output of the values over `out_scale`."""
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    base = x_ptr + token * token_stride + heads * head_stride + dims
    dtype = x_ptr.dtype.element_ty  # the model's (an FP8 cache's output is not)
    a = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        a = _rms_scaled(a, inv_rms[:, None], tl.load(weight_ptr + dims, mask=dims < HALF), dtype)
        b = _rms_scaled(
            b, inv_rms[:, None], tl.load(weight_ptr + HALF + dims, mask=dims < HALF), dtype
        )
    c = tl.load(cos_sin_ptr + position * (2 * HALF) + dims, mask=dims < HALF)
    s = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + dims, mask=dims < HALF)
    out = out_ptr + out_row * num_heads * 2 * HALF + heads * 2 * HALF + dims
    first, second = (a * c - b * s).to(dtype), (b * c + a * s).to(dtype)
    if FP8:  # quantized from the model-dtype values, as the torch version does
        first = fp8_range(first.to(tl.float32) / out_scale)
        second = fp8_range(second.to(tl.float32) / out_scale)
    tl.store(out, first.to(out_ptr.dtype.element_ty), mask=mask & write)
    tl.store(out + HALF, second.to(out_ptr.dtype.element_ty), mask=mask & write)


@triton.jit
def _rms_scaled(x, inv_rms, weight, dtype: tl.constexpr):
    """float32 x of a row in `dtype` (the model's) times its 1 / RMS, then its weight, rounded
    to `dtype` where the torch RMSNorm rounds; back in float32."""
    x = (x * inv_rms).to(dtype).to(tl.float32)
    return (weight.to(tl.float32) * x).to(dtype).to(tl.float32)


@triton.jit
def normed_rotated(
    rows_ptr, row_valid, dims, position, cos_sin_ptr, weight_ptr, eps, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Rows [R, HEAD_PAD] of heads at `rows_ptr` [R] (their first dimension each), per-head
    RMSNorm'd by `weight_ptr` with HAS_NORM and rotated ("rotate half") by the cos and sin of
    `position`, in the rows' dtype, as `_norm_rotate_heads` makes them from a head's two halves:
    here each dimension d beside its partner d +- HEAD_DIM / 2 in one full-width tile (the
    decode attention's q tile), the first half's rotated x c - y s and the second's x c + y s."""
    HALF: tl.constexpr = HEAD_DIM // 2
    in_head = dims < HEAD_DIM
    partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
    mask = row_valid[:, None] & in_head[None, :]
    dtype = rows_ptr.dtype.element_ty
    x = tl.load(rows_ptr[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(rows_ptr[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # rounded to the model dtype where the torch RMSNorm rounds
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        x_weight = tl.load(weight_ptr + dims, mask=in_head)[None, :]
        y_weight = tl.load(weight_ptr + partner, mask=in_head)[None, :]
        x = _rms_scaled(x, inv_rms[:, None], x_weight, dtype)
        y = _rms_scaled(y, inv_rms[:, None], y_weight, dtype)
    half = tl.where(dims < HALF, dims, dims - HALF)
    c = tl.load(cos_sin_ptr + position * HEAD_DIM + half, mask=in_head, other=0.0)[None, :]
    s = tl.load(cos_sin_ptr + position * HEAD_DIM + HALF + half, mask=in_head, other=0.0)[None, :]
    sign = tl.where(dims < HALF, -1.0, 1.0)[None, :]
    return (x * c + sign * (y * s)).to(dtype)


@triton.jit
def fp8_range(x):
    return tl.clamp(x, -448.0, 448.0)  # e4m3's largest finite value: stored saturated


@triton.jit
def rope_qk_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, cache_ptr, q_weight_ptr, k_weight_ptr, positions_ptr,
    cos_sin_ptr, slot_ptr, q_token_stride, q_head_stride, k_token_stride, k_head_stride,
    v_token_stride, v_head_stride, kv_half_stride, num_q_heads, num_k_heads, eps, k_scale,
    v_scale, HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    _norm_rotate_heads(
        q_ptr, q_out_ptr, q_weight_ptr, cos_sin_ptr, token, token, token >= 0, position,
        q_token_stride, q_head_stride, num_q_heads, eps, 1.0, HALF, HALF_PAD, Q_HEADS, HAS_NORM,
        False,
    )  # fmt: skip
    # k and v to the cache rows of this token's slot (the K half, then the V half)
    _norm_rotate_heads(
        k_ptr, cache_ptr, k_weight_ptr, cos_sin_ptr, token, slot, slot >= 0, position,
        k_token_stride, k_head_stride, num_k_heads, eps, k_scale, HALF, HALF_PAD, K_HEADS,
        HAS_NORM, FP8,
    )  # fmt: skip
    heads = tl.arange(0, K_HEADS)[:, None]
    dims = tl.arange(0, 2 * HALF_PAD)[None, :]
    mask = (heads < num_k_heads) & (slot >= 0) & (dims < 2 * HALF)
    v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + dims, mask=mask)
    if FP8:
        v = fp8_range(v.to(tl.float32) / v_scale)
    v = v.to(cache_ptr.dtype.element_ty)
    row = cache_ptr + kv_half_stride + slot * num_k_heads * 2 * HALF
    tl.store(row + heads * 2 * HALF + dims, v, mask=mask)


def _rope_qk_triton(
    q, k, v, positions, cos_sin, kv_cache, slot_mapping, q_norm_weight, k_norm_weight, eps,
    q_out=None, num_warps=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos_sin.is_contiguous()
    fp8 = kv_cache.dtype == FP8_DTYPE
    assert (fp8 or kv_cache.dtype == k.dtype) and kv_cache.is_contiguous()
    assert kv_cache.shape[-2:] == (k_heads, head_dim), "cache layout [2, blocks, block, heads, dim]"
    if q_out is None:
        q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    assert q_out.shape == q.shape and q_out.is_contiguous()
    has_norm = q_norm_weight is not None
    rope_qk_kernel[(tokens,)](
        q, k, v, q_out, kv_cache, q_norm_weight if has_norm else q,
        k_norm_weight if has_norm else k, positions, cos_sin, slot_mapping, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(0),
        q_heads, k_heads, eps, k_scale, v_scale, HALF=head_dim // 2,
        HALF_PAD=next_power_of_2(head_dim // 2), Q_HEADS=next_power_of_2(q_heads),
        K_HEADS=next_power_of_2(k_heads), HAS_NORM=has_norm, FP8=fp8, num_warps=num_warps or 4,
        **pdl.launch_args(q.device),
    )  # fmt: skip
    return q_out
