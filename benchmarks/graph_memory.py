"""Device memory held by the decode CUDA graphs, with one shared pool and with a pool per graph.

Usage: PYTHONPATH=src python3 benchmarks/graph_memory.py [--model llama-3-8b] [--max-num-seqs 256]
"""

from __future__ import annotations

import argparse
import gc

import torch

from tandem import LLM
from tandem.runner import graph_batch_sizes


def captured_bytes(runner, shared_pool: bool) -> tuple[int, int]:
    runner.graphs.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    runner.capture_graphs(shared_pool=shared_pool)
    return torch.cuda.memory_reserved() - before, len(runner.graphs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              cuda_graphs=False, gpu_memory_utilization=0.5)  # fmt: skip
    runner = llm.engine.runner
    runner.graph_sizes = graph_batch_sizes(args.max_num_seqs)
    for shared in (True, False):
        used, count = captured_bytes(runner, shared)
        print(
            f"{'shared pool' if shared else 'pool per graph':15} {count} graphs  {used / 2**20:9.1f} MiB"
        )


if __name__ == "__main__":
    main()
