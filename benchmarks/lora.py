"""LoRA throughput: the same requests run by an engine without adapters, then by one with
`enable_lora` whose requests name no adapter and, in turn, one of `--num-adapters` random
adapters each (round robin, every adapter in every step), with the GPU active share of one more
traced run under adapters. The adapters' slots are step inputs of the same graphs, so the
device should stay busy throughout; their cost is the two small products per projection.

Usage: PYTHONPATH=src python3 benchmarks/lora.py [--model llama-3-8b] [--num-prompts 256]
[--input-len 512] [--output-len 256] [--num-adapters 4] [--rank 16] [--repeats 3]
[--output-json FILE] [--trace FILE]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from pathlib import Path

import torch
from bench_runs import publish, random_prompts, timed, traced  # this folder's

from tandem import LLM, LoRARequest, SamplingParams
from tandem.model.tiny import make_tiny_lora


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json")
    parser.add_argument("--trace", help="write the traced adapter run's Chrome trace here")
    parser.add_argument("--device", help="default: cuda when available")
    args = parser.parse_args(argv)
    engine_args = {
        "load_format": args.load_format,
        "max_model_len": args.input_len + args.output_len,
        "device": args.device,
        "enable_prefix_caching": False,  # every run computes every prompt
    }
    params = SamplingParams(
        max_tokens=args.output_len, temperature=1.0, ignore_eos=True, detokenize=False
    )
    runs: dict[str, list[float]] = {"plain": [], "base": [], "lora": []}

    llm = LLM(args.model, **engine_args)
    prompts = random_prompts(llm.engine.model_config.vocab_size, args.num_prompts, args.input_len)

    def run(loras=None) -> None:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_tokens

    num_tokens = args.num_prompts * args.output_len
    run()  # warm-up: compiles, allocator
    for _ in range(args.repeats):
        runs["plain"].append(timed(run))
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory() as folder:
        paths = [
            make_tiny_lora(Path(folder) / f"adapter-{i}", args.model, args.rank, seed=i)
            for i in range(args.num_adapters)
        ]
        adapters = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters,
                  max_lora_rank=args.rank, **engine_args)  # fmt: skip
        loras = [adapters[i % len(adapters)] for i in range(args.num_prompts)]
        run(loras)  # warm-up, and every adapter read
        for _ in range(args.repeats):
            runs["base"].append(timed(run))
            runs["lora"].append(timed(lambda: run(loras)))
        trace = traced(llm, lambda: run(loras), {"mode": "lora", "model": args.model}, args.trace)
    medians = {name: statistics.median(times) for name, times in runs.items()}
    report = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "device": str(llm.engine.device),
        **{f"{name}_tok_per_s": num_tokens / s for name, s in medians.items()},
        "lora_vs_plain": medians["plain"] / medians["lora"],
        "base_vs_plain": medians["plain"] / medians["base"],
        **trace,
        "runs": runs,
    }
    llm.engine.shutdown()
    return publish(report, args.output_json)


if __name__ == "__main__":
    main()
