"""Profile decode steps of a workload with torch.profiler and print where device time goes.

Usage: PYTHONPATH=src python benchmarks/profile_step.py [--model llama-3-8b] [--batch 32]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tandem import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()

    llm = LLM(args.model, load_format="dummy", max_model_len=args.input_len + 256, max_num_seqs=args.batch,
              cuda_graphs=args.cuda_graphs)  # fmt: skip
    engine = llm.engine
    prompts = [{"prompt_token_ids": [7 + i] * args.input_len} for i in range(args.batch)]
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=i)
        engine.enqueue(engine.make_request(f"r{i}", params, prompt_token_ids=p["prompt_token_ids"]))
    # every prompt prefilled (in chunks of the token budget), then a few decode steps
    prefill_steps = -(-args.batch * args.input_len // engine.config.max_num_batched_tokens)
    for _ in range(prefill_steps + 3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60
    )
    print(table)


if __name__ == "__main__":
    main()
