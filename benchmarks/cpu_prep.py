"""CPU time to prepare one decode step of many requests: schedule, build, and process its outputs.

DESIGN.md asks for a 256-request decode batch prepared well under 1 ms, so that a small model's
short GPU step stays the bottleneck. Runs anywhere (the tiny model on CPU is enough: these phases
do not touch the device); the median of each phase comes from the engine's own timeline.
Usage: PYTHONPATH=src python benchmarks/cpu_prep.py [--model DIR] [--requests 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

from tandem import LLM, SamplingParams
from tandem.model.tiny import make_tiny_model
from tandem.trace import intervals

PHASES = ("schedule", "build", "process")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a model folder (default: a tiny Llama made here)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=200)
    args = parser.parse_args()
    model = args.model or make_tiny_model(tempfile.mkdtemp(), "llama", seed=0)
    llm = LLM(str(model), max_num_seqs=args.requests, max_model_len=args.prompt_len + 800,
              num_blocks=args.requests * (args.prompt_len + 800) // 16 + 1, block_size=16)  # fmt: skip
    engine = llm.engine
    for i in range(args.requests):
        params = SamplingParams(temperature=1.0, max_tokens=800, ignore_eos=True, seed=i)
        prompt = [5 + i % 50] * args.prompt_len
        engine.enqueue(engine.make_request(f"r{i}", params, prompt_token_ids=prompt))
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # every prompt prefilled: what follows is decode only
    engine.start_trace()
    for _ in range(args.steps):
        engine.step()
    cpu, _ = intervals(engine.stop_trace().to_chrome_trace({}))
    medians = {p: float(np.median(cpu[p][:, 1] - cpu[p][:, 0])) for p in PHASES}
    cells = "  ".join(f"{p} {us:6.1f} us" for p, us in medians.items())
    print(f"{args.requests} decode requests, median per step: {cells}  "
          f"(schedule + build {medians['schedule'] + medians['build']:.1f} us)")  # fmt: skip


if __name__ == "__main__":
    main()
