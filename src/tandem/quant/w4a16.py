"""4-bit weight-only linear layers (W4A16): int4 weight codes with a scale and a zero point per
group of input columns, as GPTQ, AWQ and compressed-tensors int4 checkpoints store them, times
activations in the model dtype.

Eight codes share an int32 word, column c of a row in bits 4 * (c % 8) .. 4 * (c % 8) + 3 of
word c // 8 (`pack`). The Triton kernel reads a tile of words, unpacks it in registers with
shifts, subtracts the zero points, multiplies by the scales, rounds to the input's dtype (see
LANES16) and multiplies on the tensor cores into float32 sums: the weight crosses memory as 4 bits
(plus a scale and a zero per group), a quarter of bfloat16's bytes, which is what a decode step
pays for. At decode sizes the output tiles alone leave most SMs idle, so the input features are
split over several programs per tile (split-K), whose float32 partial sums a second small kernel
adds up and rounds. Elsewhere than CUDA (and Triton's interpreter) the weight is dequantized and
F.linear runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv
from tandem.model.fused import num_sms

PACK = 8  # int4 values per int32 word
# Triton's CPU interpreter (the tests without a GPU): its kernels take CPU tensors
INTERPRETED = triton.knobs.runtime.interpret
# split K only up to this many rows: past it the float32 partials outweigh the int4 weight
SPLIT_ROWS = 64
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# How a step's codes become weights where the input and the scales share a 16-bit dtype: in
# 16-bit lanes (LANES16: the code OR'd into the exponent bits of 128 (bf16) or 1024 (fp16) is
# that number plus the code, then one subtraction of the zero point's number and one multiply by
# the scale, both exact but the last, two lanes an instruction: no int-to-float converts), or in
# float32 (code minus zero point, converted, times the scale, rounded). Both give the same bits.
# Unpacking, not the weight read, bounds the kernel at decode sizes. On an H100 (BENCHMARKS.md,
# session 58) the lanes took 5-7% less time than float32 at one row (gate_up 95.4 against 101.0
# us) and 9-10% at 256; two other ways measured there (per-code word loads: 8x as long; a
# group's summed products scaled once: 1.7x) are gone. `benchmarks/gemm.py --int4` times both.
LANES16 = True
# Decode rows' K steps a bit plane at a time (`w4a16_planes_kernel`), up to PLANES_ROWS rows (0:
# never). On an H100 (BENCHMARKS.md, session 59) faster than the whole-step kernel up to 4 rows
# (one row: gate_up 63.9 against 95.5 us, down 38.6 against 46.3, below bf16's 80.9 and 42.9),
# even at 8, slower past it (16 rows: gate_up 119.9 against 93.1). `gemm.py --int4`: int4planes.
PLANES_ROWS = 4


class W4Tiles(NamedTuple):
    block_m: int  # rows per program
    block_n: int  # output features per program
    block_k: int  # input features per loop step (the widest allowed, in SHAPES)
    splits: int  # slices of the input features, one program each per output tile
    num_warps: int = 4
    num_stages: int = 3
    planes: bool = False  # w4a16_planes_kernel rather than w4a16_kernel


# (most rows, tiles): untuned guesses, not yet timed on a GPU. Decode rows take tl.dot's least
# 16 rows and four stages of 128-feature steps in flight (the weight read is the cost: 64
# outputs x 128 codes are 4 KB a step; 256-feature steps took 255 registers a thread for sm_90,
# against 168); prefill rows take 128 x 128 output tiles, FLOP-bound as a bfloat16 GEMM is.
SHAPES: tuple[tuple[float, W4Tiles], ...] = (
    (16, W4Tiles(16, 64, 128, 1, 4, 4)),
    (32, W4Tiles(32, 64, 128, 1, 4, 4)),
    (64, W4Tiles(64, 64, 64, 1, 4, 3)),
    (128, W4Tiles(64, 128, 64, 1, 4, 3)),
    (float("inf"), W4Tiles(128, 128, 64, 1, 8, 3)),
)


@triton.jit
def weights(q, z, s, dtype: tl.constexpr, LANES16: tl.constexpr):
    """Codes q (int32, 0..15) less zero points z (uint8) times scales s, in `dtype`."""
    if LANES16:  # 128 + q (bf16) or 1024 + q (fp16), less 128 + z: exact; times s: rounded
        if dtype == tl.bfloat16:
            biased = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            w = (biased - (z.to(tl.float32) + 128.0).to(tl.bfloat16)) * s
        else:
            biased = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            w = (biased - (z.to(tl.float32) + 1024.0).to(tl.float16)) * s
    else:
        w = ((q - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)).to(dtype)
    return w


@triton.jit
def program_tile(rows, out_features, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows m [BLOCK_M] and outputs n [BLOCK_N], which of them exist, and its
    slice of the input features (grid: output tiles, row tiles, splits)."""
    tile_n, tile_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return m, n, m < rows, n < out_features, split


