"""cuBLAS over slices of a weight's output features at a decode step's rows: whether cutting a
product into products of its own (each choosing its own kernel and tiles) evens out the waves
that the whole product's tiles leave part-empty, and which cuBLAS kernel each runs.

For each matrix and row count: F.linear's time, then for each cut (--cuts, the output features
where one slice ends and the next begins; default the halves) the slices' products in turn,
checked against F.linear, timed as one CUDA graph replay on cold weights (`gemm.py`'s
`Rotation`), with each slice's own time after it. --kernels: instead, the name of each CUDA
kernel one call runs (from torch's profiler), whole and in halves; cuBLAS's names carry their
tile shape and cluster.
Usage: PYTHONPATH=src python benchmarks/column_slices.py [--model llama-3-8b] [--rows 256 192 128]
[--matrices gate_up lm_head qkv down] [--cuts 14336 16896/24064] [--kernels]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from gemm import Rotation, matrices, time_us
from torch.profiler import ProfilerActivity, profile

from tandem.config import ModelConfig
from tandem.model.loader import read_hf_config


def parse_cut(text: str) -> tuple[int, ...]:
    """'14336' -> (14336,); '16896/24064' -> (16896, 24064): where each slice ends."""
    return tuple(int(v) for v in text.split("/"))


def sliced(rotation: Rotation, bounds: list[int]):
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        weight = rotation.next()
        return [F.linear(x, weight[a:b]) for a, b in itertools.pairwise(bounds)]

    return fn


def kernel_names(fn, x: torch.Tensor) -> list[str]:
    fn(x)  # cuBLAS's first call of a shape may run set-up kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def timed_cut(rotation: Rotation, x: torch.Tensor, weight: torch.Tensor, bounds: list[int]) -> str:
    """'cut: µs (each slice's µs)' for the slices between `bounds`, checked first."""
    rotation.turn = len(rotation.copies) - 1  # the next copy is `weight` itself
    got = torch.cat(sliced(rotation, bounds)(x), dim=1)
    torch.testing.assert_close(got, F.linear(x, weight), atol=3e-2, rtol=3e-2)
    parts = [
        time_us(lambda x, a=a, b=b: F.linear(x, rotation.next()[a:b]), x)
        for a, b in itertools.pairwise(bounds)
    ]
    us = time_us(sliced(rotation, bounds), x)
    cut = "/".join(map(str, bounds[1:-1]))
    return f"{cut}: {us:.1f} ({' + '.join(f'{p:.1f}' for p in parts)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 192, 128])
    parser.add_argument("--matrices", nargs="+", default=["gate_up", "lm_head", "qkv", "down"])
    parser.add_argument(
        "--cuts", nargs="+", type=parse_cut, help="cuts of every matrix (default: its halves)"
    )
    parser.add_argument("--kernels", action="store_true", help="each call's kernel names only")
    args = parser.parse_args()
    cfg = ModelConfig.from_hf(read_hf_config(args.model)[0])
    for name in args.matrices:
        out_features, in_features = matrices(cfg)[name]
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / 64
        rotation = Rotation(weight)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            label = f"{name} {out_features}x{in_features} M={rows}"
            if args.kernels:
                half = sliced(rotation, [0, out_features // 2, out_features])
                whole = kernel_names(lambda x, r=rotation: F.linear(x, r.next()), x)
                print(f"{label}: whole {whole} | halves {kernel_names(half, x)}", flush=True)
                continue
            cells = [f"whole {time_us(lambda x, r=rotation: F.linear(x, r.next()), x):.1f}"]
            for cut in args.cuts or [(out_features // 2,)]:
                cells.append(timed_cut(rotation, x, weight, [0, *cut, out_features]))
            print(f"{label} µs: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
