"""Profile steps of a workload with torch.profiler and print where device time goes: decode
steps by default, or with --prefill the steps that prefill `batch` prompts of `input-len` tokens
(after one warm-up round of the same prompts, so Triton's compiles are not in the profile). The
CPU total against the CUDA total says whether eager prefill steps are bound by launches.
With --gaps it also prints how much of each step the device sits idle between kernels, and after
which kernels (kernel start and end times from the profiler's trace). With --per-step the host
waits for each profiled step before the next and each step's kernels are summed apart: whether
steps of the same shape take the same kernel time.

Usage: PYTHONPATH=src python benchmarks/profile_step.py [--model llama-3-8b] [--batch 32] [--prefill]
[--quantization fp8] [--kv-cache-dtype fp8] [--n 8]
(--n: each prompt sampled n times, so the decode rows of a prompt share its blocks, as in the
rollout workload)
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tandem import LLM, SamplingParams

STEP_BREAK_US = 50.0  # a longer idle is between steps (the host's turn), not inside one


def kernel_events(events: list[dict]) -> list[dict]:
    """The kernels of a chrome trace's events, by start time."""
    kernels = (e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X")
    return sorted(kernels, key=lambda e: e["ts"])


def kernel_gaps(events: list[dict], top: int = 8) -> str:
    """Chrome-trace events -> a report of the device's idle time between kernels inside steps:
    the kernels' summed time, the time at least one runs (less than the sum where kernels run
    side by side: programmatic dependent launch, two streams), the idle gaps (each shorter than
    STEP_BREAK_US; copies count as idle) and the kernel pairs with the most idle time between
    them (the last kernel to end before the gap, and the next to start)."""
    kernels = kernel_events(events)
    summed = sum(e["dur"] for e in kernels)
    covered = idle = 0.0
    steps = 1 if kernels else 0
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    last = None  # the kernel that ends last so far
    for kernel in kernels:
        end = kernel["ts"] + kernel["dur"]
        if last is None:
            covered += kernel["dur"]
        else:
            last_end = last["ts"] + last["dur"]
            gap = kernel["ts"] - last_end
            covered += max(0.0, end - max(kernel["ts"], last_end))
            if gap >= STEP_BREAK_US:
                steps += 1
            else:
                idle += max(gap, 0.0)
                pairs[(last["name"][:40], kernel["name"][:40])].append(max(gap, 0.0))
        if last is None or end > last["ts"] + last["dur"]:
            last = kernel
    lines = [
        f"{len(kernels)} kernels in {steps} steps: {summed / 1e3:.3f} ms of kernels, "
        f"{covered / 1e3:.3f} ms with one running, {idle / 1e3:.3f} ms idle between kernels "
        f"({100 * idle / max(covered + idle, 1e-9):.1f}% of the steps' span)"
    ]
    ranked = sorted(pairs.items(), key=lambda item: -sum(item[1]))[:top]
    for (before, after), gaps in ranked:
        lines.append(
            f"  {sum(gaps) / 1e3:8.3f} ms  {len(gaps):5d} x {sum(gaps) / len(gaps):5.2f} us  {before} -> {after}"
        )
    return "\n".join(lines)


def kernels_by_step(events: list[dict], top: int = 6) -> str:
    """Chrome-trace events -> one line a step (kernels separated by an idle of STEP_BREAK_US or
    more): its kernel time, kernel count, and its `top` kernel names by summed time."""
    steps: list[list[dict]] = []
    end = None
    for kernel in kernel_events(events):
        if end is None or kernel["ts"] - end >= STEP_BREAK_US:
            steps.append([])
        steps[-1].append(kernel)
        end = max(end or 0.0, kernel["ts"] + kernel["dur"])
    lines = []
    for index, step in enumerate(steps):
        by_name: dict[str, float] = defaultdict(float)
        for kernel in step:
            by_name[kernel["name"][:40]] += kernel["dur"]
        ranked = sorted(by_name.items(), key=lambda item: -item[1])[:top]
        names = ", ".join(f"{name} {us / 1e3:.3f}" for name, us in ranked)
        total = sum(kernel["dur"] for kernel in step)
        lines.append(f"step {index}: {total / 1e3:.3f} ms, {len(step)} kernels; {names}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--gaps", action="store_true", help="idle time between kernels in steps")
    parser.add_argument("--per-step", action="store_true", help="each step's kernels apart")
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (shared prefixes)")
    parser.add_argument("--decode-before", type=int, default=3, help="decode steps not profiled")
    args = parser.parse_args()

    max_tokens = max(200, args.decode_before + args.steps + 8)
    llm = LLM(args.model, load_format="dummy", max_model_len=args.input_len + max_tokens + 56,
              max_num_seqs=args.batch * args.n,
              cuda_graphs=args.cuda_graphs, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    engine = llm.engine
    prefill_steps = -(-args.batch * args.input_len // engine.config.max_num_batched_tokens)

    def enqueue(round_: int, max_tokens: int) -> None:
        for i, k in itertools.product(range(args.batch), range(args.n)):
            seed = i * args.n + k
            params = SamplingParams(
                temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed
            )
            ids = [7 + i] * args.input_len
            engine.enqueue(engine.make_request(f"r{round_}-{seed}", params, prompt_token_ids=ids))

    if args.prefill:
        enqueue(0, 2)  # a warm-up round
        while engine.has_unfinished():
            engine.step()
        engine.reset_prefix_cache()  # or the round below finds its prompts cached
        enqueue(1, 2)
        profiled = prefill_steps
    else:
        enqueue(0, max_tokens)
        # every prompt prefilled (in chunks of the token budget), then a few decode steps
        for _ in range(prefill_steps + args.decode_before):
            engine.step()
        profiled = args.steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            engine.step()
            if args.per_step:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60
    )
    print(table)
    if args.gaps or args.per_step:
        with tempfile.NamedTemporaryFile(suffix=".json") as file:
            prof.export_chrome_trace(file.name)
            with open(file.name) as trace:
                events = json.load(trace)["traceEvents"]
        if args.gaps:
            print(kernel_gaps(events))
        if args.per_step:
            print(kernels_by_step(events))


if __name__ == "__main__":
    main()
