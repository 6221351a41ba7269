"""`tandem bench throughput`: random-token workloads, sync and async on one engine, medians."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from tandem.llm import LLM
from tandem.sampling import SamplingParams
from tandem.trace import summarize


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


def random_workload(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int
) -> Workload:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)], random token ids."""
    rng = np.random.default_rng(seed)

    def lengths(n: int) -> np.ndarray:
        low, high = max(1, round(n * (1 - range_ratio))), max(1, round(n * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in input_lens]
    return Workload(prompts, output_lens.tolist())


def time_generate(llm: LLM, workload: Workload, temperature: float) -> tuple[float, int]:
    """Wall seconds and engine steps for the whole workload."""
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(workload.output_lens)
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    steps_before = llm.engine.num_steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, "a benchmark run must produce every token"
    return elapsed, llm.engine.num_steps - steps_before


def run_throughput(args: argparse.Namespace, engine_args: dict) -> dict:
    max_len = round(args.input_len * (1 + args.range_ratio)) + round(
        args.output_len * (1 + args.range_ratio)
    )
    if engine_args.get("max_model_len") is None:
        engine_args["max_model_len"] = max_len
    llm = LLM(args.model, **engine_args)
    vocab = llm.engine.model_config.vocab_size
    workload = random_workload(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, args.seed
    )
    warmup = random_workload(min(4, args.num_prompts), 16, 16, 0.0, vocab, args.seed + 1)
    modes = (
        ["sync", "async"]
        if args.compare == "sync"
        else ["async" if llm.engine.async_batching else "sync"]
    )
    results = {}
    for mode in modes:
        llm.engine.async_batching = mode == "async"
        time_generate(llm, warmup, args.temperature)
        runs = [time_generate(llm, workload, args.temperature) for _ in range(args.repeats)]
        elapsed = statistics.median(r[0] for r in runs)
        steps = statistics.median(r[1] for r in runs)
        results[mode] = {
            **(trace_run(llm, workload, args, mode) if args.trace else {}),
            "seconds": elapsed,
            "seconds_all": [r[0] for r in runs],
            "steps": steps,
            "requests_per_s": len(workload.prompts) / elapsed,
            "output_tokens_per_s": workload.num_output_tokens / elapsed,
            "total_tokens_per_s": (workload.num_output_tokens + workload.num_prompt_tokens)
            / elapsed,
            "ms_per_step": 1000 * elapsed / steps,
        }
    report = {
        "workload": {
            "model": args.model,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "temperature": args.temperature,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
        },
        "engine": {k: v for k, v in asdict(llm.engine.config).items()},
        "environment": environment(),
        "results": results,
    }
    if "sync" in results and "async" in results:
        report["async_speedup"] = (
            results["async"]["output_tokens_per_s"] / results["sync"]["output_tokens_per_s"]
        )
    return report


def trace_run(llm: LLM, workload: Workload, args: argparse.Namespace, mode: str) -> dict:
    """One more run with the timeline on; saves the trace and returns its summary."""
    llm.engine.start_trace()
    elapsed, _ = time_generate(llm, workload, args.temperature)
    timeline = llm.engine.stop_trace()
    path = args.trace if args.compare is None else args.trace.replace(".json", f"_{mode}.json")
    trace = timeline.to_chrome_trace({"mode": mode, "model": args.model})
    with open(path, "w") as f:
        json.dump(trace, f)
    return {
        "trace": path,
        "trace_seconds": elapsed,
        "trace_overhead_pct": 100 * timeline.overhead_ns / 1e9 / elapsed,
        "timeline": summarize(trace),
    }


def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def print_report(report: dict) -> None:
    print(
        f"{'mode':6} {'out tok/s':>10} {'req/s':>8} {'ms/step':>8} {'steps':>6} {'seconds':>8} {'GPU active':>10}"
    )
    for mode, r in report["results"].items():
        active = r.get("timeline", {}).get("gpu_active_pct")
        print(
            f"{mode:6} {r['output_tokens_per_s']:10.0f} {r['requests_per_s']:8.2f} "
            f"{r['ms_per_step']:8.2f} {r['steps']:6.0f} {r['seconds']:8.2f} "
            f"{'-' if active is None else f'{active:.2f}%':>10}"
        )
    if "async_speedup" in report:
        print(f"async / sync throughput: {report['async_speedup']:.3f}")


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compare", choices=["sync"], help="also run our sync mode on the same engine"
    )
    parser.add_argument("--output-json")
    parser.add_argument(
        "--trace", help="also record one traced run per mode to this Chrome trace path"
    )


def cmd_bench(args: argparse.Namespace, engine_args: dict) -> None:
    report = run_throughput(args, engine_args)
    print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
