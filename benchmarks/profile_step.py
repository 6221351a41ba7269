"""Profile steps of a workload with torch.profiler and print where device time goes: decode
steps by default, or with --prefill the steps that prefill `batch` prompts of `input-len` tokens
(after one warm-up round of the same prompts, so Triton's compiles are not in the profile). The
CPU total against the CUDA total says whether eager prefill steps are bound by launches.

Usage: PYTHONPATH=src python benchmarks/profile_step.py [--model llama-3-8b] [--batch 32] [--prefill]
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
    parser.add_argument("--prefill", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.model, load_format="dummy", max_model_len=args.input_len + 256, max_num_seqs=args.batch,
              cuda_graphs=args.cuda_graphs)  # fmt: skip
    engine = llm.engine
    prefill_steps = -(-args.batch * args.input_len // engine.config.max_num_batched_tokens)

    def enqueue(round_: int, max_tokens: int) -> None:
        for i in range(args.batch):
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
            ids = [7 + i] * args.input_len
            engine.enqueue(engine.make_request(f"r{round_}-{i}", params, prompt_token_ids=ids))

    if args.prefill:
        enqueue(0, 2)  # a warm-up round
        while engine.has_unfinished():
            engine.step()
        enqueue(1, 2)
        profiled = prefill_steps
    else:
        enqueue(0, 200)
        # every prompt prefilled (in chunks of the token budget), then a few decode steps
        for _ in range(prefill_steps + 3):
            engine.step()
        profiled = args.steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60
    )
    print(table)


if __name__ == "__main__":
    main()
