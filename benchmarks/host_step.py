"""Host time of one eager step with prefill on the CUDA code path, measured on the CPU: the
decoder, the fused ops' wrappers, the attention backend and the sampler run as on CUDA, but every
Triton launch is a no-op and the matrices are tiny, so what is timed is tandem's own Python and
torch's dispatch (plus small CPU matmuls), not Triton's launcher or the driver.

Steps with prefill run eagerly, and on a slow host they are bound by their launches
(BENCHMARKS.md, tenth run): this is the part of that host time that tandem's code decides.
Usage: PYTHONPATH=src python benchmarks/host_step.py [--model qwen3-0.6b] [--decodes 240]
[--prompts 16 16] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import itertools
import pstats
import statistics
import time

import torch

import tandem.sampling_kernel
from tandem.attention import AttentionMetadata, triton_backend
from tandem.attention.triton_backend import TritonAttention
from tandem.config import ModelConfig
from tandem.model import fused, splitk
from tandem.model.decoder import Decoder
from tandem.model.loader import read_hf_config
from tandem.sampling import SamplingTensors, sample

KERNELS = {
    fused: ["add_rms_norm_kernel", "silu_and_mul_kernel", "rope_qk_kernel"],
    splitk: ["partials_kernel"],
    triton_backend: ["decode_kernel", "prefill_kernel", "reduce_kernel"],
    tandem.sampling_kernel: ["gumbel_argmax_kernel", "pick_best_chunk_kernel"],
}


class NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def take_the_cuda_path() -> None:
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, NoLaunch())
    fused.use_kernels = lambda x: True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--decodes", type=int, default=240, help="running requests' rows")
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 16])
    parser.add_argument("--context", type=int, default=600, help="the decodes' context length")
    parser.add_argument("--profile", action="store_true", help="then cProfile's top functions")
    args = parser.parse_args()
    take_the_cuda_path()
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(read_hf_config(args.model)[0])
    # the real layer and head counts; tiny matrices, so CPU matmuls take little of the time
    cfg = dataclasses.replace(
        cfg, hidden_size=32, intermediate_size=64, vocab_size=512, head_dim=16
    )
    model = Decoder(cfg, 4096).eval()
    cpu = torch.device("cpu")
    num_seqs = args.decodes + len(args.prompts)
    attend = TritonAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, num_seqs, cpu)
    seq_lens = [args.context] * args.decodes + args.prompts
    starts = [0, *itertools.accumulate([1] * args.decodes + args.prompts)]
    num_tokens, block_size = starts[-1], 16
    blocks_per_seq = -(-max(seq_lens) // block_size)
    kv_caches = [
        torch.zeros(2, 1, block_size, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(num_seqs, blocks_per_seq, dtype=torch.int32),
        decode_only=False,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
        seq_order=torch.arange(args.decodes, dtype=torch.int32),
    )
    ids = positions = torch.zeros(num_tokens, dtype=torch.long)
    last_rows = torch.tensor(starts[1:]) - 1
    ones = torch.ones(num_seqs)
    params = SamplingTensors(ones, ones.int(), ones, ones * 0, ones.int(), ones.int())

    @torch.inference_mode()
    def step() -> None:
        hidden = model(ids, positions, kv_caches, meta, attend)
        sample(model.compute_logits(hidden[last_rows]), params, use_filters=False)

    for _ in range(5):
        step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(40):
            step()
        times.append((time.perf_counter() - start) / 40 * 1e3)
    print(
        f"{args.model} shape, {cfg.num_layers} layers, {args.decodes} decodes + prompts "
        f"{args.prompts}: {min(times):.2f} ms per step (min of 7), median {statistics.median(times):.2f}"
    )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(20)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
