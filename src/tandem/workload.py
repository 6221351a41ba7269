"""Benchmark workloads: token-id prompts and output lengths, random or from a ShareGPT JSON file."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHAREGPT_SAMPLE = Path(__file__).parent / "data" / "sharegpt_sample.json"


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def max_len(self) -> int:
        """Longest prompt plus its output: the max_model_len the workload needs."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab: int,
    seed: int,
    shared_prefix_len: int = 0,
    n: int = 1,
) -> Workload:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)], random token ids.

    Every prompt starts with the same `shared_prefix_len` random tokens (a system prompt) before
    its own `input_len`, and is asked `n` times in a row (samples of one prompt, as `n` does).
    """
    rng = np.random.default_rng(seed)

    def lengths(count: int) -> np.ndarray:
        low = max(1, round(count * (1 - range_ratio)))
        high = max(1, round(count * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    prefix = rng.integers(0, vocab, size=shared_prefix_len).tolist()
    prompts = [prefix + rng.integers(0, vocab, size=k).tolist() for k in input_lens]
    return Workload(
        [p for p in prompts for _ in range(n)], [k for k in output_lens.tolist() for _ in range(n)]
    )


def sharegpt_workload(
    path: str | Path,
    num_prompts: int,
    encode: Callable[[str, bool], list[int]],
    output_len: int | None,
    max_len: int,
    seed: int,
) -> Workload:
    """First human turn as the prompt, output length from the gpt turn after it (or `output_len`).

    `encode(text, add_special_tokens)` is the model's tokenizer. Conversations are shuffled with
    `seed`; ones longer than `max_len` tokens are skipped; with fewer than `num_prompts` left,
    they repeat.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    pairs = []
    for entry in data:
        turns = (entry.get("conversations") or []) if isinstance(entry, dict) else []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            prompt = encode(turns[0]["value"], True)
            num_out = output_len or max(1, len(encode(turns[1]["value"], False)))
            if prompt and len(prompt) + num_out <= max_len:
                pairs.append((prompt, num_out))
    if not pairs:
        raise ValueError(
            f"{path} has no conversation starting with a human turn then a gpt turn that fits in "
            f"{max_len} tokens"
        )
    order = np.random.default_rng(seed).permutation(len(pairs))
    chosen = [pairs[i] for i in itertools.islice(itertools.cycle(order), num_prompts)]
    return Workload([p for p, _ in chosen], [n for _, n in chosen])


# the benchmarks' flags of sizes (tandem bench, tandem bench serve)
def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, else the flag's error says so."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        return number

    return parse


def fraction(value: str) -> float:
    """An argparse type: a --range-ratio, a number in [0, 1) as vLLM's."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {number}")
    return number
