"""Device memory held by the decode CUDA graphs, with one shared pool and with a pool per graph;
then the pieces of steps with prefill (piecewise.py): their graphs, memory and capture time.

Usage: PYTHONPATH=src python3 benchmarks/graph_memory.py [--model llama-3-8b] [--max-num-seqs 256]
[--max-num-batched-tokens 8192]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from tandem import LLM
from tandem.piecewise import PiecewiseGraphs, token_buckets
from tandem.runner import graph_batch_sizes


def captured_bytes(runner, shared_pool: bool) -> tuple[int, int]:
    runner.graphs.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    runner.capture_graphs(shared_pool=shared_pool)
    return torch.cuda.memory_reserved() - before, len(runner.graphs)


def captured_pieces(runner, max_tokens: int) -> tuple[int, int, int, float]:
    """(buffer bytes, pool bytes, graphs, capture seconds) of the pieces alone."""
    runner.graphs.clear()
    runner.graph_sizes = []
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    runner.pieces = PiecewiseGraphs(
        runner.model, runner.kv_caches, runner.attend, max_tokens, runner.device
    )
    runner.token_buckets = token_buckets(max_tokens)
    buffers = torch.cuda.memory_reserved() - before
    start = time.perf_counter()
    runner.capture_graphs()
    seconds = time.perf_counter() - start
    pool = torch.cuda.memory_reserved() - before - buffers
    return buffers, pool, len(runner.pieces.graphs), seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, cuda_graphs=False,
              gpu_memory_utilization=0.5)  # fmt: skip
    runner = llm.engine.runner
    runner.graph_sizes = graph_batch_sizes(args.max_num_seqs)
    for shared in (True, False):
        used, count = captured_bytes(runner, shared)
        print(
            f"{'shared pool' if shared else 'pool per graph':15} {count} graphs  {used / 2**20:9.1f} MiB"
        )
    buffers, pool, count, seconds = captured_pieces(runner, args.max_num_batched_tokens)
    print(
        f"{'pieces':15} {count} graphs  {pool / 2**20:9.1f} MiB pool + {buffers / 2**20:.1f} MiB "
        f"buffers, captured in {seconds:.1f} s ({len(runner.token_buckets)} token buckets)"
    )


if __name__ == "__main__":
    main()
