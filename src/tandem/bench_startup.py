"""`tandem bench startup` (vLLM's): how long an engine takes to start, cold and warm.

Each start is `LLM(model, **engine args)` in a process of its own ("spawn"), timed from the
call to its return:
- cold: with empty Triton and Inductor caches (temporary folders), so that every kernel
  compiles;
- warm: with the caches that the warm-up starts before them filled.
Beside the whole, the engine's own split of it (`Engine.startup_seconds`): reading the config,
tokenizer and checkpoint into device memory, then compiling the kernels and capturing the CUDA
graphs. Each is printed as its mean and percentiles, as vLLM's benchmark prints them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import tempfile
import time
from typing import Any

import numpy as np

PERCENTILES = (10, 25, 50, 75, 90, 99)
# what one start reports -> its name in the JSON report (vLLM's "startup"), and as printed
METRICS = {
    "total_startup_time": ("startup", "Startup time"),
    "load_time": ("load", "Load time"),
    "graph_capture_time": ("graph_capture", "Kernel compilation and graph capture time"),
}
# caches that a cold start is given empty, by the variable that moves each
COMPILE_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
START_TIMEOUT_S = 3600.0  # a start that has said nothing by then is taken as hung


def add_startup_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-iters-cold", type=int, default=3, help="starts with empty compile caches"
    )
    parser.add_argument(
        "--num-iters-warmup",
        type=int,
        default=1,
        help="starts that fill the caches before the warm ones, not counted",
    )
    parser.add_argument(
        "--num-iters-warm", type=int, default=3, help="starts with the caches filled"
    )
    parser.add_argument("--output-json", help="write the results to this JSON file")


def cmd_bench_startup(args: argparse.Namespace, engine_args: dict[str, Any]) -> None:
    for name in ("num_iters_cold", "num_iters_warmup", "num_iters_warm"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 0")
    if args.num_iters_cold + args.num_iters_warm == 0:
        raise ValueError("nothing to time: --num-iters-cold and --num-iters-warm are both 0")
    report = {}
    if args.num_iters_cold:
        cold = [start_cold(args.model, engine_args) for _ in range(args.num_iters_cold)]
        report.update(print_phase("cold", "Cold startup", cold))
    for _ in range(args.num_iters_warmup):
        start(args.model, engine_args, {})
    if args.num_iters_warm:
        warm = [start(args.model, engine_args, {}) for _ in range(args.num_iters_warm)]
        report.update(print_phase("warm", "Warm startup", warm))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


def start_cold(model: str, engine_args: dict[str, Any]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="tandem-cold-start-") as folder:
        return start(model, engine_args, {name: f"{folder}/{name}" for name in COMPILE_CACHES})


def start(model: str, engine_args: dict[str, Any], env: dict[str, str]) -> dict[str, float]:
    """One start in a fresh process with `env` set over this one's: its times in seconds.
    ValueError with the child's error if it could not start."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_start_here, args=(model, engine_args, results))
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the child's environment is this one's at its start
    try:
        process.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        outcome = results.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        outcome = f"no answer in {START_TIMEOUT_S:g} s"
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    if isinstance(outcome, str):
        raise ValueError(f"the engine did not start: {outcome}")
    return outcome


def _start_here(model: str, engine_args: dict[str, Any], results: Any) -> None:
    try:
        from tandem.llm import LLM

        started = time.perf_counter()
        llm = LLM(model, **engine_args)
        total = time.perf_counter() - started
        parts = llm.engine.startup_seconds
        results.put({"total_startup_time": total, "load_time": parts["load"],
                     "graph_capture_time": parts["graph_capture"]})  # fmt: skip
    except Exception as error:  # handed to the parent, which raises it
        results.put(f"{type(error).__name__}: {error}")


def print_phase(phase: str, title: str, starts: list[dict[str, float]]) -> dict[str, Any]:
    """Print each metric's mean and percentiles over `starts`; the report's fields."""
    print(f"\n{title} ({len(starts)} starts):")
    report = {}
    for key, (short, name) in METRICS.items():
        values = [s[key] for s in starts]
        percentiles = dict(
            zip(PERCENTILES, np.percentile(values, PERCENTILES).tolist(), strict=True)
        )
        print(f"Avg {name.lower()}: {np.mean(values):.2f} seconds")
        print("  percentiles: " + ", ".join(f"{p}%: {v:.2f}" for p, v in percentiles.items()))
        report[f"avg_{phase}_{short}_time"] = float(np.mean(values))
        report[f"{phase}_{short}_times"] = values
        report[f"{phase}_{short}_percentiles"] = percentiles
    return report
