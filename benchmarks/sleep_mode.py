"""Sleep mode on one GPU: device memory each level gives back, and how long wake-up takes
(storages re-allocated, level 1's weights copied back from pinned host memory, the CUDA graphs
captured again), with a greedy generation checked identical before and after.

Usage: PYTHONPATH=src python3 benchmarks/sleep_mode.py [--model llama-3-8b] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem import LLM, SamplingParams
from tandem.model.loader import DUMMY_SEED_SALT, read_hf_config
from tandem.model.tiny import random_weights

GIB = 2**30


def generate(llm: LLM) -> list[list[int]]:
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % vocab for j in range(40)]} for i in range(8)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096)
    engine = llm.engine
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    before = generate(llm)
    print(f"{args.model}: weights {weights / GIB:.2f} GiB, KV cache "
          f"{engine.memory.kv_bytes / GIB:.2f} GiB, {len(engine.runner.graphs)} decode graphs")  # fmt: skip
    for level in (1, 2):
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
            start = time.perf_counter()
            llm.sleep(level)
            slept = time.perf_counter() - start
            asleep = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
            start = time.perf_counter()
            llm.wake_up()
            torch.cuda.synchronize()
            woke = time.perf_counter() - start
            pushed = push_dummy_weights(llm) if level == 2 else 0.0
            print(f"level {level}: freed {(used - asleep) / GIB:.2f} GiB (device use "
                  f"{used / GIB:.2f} -> {asleep / GIB:.2f}), sleep {slept:.2f} s, "
                  f"wake-up {woke:.2f} s" + (f", update_weights {pushed:.2f} s" if pushed else ""))  # fmt: skip
        same = generate(llm) == before
        print(f"level {level}: greedy tokens after wake-up identical: {same}")
        assert same


def push_dummy_weights(llm: LLM) -> float:
    """Level 2 dropped the weights: send the dummy ones again, seconds. They are drawn on the
    GPU (the loader's generator there gives the same numbers), one tensor at a time, and kept
    in host memory: the woken engine's KV cache leaves no room for a second copy of the
    weights on the device, so update_weights copies them host -> device as a trainer on other
    devices would."""
    engine = llm.engine
    hf_config, _ = read_hf_config(engine.config.model)
    seed = engine.config.seed ^ DUMMY_SEED_SALT
    tensors = [
        (name, tensor.to("cpu").pin_memory())
        for name, tensor in random_weights(hf_config, seed, engine.dtype, "cuda")
    ]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.update_weights(tensors)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
