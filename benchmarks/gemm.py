"""The decode step's GEMMs on a CUDA device: how close each weight matrix comes to the copy ceiling.

A decode step reads every weight once for a few rows, so each GEMM is bound by its weight bytes.
For each matrix of a model preset and each row count, three ways to run it, timed from a CUDA
graph replay as the engine runs them:
  linear    F.linear(x, W) with W stored [out, in], what the decoder does;
  nn        x @ Wt with the weight stored transposed, [in, out] (cuBLAS picks other kernels);
  autotune  (--autotune) torch.compile max-autotune of F.linear: Inductor times its Triton
            GEMM templates against cuBLAS and keeps the fastest; slow to compile.
Usage: PYTHONPATH=src python benchmarks/gemm.py [--model llama-3-8b] [--rows 1 32 256] [--autotune]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from tandem.config import ModelConfig
from tandem.model.loader import read_hf_config

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


def variants(weight: torch.Tensor, autotune: bool) -> dict:
    transposed = weight.t().contiguous()
    ways = {
        "linear": lambda x: F.linear(x, weight),
        "nn": lambda x: x @ transposed,
    }
    if autotune:
        ways["autotune"] = torch.compile(
            lambda x: F.linear(x, weight), mode="max-autotune-no-cudagraphs", dynamic=False
        )
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
        ways = variants(weight, args.autotune)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x, weight).float()
            cells = []
            for way, fn in ways.items():
                torch.testing.assert_close(fn(x).float(), expected, atol=0.5, rtol=2e-2)
                torch.cuda.synchronize()  # the timing runs on a side stream
                us = 1000 * triton.testing.do_bench_cudagraph(
                    lambda fn=fn, x=x: fn(x), return_mode="median"
                )
                rate = weight_bytes / (us / 1e6)
                results.append({"matrix": name, "rows": rows, "way": way, "us": us,
                                "TB/s": rate / 1e12, "ceiling_pct": 100 * rate / COPY_CEILING})  # fmt: skip
                cells.append(f"{way} {us:7.1f} us {100 * rate / COPY_CEILING:5.1f}%")
            print(f"{name:8} {out_features:>6}x{in_features:<6} M={rows:<4} " + "  ".join(cells),
                  flush=True)  # fmt: skip
        del weight, ways
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
