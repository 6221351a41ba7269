"""The fused MoE kernel's grouped GEMMs at Qwen3-30B-A3B's decode shapes, under each tile shape.

Each shape is timed graph-replayed over `--layers` layers' expert weights in turn, so the
weights come from memory as in a step (not from the L2), and reported as µs per layer and the
routed experts' weight bytes per second against the copy ceiling. Each tile shape is checked
against `fused_experts_torch` first.
Usage: PYTHONPATH=src python benchmarks/moe.py [--tokens 32 1] [--layers 8]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tandem.model import fused_moe
from tandem.model.fused_moe import (
    MoeTiles,
    align_by_expert,
    block_m_for,
    fused_experts,
    fused_experts_torch,
    grouped_gemm,
)
from tandem.roofline import H200

COPY_CEILING = H200.bandwidth
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
TILES = [
    MoeTiles(block_n, block_k, warps, stages)
    for block_n in (32, 64, 128)
    for block_k in (64, 128, 256)
    for warps, stages in ((4, 3), (4, 4))
] + [
    MoeTiles(64, 128, 8, 3),
    MoeTiles(128, 128, 8, 3),
    MoeTiles(64, 256, 4, 2),
    MoeTiles(32, 128, 4, 5),
    MoeTiles(64, 64, 4, 5),
    MoeTiles(16, 128, 4, 4),
]


def sweep(tokens: int, layers: int) -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = [
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=g).bfloat16() * 0.02
        for _ in range(layers)
    ]
    w2 = [
        torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=g).bfloat16() * 0.02
        for _ in range(layers)
    ]
    scores = torch.rand(tokens, EXPERTS, device=dev, generator=g)
    weights, ids = scores.topk(TOP_K, dim=1)
    weights, ids = (weights / weights.sum(1, keepdim=True)).float(), ids.int()
    num_pairs = tokens * TOP_K
    block_m = block_m_for(num_pairs, EXPERTS)
    blocks = align_by_expert(ids, EXPERTS, block_m)
    experts_hit = ids.unique().numel()
    gate_up_bytes = experts_hit * 2 * INTER * HIDDEN * 2
    down_bytes = experts_hit * HIDDEN * INTER * 2
    act = torch.randn(num_pairs, INTER, device=dev, dtype=torch.bfloat16, generator=g)
    flat = weights.flatten().contiguous()
    expected = fused_experts_torch(x, w13[0], w2[0], weights, ids)
    print(f"tokens={tokens} block_m={block_m} experts hit={experts_hit} "
          f"({(gate_up_bytes + down_bytes) / 1e6:.0f} MB a layer)", flush=True)  # fmt: skip
    default = fused_moe.TILES
    for tiles in [default, *(t for t in TILES if t != default)]:
        fused_moe.TILES = tiles
        try:
            got = fused_experts(x, w13[0], w2[0], weights, ids)
            torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
            torch.cuda.synchronize()

            def gate_up() -> None:
                for w in w13:
                    grouped_gemm(x, w, blocks, block_m, num_pairs, TOP_K, None, silu_and_mul=True)

            def down() -> None:
                for w in w2:
                    grouped_gemm(act, w, blocks, block_m, num_pairs, TOP_K, flat)

            times = [
                triton.testing.do_bench_cudagraph(f, return_mode="median") / layers
                for f in (gate_up, down)
            ]
        except Exception as error:  # out of shared memory, or a wrong result
            print(f"{tiles}  failed: {str(error).splitlines()[0][:80]}", flush=True)
            continue
        cells = [
            f"{name} {1000 * ms:.1f} us ({nbytes / (ms / 1e3) / 1e12:.2f} TB/s)"
            for name, ms, nbytes in zip(
                ("gate_up", "down"), times, (gate_up_bytes, down_bytes), strict=True
            )
        ]
        total = 1000 * sum(times)
        mark = "*" if tiles == default else " "
        print(f"{tuple(tiles)}{mark} {total:.1f} us  " + "  ".join(cells), flush=True)
    fused_moe.TILES = default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    print(f"copy ceiling {COPY_CEILING / 1e12:.2f} TB/s")
    for tokens in args.tokens:
        sweep(tokens, args.layers)


if __name__ == "__main__":
    main()
