"""Embedding throughput (`LLM.embed`) against prefilling the same prompts (max_tokens=1: one
prefill and one sampled token each, which is what an embedding request runs), with the GPU
active share of one more traced embedding run: the pooled rows are gathered on the device and
copied back with the step, so the ratio should stay near 1 and the device busy throughout.

Usage: PYTHONPATH=src python3 benchmarks/embed.py [--model qwen3-0.6b] [--num-prompts 2000]
[--input-len 256] [--repeats 3] [--output-json FILE] [--trace FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tandem import LLM, SamplingParams
from tandem.trace import summarize


def timed(fn) -> float:
    start = time.perf_counter()
    fn()  # returns once every output was read back
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json")
    parser.add_argument("--trace", help="write the traced embedding run's Chrome trace here")
    parser.add_argument("--device", help="default: cuda when available")
    args = parser.parse_args(argv)
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.input_len + 8,
              device=args.device)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(0, vocab, (args.input_len,), generator=g).tolist()}
        for _ in range(args.num_prompts)
    ]
    prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)

    def embed() -> None:
        outputs = llm.embed(prompts, use_tqdm=False)
        assert len(outputs) == len(prompts) and all(o.outputs.embedding for o in outputs)

    def generate() -> None:
        assert len(llm.generate(prompts, prefill, use_tqdm=False)) == len(prompts)

    for fn in (embed, generate):  # warm-up: compiles, allocator
        llm.engine.reset_prefix_cache()
        fn()
    runs: dict[str, list[float]] = {"embed": [], "prefill": []}
    for _ in range(args.repeats):
        for name, fn in (("embed", embed), ("prefill", generate)):
            llm.engine.reset_prefix_cache()  # every run computes every prompt
            runs[name].append(timed(fn))
    llm.engine.reset_prefix_cache()
    llm.engine.start_trace()
    traced_s = timed(embed)
    trace = llm.engine.stop_trace().to_chrome_trace({"mode": "embed", "model": args.model})
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(trace, f)
    embed_s, prefill_s = (statistics.median(runs[k]) for k in ("embed", "prefill"))
    num_tokens = args.num_prompts * args.input_len
    report = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "device": str(llm.engine.device),
        "embed_s": embed_s,
        "prefill_s": prefill_s,
        "ratio": embed_s / prefill_s,
        "embed_prompts_per_s": args.num_prompts / embed_s,
        "embed_tok_per_s": num_tokens / embed_s,
        "traced_s": traced_s,
        "gpu_active_pct": summarize(trace)["gpu_active_pct"],
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
