"""What the throughput scripts of this folder share: random prompts, timing a run, tracing one
more and writing the report (embed.py, lora.py, prompt_logprobs.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.trace import summarize


def random_prompts(vocab: int, num_prompts: int, length: int) -> list[dict[str, list[int]]]:
    """`num_prompts` prompts of `length` random token ids, the same on every call."""
    g = torch.Generator().manual_seed(0)
    return [
        {"prompt_token_ids": torch.randint(0, vocab, (length,), generator=g).tolist()}
        for _ in range(num_prompts)
    ]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()  # returns once every output was read back
    return time.perf_counter() - start


def traced(llm, fn: Callable[[], Any], meta: dict[str, Any], path: str | None) -> dict:
    """One more timed run of `fn` under the engine's timeline: its seconds and GPU active
    share, its Chrome trace written to `path` when one is given."""
    llm.engine.start_trace()
    seconds = timed(fn)
    trace = llm.engine.stop_trace().to_chrome_trace(meta)
    if path:
        with open(path, "w") as f:
            json.dump(trace, f)
    return {"traced_s": seconds, "gpu_active_pct": summarize(trace)["gpu_active_pct"]}


def publish(report: dict[str, Any], path: str | None) -> dict[str, Any]:
    """Print the report, and write it to `path` when one is given."""
    print(json.dumps(report, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    return report