@triton.jit
def store_tile(out_ptr, acc, rows, out_features, m, n, in_m, in_n, split):
    """acc [BLOCK_M, BLOCK_N] into split's slice of out: float32 partial sums, or with one
    split the product in the input's dtype."""
    out = out_ptr + (split * rows + m[:, None]).to(tl.int64) * out_features + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


@triton.jit
def step_scales(
    scale_ptr, zero_ptr, group_rows, in_n, start, columns, in_features, group_size,
    ONE_GROUP: tl.constexpr,
):  # fmt: skip
    """The scales and zero points of the K step at `start`: [1, BLOCK_N] where it lies in one
    group, else [len(columns), BLOCK_N], each column's group (columns past in_features none)."""
    if ONE_GROUP:
        at = group_rows + start // group_size  # [BLOCK_N]
        s = tl.load(scale_ptr + at, mask=in_n, other=0.0)[None, :]
        z = tl.load(zero_ptr + at, mask=in_n, other=0)[None, :]
    else:
        at = group_rows[None, :] + (columns // group_size)[:, None]
        in_tile = in_n[None, :] & (columns < in_features)[:, None]
        s = tl.load(scale_ptr + at, mask=in_tile, other=0.0)
        z = tl.load(zero_ptr + at, mask=in_tile, other=0)
    return s, z


@triton.jit(do_not_specialize=["rows"])  # a per-step value: one compilation for all row counts
def w4a16_kernel(
    x_ptr, packed_ptr, scale_ptr, zero_ptr, out_ptr, rows, out_features, in_features, x_stride,
    groups, group_size, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ONE_GROUP: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    LANES16: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait(PDL)
    m, n, in_m, in_n, split = program_tile(rows, out_features, BLOCK_M, BLOCK_N)
    first = split * k_per_split
    cols = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    # [BLOCK_M, BLOCK_K]
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * x_stride + first + cols[None, :]
    # [BLOCK_K // 8, BLOCK_N]: the step's words, word j holding columns 8j .. 8j + 7
    word_ptrs = (
        packed_ptr + n[None, :].to(tl.int64) * (in_features // 8) + first // 8 + words[:, None]
    )
    group_rows = n.to(tl.int64) * groups  # [BLOCK_N]: where each output's scales start
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(first, first + k_per_split, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=in_m[:, None], other=0.0)
            packed = tl.load(word_ptrs, mask=in_n[None, :], other=0)
        else:  # one split over the whole input, its last step past in_features
            a = tl.load(
                x_ptrs, mask=in_m[:, None] & (start + cols < in_features)[None, :], other=0.0
            )
            in_k = (start + words * 8 < in_features)[:, None]
            packed = tl.load(word_ptrs, mask=in_k & in_n[None, :], other=0)
        # [BLOCK_K // 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N], row 8j + i from bits 4i of word j (the
        # arithmetic shift of a negative word leaves sign bits above the nibble: masked off)
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        columns = start + cols  # [BLOCK_K]: each row of the step's weight tile
        s, z = step_scales(scale_ptr, zero_ptr, group_rows, in_n, start, columns, in_features,
                           group_size, ONE_GROUP)  # fmt: skip
        w = weights(q, z, s, a.dtype, LANES16)
        # float32 inputs: no TF32 rounding, as F.linear by default
        acc = tl.dot(a, w, acc, input_precision="ieee") if IEEE else tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        word_ptrs += BLOCK_K // 8
    store_tile(out_ptr, acc, rows, out_features, m, n, in_m, in_n, split)


@triton.jit(do_not_specialize=["rows"])
def w4a16_planes_kernel(
    x_ptr, packed_ptr, scale_ptr, zero_ptr, out_ptr, rows, out_features, in_features, x_stride,
    groups, group_size, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ONE_GROUP: tl.constexpr, IEEE: tl.constexpr, LANES16: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """w4a16_kernel's product with each K step taken a bit plane at a time: plane i holds the
    step's words' codes i (columns 8j + i), times the input's columns 8j + i, eight dots of
    BLOCK_K // 8 (16 or more) deep. Each plane is shifts and masks of the words alone, so the
    words reach the tensor cores' operand layout as loaded and are unpacked there (w4a16_kernel's
    reshape makes each code cross shared memory on its own). K steps divide in_features."""
    pdl.wait(PDL)
    m, n, in_m, in_n, split = program_tile(rows, out_features, BLOCK_M, BLOCK_N)
    first = split * k_per_split
    words = tl.arange(0, BLOCK_K // 8)
    # [BLOCK_M, BLOCK_K // 8]: the input's columns 8j of the step (plane i's: 8j + i)
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * x_stride + first + 8 * words[None, :]
    # [BLOCK_K // 8, BLOCK_N]: the step's words, word j holding columns 8j .. 8j + 7
    word_ptrs = (
        packed_ptr + n[None, :].to(tl.int64) * (in_features // 8) + first // 8 + words[:, None]
    )
    group_rows = n.to(tl.int64) * groups  # [BLOCK_N]: where each output's scales start
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(first, first + k_per_split, BLOCK_K):
        packed = tl.load(word_ptrs, mask=in_n[None, :], other=0)
        columns = start + 8 * words  # [BLOCK_K // 8]: each word's first (its 8 share a group)
        s, z = step_scales(scale_ptr, zero_ptr, group_rows, in_n, start, columns, in_features,
                           group_size, ONE_GROUP)  # fmt: skip
        for i in tl.static_range(8):
            a = tl.load(x_ptrs + i, mask=in_m[:, None], other=0.0)
            # (the arithmetic shift of a negative word leaves sign bits above the nibble: masked)
            w = weights((packed >> 4 * i) & 0xF, z, s, a.dtype, LANES16)
            acc = tl.dot(a, w, acc, input_precision="ieee") if IEEE else tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        word_ptrs += BLOCK_K // 8
    store_tile(out_ptr, acc, rows, out_features, m, n, in_m, in_n, split)


@triton.jit(do_not_specialize=["numel"])
def sum_splits_kernel(
    partials_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.wait(PDL)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    acc = tl.zeros((BLOCK,), tl.float32)
    for split in tl.static_range(SPLITS):  # [splits, numel] float32 -> [numel]
        acc += tl.load(
            partials_ptr + (offsets + split * numel.to(tl.int64)), mask=inside, other=0.0
        )
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=inside)


def plan(
    rows: int, out_features: int, in_features: int, group_size: int, device: torch.device
) -> W4Tiles:
    """The tiles of a [rows, in] x int4 [out, in]^T product: SHAPES' by rows, K steps of the
    widest power of two (16 to its block_k) that a group holds, else that `in` holds (scales
    read per column), else 16 (the last step masked). Up to SPLIT_ROWS rows, the most splits
    that divide the K steps and keep at most two programs per SM. Up to PLANES_ROWS rows whose
    SHAPES step is 128, over inputs of whole steps, take planes of 128-feature steps, any
    group."""
    shape = next(tiles for most, tiles in SHAPES if rows <= most)
    planes = rows <= PLANES_ROWS and shape.block_k == 128 and in_features % 128 == 0
    steps = [b for b in (128, 64, 32, 16) if b <= shape.block_k]
    block_k = next((b for b in steps if planes or group_size % b == 0), None)
    block_k = block_k or next((b for b in steps if in_features % b == 0), 16)
    splits = 1
    if rows <= SPLIT_ROWS and in_features % block_k == 0:
        k_steps = in_features // block_k
        tiles = cdiv(rows, shape.block_m) * cdiv(out_features, shape.block_n)
        wanted = max(1, 2 * num_sms(device) // tiles)
        splits = max(s for s in range(1, min(wanted, k_steps) + 1) if k_steps % s == 0)
    return shape._replace(block_k=block_k, splits=splits, planes=planes)


def w4a16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    partials: bool = False,
) -> torch.Tensor:
    """x [rows, in] (bfloat16/float16/float32, contiguous rows) times the int4 weight of `packed`
    int32 [out, in // 8], `scale` [out, in // group_size] and `zero` uint8 [out, in //
    group_size] transposed -> [rows, out] in x's dtype (see `dequantize`). With `partials`, a
    split-K product comes as its float32 partial sums [splits, rows, out], unsummed, for an
    add + RMSNorm that adds them up (`fused.add_rms_norm`; no second launch)."""
    out_features, in_features = _check(packed, scale, zero, group_size)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(
            f"x must be [rows, {in_features}] for packed weights of shape {tuple(packed.shape)}, "
            f"got {tuple(x.shape)} (in_features a multiple of {PACK})"
        )
    if not (x.is_cuda or INTERPRETED):
        return F.linear(x, dequantize(packed, scale, zero, group_size, x.dtype))
    if x.dtype not in KERNEL_DTYPES or x.stride(1) != 1:
        raise ValueError(f"the int4 kernel takes {KERNEL_DTYPES} rows with unit column stride, "
                         f"got {x.dtype} with strides {x.stride()}")  # fmt: skip
    if not (packed.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()):
        raise ValueError("packed, scale and zero must be contiguous")
    rows = x.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)  # [rows, out]
    if rows == 0:
        return out
    tiles = plan(rows, out_features, in_features, group_size, x.device)
    partials_out = out
    if tiles.splits > 1:  # [splits, rows, out] float32
        partials_out = torch.empty(
            tiles.splits, rows, out_features, dtype=torch.float32, device=x.device
        )
    grid = (cdiv(out_features, tiles.block_n), cdiv(rows, tiles.block_m), tiles.splits)
    kernel, even_k = (w4a16_planes_kernel, {}) if tiles.planes else (
        w4a16_kernel, {"EVEN_K": in_features % tiles.block_k == 0})  # fmt: skip
    kernel[grid](
        x, packed, scale, zero, partials_out, rows, out_features, in_features, x.stride(0),
        in_features // group_size, group_size, in_features // tiles.splits,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        ONE_GROUP=group_size % tiles.block_k == 0, IEEE=x.dtype == torch.float32,
        LANES16=LANES16 and x.dtype in (torch.bfloat16, torch.float16) and scale.dtype == x.dtype,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **even_k, **pdl.launch_args(x.device),
    )  # fmt: skip
    if tiles.splits > 1 and partials:
        return partials_out
    if tiles.splits > 1:
        block = 1024
        sum_splits_kernel[(cdiv(out.numel(), block),)](
            partials_out, out, out.numel(), SPLITS=tiles.splits, BLOCK=block,
            **pdl.launch_args(x.device),
        )  # fmt: skip
    return out


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[out, in] weight in `dtype`, w[n, c] = (q[n, c] - zero[n, g]) * scale[n, g] with g = c //
    group_size, computed in float32 (torch ops, any device)."""
    out_features, in_features = _check(packed, scale, zero, group_size)
    groups = in_features // group_size
    q = unpack(packed).view(out_features, groups, group_size).float()
    w = (q - zero.float()[:, :, None]) * scale.float()[:, :, None]  # [out, groups, group_size]
    return w.view(out_features, in_features).to(dtype)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (any integer dtype, values 0..15) -> int32 [out, in // 8], code c of a row
    in bits 4 * (c % 8) of word c // 8. E.g. a row [1, 2, 3, 4, 5, 6, 7, 15] -> [0xF7654321],
    which as int32 is -144358623."""
    if q.dim() != 2 or q.shape[1] % PACK or q.is_floating_point():
        raise ValueError(f"pack takes integer codes [out, in] with in a multiple of {PACK}, "
                         f"got {q.dtype} {tuple(q.shape)}")  # fmt: skip
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError("int4 codes must lie in 0..15")
    out_features, in_features = q.shape
    shifts = torch.arange(0, 4 * PACK, 4, device=q.device, dtype=torch.int64)  # [8]
    words = (q.to(torch.int64).view(out_features, in_features // PACK, PACK) << shifts).sum(-1)
    # 0 .. 2^32 - 1 -> the int32 of the same bits
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [out, in // 8] -> uint8 codes [out, in] (the inverse of `pack`)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed int4 weights are int32 [out, in // {PACK}], "
                         f"got {packed.dtype} {tuple(packed.shape)}")  # fmt: skip
    out_features, words = packed.shape
    shifts = torch.arange(0, 4 * PACK, 4, device=packed.device, dtype=torch.int32)  # [8]
    # arithmetic shifts of a negative word bring in sign bits above the nibble: masked off
    codes = (packed[:, :, None] >> shifts) & 0xF  # [out, in // 8, 8]
    return codes.to(torch.uint8).view(out_features, words * PACK)


def _check(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> tuple[int, int]:
    """(out, in) of a packed int4 weight whose scales and zeros fit it, else ValueError."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed int4 weights are int32 [out, in // {PACK}], "
                         f"got {packed.dtype} {tuple(packed.shape)}")  # fmt: skip
    out_features, in_features = packed.shape[0], packed.shape[1] * PACK
    if group_size <= 0 or group_size % PACK or in_features % group_size:
        raise ValueError(f"group_size must be a multiple of {PACK} that divides in_features "
                         f"{in_features}, got {group_size}")  # fmt: skip
    groups = (out_features, in_features // group_size)
    if tuple(scale.shape) != groups or not scale.is_floating_point():
        raise ValueError(f"scale must be float {groups}, got {scale.dtype} {tuple(scale.shape)}")
    if tuple(zero.shape) != groups or zero.dtype != torch.uint8:
        raise ValueError(f"zero must be uint8 {groups}, got {zero.dtype} {tuple(zero.shape)}")
    return out_features, in_features
