"""rollout's or chat's requests timed through `LLM.generate`, as a user calls it.

`tandem bench` times the engine after its requests are made; here each run's time includes
making them (checking the prompts, matching them in the prefix cache), as a user's script
times it. One JSON line a run: {"workload", "run", "s", "tokens", "tok_s"}. A warm-up of a
few short requests comes first; each run draws new prompts (chat: a new shared head), so no
run finds the one before it in the prefix cache.

    python3 benchmarks/through_generate.py chat --runs 3        # Llama-3-8B's shape, dummy weights
    python3 benchmarks/through_generate.py rollout --runs 2
    python3 benchmarks/through_generate.py rollout --logprobs 0   # each sampled token's logprob, as RL asks
    python3 benchmarks/through_generate.py rollout --logprobs 0 --flat-logprobs
"""

from __future__ import annotations

import argparse
import json
import time

from tandem import LLM, SamplingParams
from tandem.workload import random_workload

# name -> (prompts, shared head, unique tokens, samples a prompt, new tokens), as tandem bench
WORKLOADS = {
    "rollout": (32, 0, 1024, 8, 512),
    "chat": (256, 2048, 128, 1, 256),
}


def prompts(count: int, shared: int, unique: int, vocab: int, seed: int) -> list[dict]:
    """`tandem bench`'s random prompts, each once (the engine makes its samples)."""
    workload = random_workload(count, unique, 1, 0.0, vocab, seed, shared_prefix_len=shared)
    return [{"prompt_token_ids": p} for p in workload.prompts]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="prompts, lengths and new tokens times this (a CPU check: 0.05)")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--logprobs", type=int, default=None,
                        help="SamplingParams.logprobs of every request (0: the sampled token's)")  # fmt: skip
    parser.add_argument("--flat-logprobs", action="store_true",
                        help="the logprobs as one FlatLogprobs a sample (SamplingParams.flat_logprobs)")  # fmt: skip
    args = parser.parse_args(argv)
    count, shared, unique, n, new = WORKLOADS[args.workload]
    count, shared, unique, new = (  # the samples a prompt stay as they are
        max(1, round(x * args.scale)) if x else 0 for x in (count, shared, unique, new)
    )
    llm = LLM(model=args.model, load_format=args.load_format, max_num_seqs=args.max_num_seqs)
    vocab = llm.engine.model_config.vocab_size
    warm = SamplingParams(n=min(n, 2), temperature=1.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts(2, shared, unique, vocab, seed=0), warm, use_tqdm=False)
    params = SamplingParams(
        n=n, temperature=1.0, max_tokens=new, ignore_eos=True, logprobs=args.logprobs,
        flat_logprobs=args.flat_logprobs,
    )  # fmt: skip
    results = []
    for run in range(args.runs):
        batch = prompts(count, shared, unique, vocab, seed=run + 1)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        made = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        result = {"workload": args.workload, "run": run, "s": round(seconds, 3),
                  "tokens": made, "tok_s": round(made / seconds)}  # fmt: skip
        if args.logprobs is not None:  # every position's entry came back
            result["logprob_entries"] = sum(len(c.logprobs) for o in outputs for c in o.outputs)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
