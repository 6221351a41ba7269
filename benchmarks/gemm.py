"""The step's GEMMs on a CUDA device: how close each weight matrix comes to its roofline.

A decode step reads every weight once for a few rows, so each GEMM is bound by its weight bytes;
a prefill chunk (e.g. --rows 8192) is bound by FLOPs. The % printed is of the roofline: the
weight bytes at the 4.22 TB/s copy ceiling or the FLOPs at 760 TFLOP/s, whichever takes longer.
For each matrix of a model preset and each row count, ways to run it, timed from a CUDA graph
replay as the engine runs them, each call on a cold copy of the weight (`Rotation`):
  linear    F.linear(x, W) with W stored [out, in], what the decoder does by default;
  nn        x @ Wt with the weight stored transposed, [in, out] (cuBLAS picks other kernels);
  lt        F.linear with torch's preferred BLAS library set to cuBLASLt for the call (its own
            heuristics pick the kernel);
  splitk    tandem's split-K kernel (`model/splitk.py`): float32 partial sums over slices of
            the input features, which the engine's residual add + RMSNorm adds up (not timed
            here unless --with-norm); F.linear where its plan declines (more than MAX_ROWS rows).
  blas<s>   (o and down) cuBLAS's batched product over s slices of the input features, float32
            outputs (`splitk.blas_slices`), which the norm adds up as it does split-K's;
  residual  (o and down) what the engine runs for them (`splitk.residual_product`).
  --with-norm times the o and down ways with the residual add + RMSNorm that follows them in
            the engine (which adds up partial sums as it reads them), so every way pays its sum.
  autotune  (--autotune) torch.compile max-autotune of F.linear: Inductor times its Triton
            GEMM templates against cuBLAS and keeps the fastest; slow to compile.
  fp8       (--fp8) the weight in e4m3 with per-channel scales (`quant/linear.py`), W8A8: the
            input quantized per token (one Triton kernel) and torch._scaled_mm;
  fp8splitk (--fp8) the split-K kernel over the e4m3 weight (W8A16, widened in registers).
  fp8dot    (--fp8) the split-K kernel with the input quantized per token too (W8A8: e4m3
            products on the tensor cores), the quantization's launch included: float32 slices,
            as the engine's o and down projections take it up to 64 rows;
  w8a8splitk (--fp8) the same in one split, stored in bf16 (`quant.linear.w8a8_splitk`), as
            the engine's other FP8 projections take it up to 64 rows.
  gemv...   (--fp8, one row) the matrix-vector kernel (`quant/gemv.py`, W8A16, no tensor
            cores) in its default tiles (gemv) and others (gemv<block_n>x<block_k>w<warps>).
  The % of the FP8 ways is of the FP8 roofline: half the weight bytes.
  int4      (--int4) the weight as int4 codes with a bf16 scale and a uint8 zero point per
            INT4_GROUP input columns (`quant/w4a16.py`, W4A16: unpacked in registers), beside
            linear, F.linear over the same weight dequantized to bf16; int4f32: the kernel
            turning codes into weights in float32 rather than in 16-bit lanes (`w4a16.LANES16`);
            int4planes: K steps a bit plane at a time, up to 32 rows (`w4a16.PLANES_ROWS`).
            The % of each is of the int4 roofline: the packed codes, scales and zeros, and the bf16 input and output rows.
  invariant (--deterministic) deterministic mode's GEMM (`batch_invariant.invariant_tiles`: the
            tiles and K slices of the weight's shape, slices kept for o and down), beside
            F.linear and three variants of its tiles: 4 stages, 64-wide, 64-feature K steps.
Usage: PYTHONPATH=src python benchmarks/gemm.py [--model llama-3-8b] [--rows 1 8 32] [--autotune]
[--fp8 | --int4] [--deterministic] [--with-norm] [--matrices o down]
[--sweep-splitk [--sweep-matrices o down]] [--sweep-w8a8]  (--sweep-w8a8, alone: each layer
matrix's W8A8 split-K product under each tile shape; --sweep-splitk: those matrices under each split-K
tile shape, warp count and split count, after the table; * marks the plan's pick; where the plan
declines, its row tiles)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.testing

from tandem.batch_invariant import invariant_tiles
from tandem.config import ModelConfig, next_power_of_2
from tandem.model.fused import add_rms_norm
from tandem.model.loader import read_hf_config
from tandem.model.splitk import (
    SplitTiles,
    blas_slices,
    linear_partials,
    plan,
    residual_product,
)
from tandem.quant import w4a16
from tandem.quant.fp8 import quantize_rows, quantize_tokens
from tandem.quant.gemv import MAX_ROWS as GEMV_ROWS
from tandem.quant.gemv import GemvTiles, fp8_gemv
from tandem.quant.linear import w8a8_linear, w8a8_splitk
from tandem.quant.w4a16 import dequantize, pack, w4a16_linear
from tandem.roofline import H200
from tandem.runner import preferred_blas

COPY_CEILING = H200.bandwidth  # bytes/s, device-to-device copy, read + write (DESIGN.md)
GEMM_PEAK = H200.flops  # bf16 FLOP/s, an 8192^3 GEMM (DESIGN.md)
# the kernels' ways: (`w4a16.LANES16`, `w4a16.PLANES_ROWS`): whole K steps, or bit planes up
# to 32 rows (the most the planes kernel's tiles take)
INT4_WAYS = {"int4": (True, 0), "int4f32": (False, 0), "int4planes": (True, 32)}
INT4_GROUP = 128  # input columns per int4 scale and zero point, as GPTQ and AWQ checkpoints


def matrices(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Name -> (out, in) of each matrix a decode step reads, as the decoder stacks them."""
    h = cfg.hidden_size
    return {
        "qkv": (cfg.q_size + 2 * cfg.kv_size, h),
        "o": (h, cfg.q_size),
        "gate_up": (2 * cfg.intermediate_size, h),
        "down": (h, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, h),
    }


