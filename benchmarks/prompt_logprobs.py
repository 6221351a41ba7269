"""Scoring throughput: prompts with prompt_logprobs and max_tokens=0 against prefilling the same
tokens without logprobs (max_tokens=1: one prefill, one sampled token, no decode step).

The issue's target: 1,000 requests of 512 tokens with prompt_logprobs=0 on the Llama-3-8B shape
within 1.3x the prefill's time. Also times the fused LM head + log-softmax kernel alone against
the LM head's matmul (cuBLAS) on one step's rows, and `--prompt-logprobs 5` shows the
sub-chunked float32 log-softmax that top-k > 1 takes.

Usage: PYTHONPATH=src python3 benchmarks/prompt_logprobs.py [--model llama-3-8b]
[--num-prompts 1000] [--input-len 512] [--prompt-logprobs 0] [--max-num-batched-tokens 8192]
[--sweep: only the fused kernel's time under other tile shapes]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from bench_runs import publish, random_prompts  # this folder's

from tandem import LLM, SamplingParams, prompt_logprobs_kernel
from tandem.prompt_logprobs_kernel import lm_head_logprobs

# (BLOCK_V, BLOCK_K, MAX_BLOCK_R, NUM_WARPS, NUM_STAGES) for --sweep
SWEEP = [
    (128, 64, 128, 8, 3), (128, 64, 128, 8, 4), (256, 64, 128, 8, 3), (128, 128, 128, 8, 3),
    (128, 64, 64, 4, 4), (256, 64, 64, 8, 4), (128, 32, 128, 4, 5), (64, 64, 128, 4, 4),
]  # fmt: skip


def timed_generate(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)  # returns once all were read back
    seconds = time.perf_counter() - start
    assert len(outputs) == len(prompts)
    return seconds


def kernel_ms(fn, repeats: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def kernel_times(llm: LLM, rows: int) -> dict[str, float]:
    """One step's rows through the fused kernel, and through the LM head matmul alone."""
    model = llm.engine.model
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    vocab, hidden_size = model.cfg.vocab_size, weight.shape[1]
    hidden = torch.randn(rows, hidden_size, device=weight.device, dtype=weight.dtype)
    index = torch.arange(rows, device=weight.device)
    targets = torch.randint(0, vocab, (rows,), device=weight.device)
    values = torch.empty(rows, 2, device=weight.device)
    ids = torch.empty(rows, 1, dtype=torch.int32, device=weight.device)
    ranks = torch.empty(rows, dtype=torch.int32, device=weight.device)
    fused = kernel_ms(
        lambda: lm_head_logprobs(hidden, index, weight, targets, vocab, values, ids, ranks)
    )
    matmul = kernel_ms(lambda: F.linear(hidden, weight))
    flops = 2 * rows * hidden_size * vocab
    return {
        "rows": rows,
        "fused_ms": fused,
        "fused_tflops": flops / fused / 1e9,
        "lm_head_matmul_ms": matmul,
        "lm_head_matmul_tflops": flops / matmul / 1e9,
    }


def sweep(llm: LLM, rows: int) -> list[dict]:
    """The fused kernel's time under each tile shape and launch of SWEEP."""
    results = []
    names = ("BLOCK_V", "BLOCK_K", "MAX_BLOCK_R", "NUM_WARPS", "NUM_STAGES")
    default = [getattr(prompt_logprobs_kernel, name) for name in names]
    try:
        for config in SWEEP:
            for name, value in zip(names, config, strict=True):
                setattr(prompt_logprobs_kernel, name, value)
            try:
                ms = kernel_times(llm, rows)["fused_ms"]
            except Exception as error:  # e.g. out of shared memory
                ms = repr(error)[:80]
            results.append({**dict(zip(names, config, strict=True)), "fused_ms": ms})
    finally:
        for name, value in zip(names, default, strict=True):
            setattr(prompt_logprobs_kernel, name, value)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--prompt-logprobs", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json")
    parser.add_argument("--sweep", action="store_true", help="only time the kernel's configs")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=args.input_len + 16,
              max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    if args.sweep:
        print(json.dumps(sweep(llm, args.max_num_batched_tokens), indent=2))
        return
    prompts = random_prompts(llm.engine.model_config.vocab_size, args.num_prompts, args.input_len)
    prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=args.prompt_logprobs)
    for params in (prefill, scoring):  # warm-up: Triton compiles, allocator
        timed_generate(llm, prompts[:64], params)
    runs: dict[str, list[float]] = {"prefill": [], "scoring": []}
    for _ in range(args.repeats):
        runs["prefill"].append(timed_generate(llm, prompts, prefill))
        runs["scoring"].append(timed_generate(llm, prompts, scoring))
    prefill_s, scoring_s = (statistics.median(runs[k]) for k in ("prefill", "scoring"))
    num_tokens = args.num_prompts * args.input_len
    report = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "prompt_logprobs": args.prompt_logprobs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_s": prefill_s,
        "scoring_s": scoring_s,
        "ratio": scoring_s / prefill_s,
        "target_ratio": 1.3,
        "prefill_tok_per_s": num_tokens / prefill_s,
        "scoring_tok_per_s": num_tokens / scoring_s,
        "runs": runs,
    }
    if torch.cuda.is_available():
        report["kernel"] = kernel_times(llm, args.max_num_batched_tokens)
    publish(report, args.output_json)


if __name__ == "__main__":
    main()
