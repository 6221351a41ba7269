"""Embedding throughput (`LLM.embed`) against prefilling the same prompts (max_tokens=1: one
prefill and one sampled token each, which is what an embedding request runs), with the GPU
active share of one more traced embedding run: the pooled rows are gathered on the device and
copied back with the step, so the ratio should stay near 1 and the device busy throughout.

Usage: PYTHONPATH=src python3 benchmarks/embed.py [--model qwen3-0.6b] [--num-prompts 2000]
[--input-len 256] [--repeats 3] [--output-json FILE] [--trace FILE]
"""

from __future__ import annotations

import argparse
import statistics

from bench_runs import publish, random_prompts, timed, traced  # this folder's

from tandem import LLM, SamplingParams


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
    prompts = random_prompts(llm.engine.model_config.vocab_size, args.num_prompts, args.input_len)
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
    trace = traced(llm, embed, {"mode": "embed", "model": args.model}, args.trace)
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
        **trace,
        "runs": runs,
    }
    return publish(report, args.output_json)


if __name__ == "__main__":
    main()
