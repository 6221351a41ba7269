"""The decode step's GEMMs on a CUDA device: how close each weight matrix comes to the copy ceiling.

A decode step reads every weight once for a few rows, so each GEMM is bound by its weight bytes.
For each matrix of a model preset and each row count, ways to run it, timed from a CUDA graph
replay as the engine runs them, each call on a cold copy of the weight (`Rotation`):
  linear    F.linear(x, W) with W stored [out, in], what the decoder does by default;
  nn        x @ Wt with the weight stored transposed, [in, out] (cuBLAS picks other kernels);
  gemv      (rows <= 256) the engine's Triton kernel (tandem/model/gemv.py): each program
            streams a band of weight rows over the whole input, no split-K; autotuned;
  unfused / fused   (rows <= 256; qkv and gate_up: residual add + RMSNorm before the matmul,
            down: SiLU * up) the separate kernel plus F.linear, against gemv with the op folded in;
  autotune  (--autotune) torch.compile max-autotune of F.linear: Inductor times its Triton
            GEMM templates against cuBLAS and keeps the fastest; slow to compile.
Usage: PYTHONPATH=src python benchmarks/gemm.py [--model llama-3-8b] [--rows 1 32 256] [--autotune]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.testing

from tandem.config import ModelConfig
from tandem.model import fused, gemv
from tandem.model.loader import read_hf_config

gemv.ENABLED = True  # the kernel whatever TANDEM_DECODE_GEMV says

COPY_CEILING = 4.22e12  # bytes/s, device-to-device copy (DESIGN.md)


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


PROLOGUES = {"qkv": "norm", "gate_up": "norm", "down": "silu"}


def variants(name: str, weight: torch.Tensor, rows: int, autotune: bool) -> dict:
    """way -> (function of the input batch, whether it applies the matrix's prologue)."""
    rotation = Rotation(weight)
    ways = {
        "linear": (lambda x: F.linear(x, rotation.next()), False),
        "nn": (lambda x: x @ rotation.next(transposed=True), False),
    }
    if rows <= gemv.MAX_ROWS:
        ways["gemv"] = (lambda x: gemv.linear(x, rotation.next()), False)
        prologue = PROLOGUES.get(name)
        if prologue == "norm":
            norm = torch.ones(weight.shape[1], device="cuda", dtype=weight.dtype)
            ways["unfused"] = (
                lambda x: F.linear(fused.add_rms_norm(x, x, norm, 1e-5)[0], rotation.next()),
                True,
            )
            ways["fused"] = (lambda x: gemv.norm_linear(x, x, norm, 1e-5, rotation.next())[0], True)
        elif prologue == "silu":
            ways["unfused"] = (lambda x: F.linear(fused.silu_and_mul(x), rotation.next()), True)
            ways["fused"] = (lambda x: gemv.silu_linear(x, rotation.next()), True)
    if autotune:
        compiled = torch.compile(
            lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False
        )
        ways["autotune"] = (lambda x: compiled(x, rotation.next()), False)
    return ways


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    cfg = ModelConfig.from_hf(read_hf_config(args.model)[0])
    results = []
    for name, (out_features, in_features) in matrices(cfg).items():
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
        weight_bytes = weight.numel() * weight.element_size()
        for rows in args.rows:
            ways = variants(name, weight, rows, args.autotune)
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            # the input before the prologue: the summand of x + x, or gate | up
            pre = (
                x / 2
                if PROLOGUES.get(name) == "norm"
                else torch.randn(rows, 2 * in_features, device="cuda", dtype=torch.bfloat16)
            )
            expected = {False: F.linear(x, weight).float()}
            if "unfused" in ways:
                expected[True] = ways["unfused"][0](pre).float()
            cells = []
            for way, (fn, with_prologue) in ways.items():
                arg = pre if with_prologue else x
                torch.testing.assert_close(fn(arg).float(), expected[with_prologue], atol=0.5,
                                           rtol=2e-2)  # fmt: skip
                torch.cuda.synchronize()  # the timing runs on a side stream
                us = 1000 * triton.testing.do_bench_cudagraph(
                    lambda fn=fn, arg=arg: fn(arg), return_mode="median"
                )
                rate = weight_bytes / (us / 1e6)
                results.append({"matrix": name, "rows": rows, "way": way, "us": us,
                                "TB/s": rate / 1e12, "ceiling_pct": 100 * rate / COPY_CEILING})  # fmt: skip
                cells.append(f"{way} {us:7.1f} us {100 * rate / COPY_CEILING:5.1f}%")
            print(f"{name:8} {out_features:>6}x{in_features:<6} M={rows:<4} " + "  ".join(cells),
                  flush=True)  # fmt: skip
        del weight
    if args.json:
        with open(args.json, "w") as f:
            # the tile shape the autotuner kept for each (n, k, row bucket, prologue, ...) key
            chosen = {str(key): str(config) for key, config in gemv._tuned.cache.items()}
            json.dump({"model": args.model, "results": results, "gemv_configs": chosen}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
