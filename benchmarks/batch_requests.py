"""Write a benchmark workload as an OpenAI batch file, for `tandem run-batch`.

The requests are `tandem bench throughput`'s for the same arguments (random token prompts, the
same lengths, `ignore_eos`, request i seeded with i), so a run-batch throughput compares with
the bench's. The small workload:
    PYTHONPATH=src python benchmarks/batch_requests.py -o requests.jsonl --model qwen3-0.6b \
        --input-len 562 --output-len 562 --range-ratio 0.822 --num-prompts 256
"""

from __future__ import annotations

import argparse
import json

from tandem.config import ModelConfig
from tandem.model.loader import read_hf_config
from tandem.workload import random_workload


def batch_lines(model: str, prompts: list[list[int]], output_lens: list[int], temperature: float):
    for i, (prompt, max_tokens) in enumerate(zip(prompts, output_lens, strict=True)):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": i,
            "ignore_eos": True,
        }
        yield {
            "custom_id": f"request-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": body,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True, help="the batch file to write (JSONL)")
    parser.add_argument("--model", required=True, help="a preset or model folder (its vocabulary)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="as the bench's --seed")
    args = parser.parse_args()
    vocab_size = ModelConfig.from_hf(read_hf_config(args.model)[0]).vocab_size
    workload = random_workload(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size, args.seed
    )
    lines = batch_lines(args.model, workload.prompts, workload.output_lens, args.temperature)
    with open(args.output, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    print(
        f"{args.output}: {args.num_prompts} requests, {workload.num_prompt_tokens} prompt and "
        f"{workload.num_output_tokens} output tokens, max_model_len needed {workload.max_len}"
    )


if __name__ == "__main__":
    main()