class Rotation:
    """Copies of one weight handed out in turn, enough that together they are 4x the L2: each
    call then reads its matrix from device memory, as in a decode step, where every matrix was
    evicted by the layers before it. (A graph of back-to-back calls on one 32 MB matrix reads
    it mostly from the 50 MB L2.)"""

    def __init__(self, weight: torch.Tensor):
        l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
        count = max(1, triton.cdiv(4 * l2, weight.numel() * weight.element_size()))
        self.copies = [weight] + [weight.clone() for _ in range(count - 1)]
        self.transposed = [w.t().contiguous() for w in self.copies]
        self.turn = 0

    def next(self, transposed: bool = False) -> torch.Tensor:
        self.turn = (self.turn + 1) % len(self.copies)
        return (self.transposed if transposed else self.copies)[self.turn]


def with_cublaslt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear with cuBLASLt as torch's preferred BLAS library (a graph captures the kernel it
    picked), as the engine's graphs under TANDEM_BLAS=cublaslt."""
    with preferred_blas("cublaslt"):
        return F.linear(x, weight)


def variants(
    weight: torch.Tensor,
    autotune: bool,
    fp8: bool = False,
    invariant_residual: bool | None = None,
    residual: bool = False,
    int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> dict:
    """way -> function of the input batch (`invariant_residual`: deterministic mode's ways,
    True for the o and down matrices; `residual`: the o and down matrices' own ways too; `int4`:
    (packed, scale, zero) of the weight, F.linear and the W4A16 kernel only)."""
    rotation = Rotation(weight)
    if int4 is not None:
        packed, scale, zero = int4
        int4_rotation = Rotation(packed)  # scales and zeros (5% of the codes' bytes) shared

        def unpacked(lanes: bool, planes_rows: int):
            def product(x: torch.Tensor) -> torch.Tensor:
                w4a16.LANES16, w4a16.PLANES_ROWS = lanes, planes_rows  # the kernels' switches
                try:
                    return w4a16_linear(x, int4_rotation.next(), scale, zero, INT4_GROUP)
                finally:
                    w4a16.LANES16, w4a16.PLANES_ROWS = default

            return product

        default = w4a16.LANES16, w4a16.PLANES_ROWS
        return {"linear": lambda x: F.linear(x, rotation.next())} | {
            name: unpacked(*way) for name, way in INT4_WAYS.items()
        }
    if invariant_residual is not None:
        tiles = invariant_tiles(*weight.shape, weight.device, invariant_residual)
        shapes = {
            "invariant": tiles,
            "stages4": tiles._replace(num_stages=4),
            "wide": tiles._replace(block_n=64),
            "k64": tiles._replace(block_k=64) if tiles.block_k == 128 else None,
        }
        return {"linear": lambda x: F.linear(x, rotation.next())} | {
            way: lambda x, t=t: linear_partials(x, rotation.next(), tiles=t)
            for way, t in shapes.items()
            if t is not None
        }
    if fp8:
        weight_fp8, scale = quantize_rows(weight)
        fp8_rotation = Rotation(weight_fp8)
        return {
            "fp8": lambda x: w8a8_linear(x, fp8_rotation.next(), scale),
            "fp8splitk": lambda x: linear_partials(
                x, fp8_rotation.next(), weight_scale=scale, fallback=lambda x: None
            ),
            "fp8dot": lambda x: fp8_dot(x, fp8_rotation.next(), scale),
            "w8a8splitk": lambda x: w8a8_splitk(x, fp8_rotation.next(), scale),
        } | {
            name: lambda x, t=tiles: (
                fp8_gemv(x, fp8_rotation.next(), scale, t) if x.shape[0] <= GEMV_ROWS else None
            )
            for name, tiles in GEMV_SHAPES.items()
        }
    ways = {
        "linear": lambda x: F.linear(x, rotation.next()),
        "nn": lambda x: x @ rotation.next(transposed=True),
        "lt": lambda x: with_cublaslt(x, rotation.next()),
        "splitk": lambda x: linear_partials(x, rotation.next()),
    }
    if residual:

        def residual(x: torch.Tensor) -> torch.Tensor:
            w = rotation.next()  # cuBLAS over the same copy where the engine falls back
            return residual_product(x, w, lambda x: F.linear(x, w))

        ways["residual"] = residual
        ways |= {
            f"blas{s}": lambda x, s=s: blas_slices(x, rotation.next(), s)
            for s in (2, 4, 8)
            if weight.shape[1] % (64 * s) == 0
        }
    if autotune:
        compiled = torch.compile(
            lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False
        )
        ways["autotune"] = lambda x: compiled(x, rotation.next())
    return ways


def with_norm(fn, rows: int, hidden: int):
    """fn followed by the residual add + RMSNorm the engine runs on its output."""
    residual = torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    return lambda x: add_rms_norm(fn(x), residual, weight, 1e-6)


def fp8_dot(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """W8A8 in the split-K kernel: x quantized per token, e4m3 products (None where its plan
    declines)."""
    x_fp8, x_scale = quantize_tokens(x)
    return linear_partials(
        x_fp8, weight, weight_scale=scale, fallback=lambda x: None, x_scale=x_scale
    )


GEMV_SHAPES = {"gemv": GemvTiles()} | {
    f"gemv{t.block_n}x{t.block_k}w{t.num_warps}": t
    for t in (
        GemvTiles(8, 512, 4),
        GemvTiles(16, 512, 4),
        GemvTiles(2, 2048, 4),
        GemvTiles(8, 1024, 8),
    )
}


def random_int4(
    out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int32 [out, in // 8], bf16 scales and uint8 zeros [out, in // INT4_GROUP]) of
    random codes, weights about 1/sqrt(in) in size."""
    groups = in_features // INT4_GROUP
    codes = torch.randint(0, 16, (out_features, in_features), device="cuda", dtype=torch.uint8)
    zero = torch.randint(0, 16, (out_features, groups), device="cuda", dtype=torch.uint8)
    scale = (0.5 + torch.rand(out_features, groups, device="cuda")) / (4 * in_features**0.5)
    return pack(codes), scale.to(torch.bfloat16), zero


def int4_bytes(out_features: int, in_features: int, rows: int) -> int:
    """Bytes a W4A16 product moves: half a byte per code, a bf16 scale and a uint8 zero per
    group, the bf16 input and output rows."""
    groups = out_features * in_features // INT4_GROUP
    return out_features * in_features // 2 + 3 * groups + 2 * rows * (in_features + out_features)


def fp8_view(t: torch.Tensor) -> torch.Tensor:
    """t's rows quantized to e4m3 with a scale each and read back in float32."""
    q, scale = quantize_rows(t)
    return q.float() * scale


def time_us(fn, x) -> float:
    torch.cuda.synchronize()  # the timing runs on a side stream
    return 1000 * triton.testing.do_bench_cudagraph(lambda: fn(x), return_mode="median")


def sweep_splitk(cfg: ModelConfig, rows_list: list[int], names: list[str]) -> None:
    """µs per call of the named matrices, cold, under each output tile width, pipeline depth,
    warp count and split count the input allows."""
    for name in names:
        out_features, in_features = matrices(cfg)[name]
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
        rotation = Rotation(weight)
        for rows in rows_list:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            pick = plan(rows, out_features, in_features, x.device)
            # where the plan declines, the engine takes F.linear (the table above): 64-row
            # tiles against it
            block_k = next(b for b in (128, 64, 32, 16) if in_features % b == 0)
            base = pick or SplitTiles(max(16, min(64, next_power_of_2(rows))), 64, block_k, 1)
            k_steps = in_features // base.block_k
            for block_n, num_stages, num_warps in itertools.product((32, 64, 128), (3, 4), (4, 8)):
                if num_warps == 8 and block_n == 32:
                    continue
                cells = []
                for splits in [s for s in (1, 2, 3, 4, 6, 8, 12, 16) if k_steps % s == 0]:
                    tiles = SplitTiles(
                        base.block_m, block_n, base.block_k, splits, num_warps, num_stages
                    )
                    us = time_us(
                        lambda x, t=tiles, r=rotation: linear_partials(x, r.next(), tiles=t), x
                    )
                    cells.append(f"{splits}{'*' if tiles == pick else ''}:{us:.1f}")
                print(f"splitk {name:7} M={rows:<4} block_n={block_n:<3} stages={num_stages} "
                      f"warps={num_warps} us by splits  " + "  ".join(cells), flush=True)  # fmt: skip
        del weight, rotation


def sweep_w8a8(cfg: ModelConfig, rows_list: list[int]) -> None:
    """µs per call of each layer matrix's W8A8 split-K product (`quant.linear.w8a8_splitk`'s
    kernel, the input already in e4m3: the quantization's launch not counted) under each output
    tile width, input step, pipeline depth and warp count; o and down also in 2 and 4 float32
    slices (the norm adds them up). The % is of the FP8 weight bytes at the copy ceiling (the
    engine's tiles: `--fp8`'s w8a8splitk way, whose time counts the quantization too)."""
    for name in ("qkv", "o", "gate_up", "down"):
        out_features, in_features = matrices(cfg)[name]
        weight, scale = quantize_rows(
            torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
        )
        rotation = Rotation(weight)
        floor_us = 1e6 * weight.numel() / COPY_CEILING
        for rows in rows_list:
            x_fp8, x_scale = quantize_tokens(
                torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            )
            split_counts = (1, 2, 4) if name in ("o", "down") else (1,)
            shapes = itertools.product((16, 32, 64), (128, 256), (3, 4), (4, 8))
            for block_n, block_k, num_stages, num_warps in shapes:
                if in_features % block_k or (num_warps == 8 and block_n < 64):
                    continue
                cells = []
                for splits in split_counts:
                    if (in_features // block_k) % splits:
                        continue
                    tiles = SplitTiles(
                        max(16, next_power_of_2(rows)), block_n, block_k, splits, num_warps,
                        num_stages,
                    )  # fmt: skip
                    out_dtype = torch.bfloat16 if splits == 1 else None
                    try:
                        us = time_us(
                            lambda x, t=tiles, d=out_dtype, r=rotation, w=scale, s=x_scale: (
                                linear_partials(x, r.next(), t, weight_scale=w, x_scale=s,
                                                out_dtype=d)
                            ),
                            x_fp8,
                        )  # fmt: skip
                    except triton.runtime.errors.OutOfResources:
                        continue
                    cells.append(f"{splits}:{us:.1f} ({100 * floor_us / us:.0f}%)")
                print(f"w8a8 {name:7} M={rows:<3} block_n={block_n:<2} block_k={block_k} "
                      f"stages={num_stages} warps={num_warps} us by splits  "
                      + "  ".join(cells), flush=True)  # fmt: skip
        del weight, rotation


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--autotune", action="store_true")
    weight_format = parser.add_mutually_exclusive_group()
    weight_format.add_argument("--fp8", action="store_true", help="the FP8 ways instead")
    weight_format.add_argument(
        "--int4", action="store_true", help="F.linear and the W4A16 kernel, int4 roofline"
    )
    parser.add_argument("--deterministic", action="store_true", help="deterministic mode's ways")
    parser.add_argument("--json")
    parser.add_argument("--sweep-splitk", action="store_true")
    parser.add_argument("--sweep-matrices", nargs="+", default=["o", "down"])
    parser.add_argument("--sweep-w8a8", action="store_true", help="only this sweep")
    parser.add_argument("--with-norm", action="store_true", help="o and down with their norm")
    parser.add_argument("--matrices", nargs="+", help="these matrices only")
    args = parser.parse_args()
    cfg = ModelConfig.from_hf(read_hf_config(args.model)[0])
    if args.sweep_w8a8:
        sweep_w8a8(cfg, args.rows)
        return
    results = []
    for name, (out_features, in_features) in matrices(cfg).items():
        if args.matrices and name not in args.matrices:
            continue
        int4 = random_int4(out_features, in_features) if args.int4 else None
        if int4 is None:
            weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
        else:  # the int4 weight in bf16: both ways compute the same product
            weight = dequantize(*int4, INT4_GROUP, torch.bfloat16)
        weight_bytes = weight.numel() * (1 if args.fp8 else weight.element_size())
        for rows in args.rows:
            if int4 is not None:
                weight_bytes = int4_bytes(out_features, in_features, rows)
            to_norm = name in ("o", "down")
            invariant = to_norm if args.deterministic else None
            ways = variants(
                weight, args.autotune, args.fp8, invariant, to_norm and not args.fp8, int4
            )
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            expected = {way: F.linear(x, weight).float() for way in ways}
            if args.fp8:  # the operands as each FP8 way sees them: e4m3 read back
                expected["fp8"] = F.linear(fp8_view(x), fp8_view(weight))  # W8A8
                expected["fp8dot"] = expected["w8a8splitk"] = expected["fp8"]
                expected["fp8splitk"] = F.linear(x.float(), fp8_view(weight))  # W8A16
                expected |= {name: expected["fp8splitk"] for name in GEMV_SHAPES}
            cells = []
            for way, fn in ways.items():
                out = fn(x)
                if out is None:  # FP8 split-K's plan declines (the engine then runs W8A8)
                    continue
                out = out.sum(0) if out.dim() == 3 else out  # split-K partial sums
                # bf16 outputs of float32 sums, against float32 references
                torch.testing.assert_close(out.float(), expected[way], atol=0.5, rtol=2e-2)
                if args.with_norm and to_norm:  # the norm after it, adding partials up
                    fn = with_norm(fn, rows, out_features)
                us = time_us(fn, x)
                rate = weight_bytes / (us / 1e6)
                flops = 2 * rows * out_features * in_features
                roofline_us = 1e6 * max(weight_bytes / COPY_CEILING, flops / GEMM_PEAK)
                results.append({"matrix": name, "rows": rows, "way": way, "us": us,
                                "TB/s": rate / 1e12, "ceiling_pct": 100 * rate / COPY_CEILING,
                                "TFLOP/s": flops / us / 1e6, "roofline_pct": 100 * roofline_us / us})  # fmt: skip
                cells.append(f"{way} {us:7.1f} us {100 * roofline_us / us:5.1f}%")
            print(f"{name:8} {out_features:>6}x{in_features:<6} M={rows:<4} " + "  ".join(cells),
                  flush=True)  # fmt: skip
        del weight, int4
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "results": results}, f, indent=1)
    if args.sweep_splitk:
        sweep_splitk(cfg, args.rows, args.sweep_matrices)


if __name__ == "__main__":
    main()
