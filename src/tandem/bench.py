"""`tandem bench throughput|latency`: workloads on one engine, medians, roofline, transformers alongside."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.metadata
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import triton

from tandem import envs, hub, pdl, piecewise, runner
from tandem.config import PREEMPTION_MODES, EngineConfig, ModelConfig
from tandem.engine import Engine
from tandem.llm import LLM
from tandem.model import fused, splitk
from tandem.model.loader import read_hf_config
from tandem.profiler import Timeline
from tandem.roofline import H200, Hardware, ModelCost, on_devices, roofline_summary, step_rooflines
from tandem.sampling import SamplingParams
from tandem.structured import StructuredOutputsParams
from tandem.tokenizer import Tokenizer
from tandem.trace import idle_before, step_spans, summarize
from tandem.workload import (
    SHAREGPT_SAMPLE,
    Workload,
    at_least,
    fraction,
    random_workload,
    sharegpt_workload,
)

DEFAULT_OUTPUT_LEN = 128
DEFAULT_NUM_PROMPTS = 32
LATENCY_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class Run:
    """One timed pass over a workload."""

    seconds: float
    steps: int
    latencies: dict[str, list[float]] | None = None  # LATENCY_KEYS -> seconds, latency mode
    # tokens each request produced: its max_tokens, or fewer where its grammar ended it
    output_lens: list[int] | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def waves(num_requests: int, batch_size: int | None) -> list[range]:
    """Requests submitted together, each wave once the previous one finished; None: all at once."""
    size = batch_size or num_requests
    return [range(i, min(i + size, num_requests)) for i in range(0, num_requests, size)]


def request_latencies(
    arrivals: list[float], token_times: list[list[float]]
) -> dict[str, list[float]]:
    """Per request TTFT, TPOT and end-to-end seconds; ITL: every gap between two tokens."""
    return {
        "ttft": [times[0] - t for t, times in zip(arrivals, token_times, strict=True)],
        "tpot": [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times if len(ts) > 1],
        "itl": np.concatenate([np.diff(ts) for ts in token_times]).tolist(),
        "e2e": [times[-1] - t for t, times in zip(arrivals, token_times, strict=True)],
    }


def percentiles_ms(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = 1000 * np.asarray(seconds)
    p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
    return {"mean": float(ms.mean()), "p50": p50, "p90": p90, "p99": p99}


def time_engine(
    engine: Engine,
    workload: Workload,
    temperature: float,
    batch_size: int | None = None,
    record_tokens: bool = False,
    fields: dict | None = None,
    structured: StructuredOutputsParams | None = None,
) -> Run:
    """Submit `workload` in waves of `batch_size` and step until every token is out.

    With `record_tokens`, each token is stamped when `step` hands it back on the host;
    `fields` are SamplingParams fields every request gets (presence_penalty, logprobs, ...),
    and `structured` its constraint: then a request ends where its grammar does, or at max_tokens.
    """
    requests = [
        engine.make_request(
            f"bench-{i}",
            SamplingParams(
                temperature=temperature,
                max_tokens=n,
                ignore_eos=True,
                seed=i,
                structured_outputs=structured,
                **(fields or {}),
            ),
            prompt_token_ids=prompt,
        )
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))
    ]
    index_of = {r.request_id: i for i, r in enumerate(requests)}
    arrivals = [0.0] * len(requests)
    token_times: list[list[float]] = [[] for _ in requests]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    steps_before = engine.num_steps
    start = time.perf_counter()
    for wave in waves(len(requests), batch_size):
        for i in wave:
            arrivals[i] = time.perf_counter()
            engine.enqueue(requests[i])
        while engine.has_unfinished():
            updated = engine.step()
            if record_tokens:
                now = time.perf_counter()
                for request in updated:
                    token_times[index_of[request.request_id]].append(now)
    elapsed = time.perf_counter() - start
    lens = [len(r.output_token_ids) for r in requests]
    if structured is None:
        assert lens == workload.output_lens, "a benchmark run must produce every token"
    else:  # the grammar ends a request early, as its stop token: never later
        assert all(n <= limit for n, limit in zip(lens, workload.output_lens, strict=True))
        assert all(r.finish_reason in ("stop", "length") for r in requests)
    latencies = request_latencies(arrivals, token_times) if record_tokens else None
    return Run(elapsed, engine.num_steps - steps_before, latencies, lens)


def time_generate(
    llm: LLM,
    workload: Workload,
    temperature: float,
    fields: dict | None = None,
    structured: StructuredOutputsParams | None = None,
) -> tuple[float, int]:
    """Wall seconds and engine steps for the whole workload submitted at once."""
    run = time_engine(llm.engine, workload, temperature, fields=fields, structured=structured)
    return run.seconds, run.steps


def load_workload(args: argparse.Namespace, cfg: ModelConfig, folder: Path | None) -> Workload:
    num_prompts = num_prompts_of(args)
    if args.dataset == "random":
        output_len = args.output_len or DEFAULT_OUTPUT_LEN
        return random_workload(
            num_prompts,
            args.input_len,
            output_len,
            args.range_ratio,
            cfg.vocab_size,
            args.seed,
            args.shared_prefix_len,
            args.n,
        )
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise ValueError(
            "--dataset sharegpt tokenizes with the model's tokenizer.json; give a model folder "
            "that has one (a preset has none), or use --dataset random"
        )
    return sharegpt_workload(
        args.dataset_path or SHAREGPT_SAMPLE,
        num_prompts,
        Tokenizer.from_dir(folder).encode,
        args.output_len,
        args.max_model_len or cfg.max_position_embeddings,
        args.seed,
    )


def num_prompts_of(args: argparse.Namespace) -> int:
    if args.num_prompts is not None:
        return args.num_prompts
    return args.batch_size if args.mode == "latency" else DEFAULT_NUM_PROMPTS


def summarize_runs(runs: list[Run], workload: Workload) -> dict:
    """Medians over the runs; latency percentiles over every request of every run."""
    elapsed = statistics.median(r.seconds for r in runs)
    steps = statistics.median(r.steps for r in runs)
    produced = statistics.median(r.output_tokens for r in runs)  # seeded: the same every run
    result = {
        "seconds": elapsed,
        "seconds_all": [r.seconds for r in runs],
        "steps": steps,
        "output_tokens": produced,
        "requests_per_s": len(workload.prompts) / elapsed,
        "output_tokens_per_s": produced / elapsed,
        "total_tokens_per_s": (produced + workload.num_prompt_tokens) / elapsed,
        "ms_per_step": 1000 * elapsed / steps if steps else None,
    }
    if runs[0].latencies is not None:
        for key in LATENCY_KEYS:
            pooled = [x for r in runs for x in r.latencies[key]]
            result[f"{key}_ms"] = percentiles_ms(pooled)
    return result


def warmup_workload(workload: Workload, step_tokens: int) -> Workload:
    """The warm-up run: the workload's first prompts, as many as fill one step of `step_tokens`
    prompt tokens (at least four), with at most 16 output tokens each. The widest prefill steps'
    first-call costs (library heuristics, allocator growth) fall in it, not in the first timed run."""
    filled = itertools.accumulate(map(len, workload.prompts))
    count = next((i + 1 for i, total in enumerate(filled) if total >= step_tokens), None)
    count = max(4, count or len(workload.prompts))
    return Workload(workload.prompts[:count], [min(16, n) for n in workload.output_lens[:count]])


def allocator_retries(device: torch.device) -> int:
    """How often torch's CUDA allocator found no free memory, emptied its cache (a device-wide
    sync) and retried; 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


@contextlib.contextmanager
def counting_jit_compiles() -> Iterator[list[int]]:
    """Counts, in the one-item list it yields, the Triton kernels compiled (or loaded from
    Triton's disk cache) inside the block: a kernel first met with new constants or argument
    classes. A timed run should have none."""
    count, previous = [0], triton.knobs.runtime.jit_cache_hook

    def hook(**kwargs):
        count[0] += 1
        return previous(**kwargs) if previous else None

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield count
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def run_bench(
    args: argparse.Namespace, engine_args: dict, save: Callable[[dict], None] | None = None
) -> dict:
    """The workload on our engine (and the comparisons asked for); `save` gets the report after
    each finished part."""
    hf_config, folder = read_hf_config(
        args.model,
        hub.Source(engine_args.get("revision"), engine_args.get("download_dir")),
        weights=engine_args.get("load_format") != "dummy",
        overrides=engine_args.get("hf_overrides"),
    )
    cfg = ModelConfig.from_hf(hf_config)
    workload = load_workload(args, cfg, folder)
    if engine_args.get("max_model_len") is None:
        engine_args["max_model_len"] = workload.max_len
    llm = LLM(args.model, **engine_args)
    engine = llm.engine
    warmup = warmup_workload(workload, engine.config.max_num_batched_tokens)
    compare = set(args.compare or ())
    primary, other = ("async", "sync") if engine.async_batching else ("sync", "async")
    modes = [primary, other] if "sync" in compare else [primary]
    caching = engine.scheduler.cache.enabled
    if "no-prefix-caching" in compare and caching:
        modes.append(f"{primary} no-cache")
    preemption = engine.config.preemption_mode  # other preemption modes: on the same engine
    modes += [f"{primary} {m}" for m in PREEMPTION_MODES if m in compare and m != preemption]
    structured = structured_of(args)
    constrained_lens: list[int] = []  # per request, as the last constrained run ended them
    if structured is not None and "unconstrained" in compare:
        modes.append(f"{primary} unconstrained")  # at the lengths the constraint ended at
    batch_size = args.batch_size if args.mode == "latency" else None
    results, rooflines = {}, {}
    hardware = on_devices(H200, engine.config.tensor_parallel_size)
    sizes = engine.byte_sizes()  # FP8 weights and KV cache: their bytes, not the dtype's
    cost = ModelCost.of(cfg, engine.dtype.itemsize, **sizes)
    for mode in modes:
        engine.async_batching = mode.startswith("async")
        engine.scheduler.cache.enabled = caching and not mode.endswith("no-cache")
        swap = engine.scheduler.swap
        swap.mode = next((m for m in PREEMPTION_MODES if mode.endswith(m)), preemption)
        constraint = None if mode.endswith("unconstrained") else structured
        if constraint is None and structured is not None:  # the constrained run's token counts
            workload = Workload(workload.prompts, constrained_lens)
        time_engine(engine, warmup, args.temperature, fields=request_fields_of(args),
                    structured=constraint)  # fmt: skip
        retries = allocator_retries(engine.device)
        preempted, swapped = engine.scheduler.num_preemptions, swap.num_swapped_out
        runs = []
        cache = engine.scheduler.cache
        queried, hit = cache.num_queried_tokens, cache.num_hit_tokens
        timed_trace = args.trace and args.trace_timed  # the last timed run records it
        with counting_jit_compiles() as compiles:
            for i in range(args.repeats):
                engine.reset_prefix_cache()  # each run starts cold: no hits from the last one
                engine.step_work = []
                if timed_trace and i == args.repeats - 1:
                    engine.start_trace()
                runs.append(
                    time_engine(
                        engine,
                        workload,
                        args.temperature,
                        batch_size,
                        args.mode == "latency",
                        request_fields_of(args),
                        constraint,
                    )
                )
        constrained_lens = runs[-1].output_lens if constraint is not None else constrained_lens
        rooflines[mode] = roofline_summary(
            cfg, engine.dtype.itemsize, np.array(engine.step_work), hardware, **sizes
        )
        engine.step_work = None
        results[mode] = {
            **summarize_runs(runs, workload),
            "roofline_seconds": rooflines[mode]["seconds"],
            "allocator_retries": allocator_retries(engine.device) - retries,
            "jit_compiles": compiles[0],
            "prefix_cache_hit_rate": (cache.num_hit_tokens - hit)
            / max(1, cache.num_queried_tokens - queried),
            "preemptions_per_run": (engine.scheduler.num_preemptions - preempted) / args.repeats,
            "swapped_per_run": (swap.num_swapped_out - swapped) / args.repeats,
        }
        # saved before the traced run: a failure in it or in a later mode keeps these timings
        report = report_so_far(args, workload, batch_size, engine, rooflines[primary], results)
        finish(report, rooflines[primary], save)
        if args.trace:
            traced = (
                save_trace(engine.stop_trace(), runs[-1].seconds, args, mode, cost, hardware)
                if timed_trace
                else trace_run(llm, workload, args, mode, cost, hardware, constraint)
            )
            results[mode] = {**traced, **results[mode]}
    report = report_so_far(args, workload, batch_size, engine, rooflines[primary], results)
    llm.shutdown()  # tensor-parallel workers
    theirs, skipped = transformers_modes(compare, engine.device.type == "cuda")
    if theirs or skipped:
        report["transformers"] = {"configs": {}, "skipped": skipped}
    finish(report, rooflines[primary], save)
    if theirs:
        device, dtype, config = engine.device, engine.dtype, engine.config
        del llm, engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for name, result, resolved in compare_transformers(
            args, hf_config, folder, device, dtype, config, workload, warmup, batch_size, theirs
        ):
            results[name] = result
            report["transformers"]["configs"][name] = resolved
            print(
                f"{name}: {result['output_tokens_per_s']:.0f} output tok/s, "
                f"{result['seconds']:.2f} s, {result['steps']:.0f} steps",
                flush=True,
            )
            finish(report, rooflines[primary], save)
    return report


def transformers_modes(compare: set[str], cuda: bool) -> tuple[list[bool], dict[str, str]]:
    """transformers' modes to run, as `async_batching` values, async first (the mode the targets
    compare with and the faster one, so a comparison stopped early still has it), and the ones
    asked for that cannot run here, with why."""
    both = "transformers" in compare
    asked = [
        async_batching
        for async_batching, name in ((True, "transformers-async"), (False, "transformers-sync"))
        if both or name in compare
    ]
    if cuda or True not in asked:
        return asked, {}
    sync_only = [async_batching for async_batching in asked if not async_batching]
    return sync_only, {"transformers_async": "transformers' async batching needs CUDA"}


def report_so_far(
    args: argparse.Namespace,
    workload: Workload,
    batch_size: int | None,
    engine: Engine,
    roofline: dict,
    results: dict,
) -> dict:
    """The report of the modes run so far (the device's copy rate measured once a process)."""
    return {
        "mode": args.mode,
        "workload": workload_info(args, workload, batch_size),
        "engine": engine_info(engine),
        "environment": {**environment(), "copy_tb_per_s": device_copy_rate(engine.device)},
        "roofline": roofline,
        "results": results,
    }


@functools.cache
def device_copy_rate(device: torch.device) -> float | None:
    return copy_tb_per_s(device)


def finish(report: dict, roofline: dict, save: Callable[[dict], None] | None) -> None:
    """Roofline shares and ratios of the results so far; then `save` the report as it stands, so
    a long comparison stopped midway keeps what finished."""
    results = report["results"]
    for result in results.values():
        result["roofline_fraction"] = roofline["seconds"] / result["seconds"]
    report["ratios"] = throughput_ratios(results)
    if "sync" in results and "async" in results:
        report["async_speedup"] = report["ratios"]["async/sync"]
    if save is not None:
        save(report)


def compare_transformers(
    args: argparse.Namespace,
    hf_config: dict,
    folder: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    config: EngineConfig,
    workload: Workload,
    warmup: Workload,
    batch_size: int | None,
    modes: list[bool],
) -> Iterator[tuple[str, dict, dict]]:
    """transformers' continuous batching in each of `modes` (`async_batching` values) on the same
    weights and requests: its name, summarized runs and resolved config, one mode at a time."""
    from tandem.bench_transformers import best_attention, build_hf_model, run_transformers

    attention = best_attention(device)
    model = build_hf_model(hf_config, folder, dtype, device, config.seed, attention)
    for async_batching in modes:
        runs, resolved = run_transformers(
            model,
            workload,
            warmup,
            async_batching=async_batching,
            temperature=args.temperature,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            batch_size=batch_size,
            record_tokens=args.mode == "latency",
            repeats=args.repeats,
            seed=config.seed,
        )
        yield (
            f"transformers_{'async' if async_batching else 'sync'}",
            summarize_runs(runs, workload),
            resolved,
        )


def throughput_ratios(results: dict) -> dict[str, float]:
    """Output tokens/s of each of our modes over each other result's."""
    ours = [m for m in ("async", "sync") if m in results]
    return {
        f"{mine}/{other}": results[mine]["output_tokens_per_s"]
        / results[other]["output_tokens_per_s"]
        for mine in ours
        for other in results
        if other != mine and not (mine == "sync" and other == "async")
    }


def structured_of(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """--json-schema FILE: the constraint every request gets (no whitespace between tokens, so
    random weights cannot spin on it)."""
    if not getattr(args, "json_schema", None):
        return None
    schema = json.loads(Path(args.json_schema).read_text())
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def request_fields_of(args: argparse.Namespace) -> dict:
    """The SamplingParams fields every request gets: --presence/--frequency/--repetition-penalty
    and --logprobs."""
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")
    return {name: getattr(args, name) for name in names}


def workload_info(args: argparse.Namespace, workload: Workload, batch_size: int | None) -> dict:
    return {
        "model": args.model,
        "dataset": args.dataset,
        "dataset_path": str(args.dataset_path or SHAREGPT_SAMPLE)
        if args.dataset == "sharegpt"
        else None,
        "num_prompts": len(workload.prompts),
        "input_len": args.input_len if args.dataset == "random" else None,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio if args.dataset == "random" else None,
        "shared_prefix_len": args.shared_prefix_len if args.dataset == "random" else None,
        "n": args.n if args.dataset == "random" else None,
        "batch_size": batch_size,
        "temperature": args.temperature,
        **request_fields_of(args),
        "json_schema": getattr(args, "json_schema", None),
        "repeats": args.repeats,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "max_len": workload.max_len,
    }


def engine_info(engine: Engine) -> dict:
    """The EngineConfig as given, plus what it resolved to on this machine."""
    return {
        **asdict(engine.config),
        "resolved": {
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
            **engine.byte_sizes(),
            "attention_backend": engine.attention_backend,
            "max_model_len": engine.max_model_len,
            "num_blocks": engine.num_blocks,
            "cuda_graph_sizes": list(engine.runner.graph_sizes),
        },
    }


def roofline_by_step_kind(trace: dict, cost: ModelCost, hardware: Hardware) -> dict:
    """GPU compute time against the roofline of the same steps, for decode steps and for steps
    with prefill apart: which kind of step the time above the roofline goes to. With the host's
    launch time of those steps and the compute stream's idle time before them: a step whose
    launch takes as long as its compute, with idle time before it, waited for the host."""
    steps, work, launch, compute = step_spans(trace)
    compute_us = compute[:, 1] - compute[:, 0]
    idle_us = idle_before(steps, compute)
    seconds = step_rooflines(cost, work, hardware)[0]
    decode = work[:, 0] == work[:, 1]  # one token per sequence
    kinds = {}
    for kind, rows in (("decode", decode), ("with_prefill", ~decode)):
        gpu_ms, roofline_ms = compute_us[rows].sum() / 1e3, seconds[rows].sum() * 1e3
        kinds[kind] = {
            "steps": int(rows.sum()),
            "gpu_ms": float(gpu_ms),
            "roofline_ms": float(roofline_ms),
            "roofline_fraction": float(roofline_ms / gpu_ms) if gpu_ms else None,
            "launch_ms": float((launch[rows, 1] - launch[rows, 0]).sum() / 1e3),
            "idle_before_ms": float(idle_us[rows].sum() / 1e3),
        }
    return kinds


def trace_run(
    llm: LLM,
    workload: Workload,
    args: argparse.Namespace,
    mode: str,
    cost: ModelCost,
    hardware: Hardware,
    structured: StructuredOutputsParams | None = None,
) -> dict:
    """One more run with the timeline on; saves the trace and its PNG, returns its summary."""
    llm.engine.reset_prefix_cache()
    llm.engine.start_trace()
    elapsed, _ = time_generate(llm, workload, args.temperature, request_fields_of(args), structured)
    return save_trace(llm.engine.stop_trace(), elapsed, args, mode, cost, hardware)


def save_trace(
    timeline: Timeline,
    elapsed: float,
    args: argparse.Namespace,
    mode: str,
    cost: ModelCost,
    hardware: Hardware,
) -> dict:
    """Writes a traced run's timeline and its PNG; returns its summary."""
    from tandem.plot import plot_timeline  # matplotlib only when tracing

    path = args.trace if args.compare is None else args.trace.replace(".json", f"_{mode}.json")
    trace = timeline.to_chrome_trace({"mode": mode, "model": args.model})
    with open(path, "w") as f:
        json.dump(trace, f)
    plot_path = str(Path(path).with_suffix(".png"))
    plot_timeline(trace, plot_path)
    return {
        "trace": path,
        "plot": plot_path,
        "trace_seconds": elapsed,
        "trace_overhead_pct": 100 * timeline.overhead_ns / 1e9 / elapsed,
        "timeline": summarize(trace),
        "roofline_by_step_kind": roofline_by_step_kind(trace, cost, hardware),
    }


def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
        "fused_kernels": fused.KERNELS,
        "pdl": pdl.ENABLED,
        # the engine's other switches for comparisons (README): what this run used
        "splitk": splitk.ENABLED,
        "piecewise": piecewise.ENABLED,
        "blas": runner.BLAS_LIBRARY,
        "decode_tiles": envs.decode_tiles(),
        "switches": envs.current(),  # every TANDEM_* switch, set or not
    }
    for name in ("tandem", "transformers", "triton"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # e.g. tandem run from src/ uninstalled
            env[name] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def copy_tb_per_s(device: torch.device, nbytes: int = 1 << 28, repeats: int = 10) -> float | None:
    """TB moved per second (read + write, as the roofline's 4.22 TB/s) by a device-to-device
    copy of `nbytes`, median of `repeats`; None off CUDA. Lent machines of one kind differ: the
    same code ran the latency workload at 4.42 and 4.80 ms per token on two H200s."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(seconds) / 1e12


def print_report(report: dict) -> None:
    # the roofline is an H200's: a share of it says nothing about a CPU run
    on_gpu = report["engine"]["resolved"]["device"].startswith("cuda")
    print(
        f"{'mode':18} {'out tok/s':>10} {'req/s':>8} {'ms/step':>8} {'steps':>6} {'seconds':>8} "
        f"{'roofline':>8} {'GPU active':>10} {'cache hits':>10}"
    )
    for mode, r in report["results"].items():
        active = r.get("timeline", {}).get("gpu_active_pct")
        rate = r.get("prefix_cache_hit_rate")  # ours only
        hits = f"{'-' if rate is None else f'{100 * rate:.1f}%':>10}"
        ms_per_step = "-" if r["ms_per_step"] is None else f"{r['ms_per_step']:.2f}"
        share = f"{100 * r['roofline_fraction']:7.3g}%" if on_gpu else f"{'-':>8}"
        print(
            f"{mode:18} {r['output_tokens_per_s']:10.0f} {r['requests_per_s']:8.2f} "
            f"{ms_per_step:>8} {r['steps']:6.0f} {r['seconds']:8.2f} "
            f"{share} {'-' if active is None else f'{active:.2f}%':>10}"
            f" {hits}"
        )
    roofline = report["roofline"]
    output_tokens = report["workload"]["output_tokens"]
    if on_gpu:
        print(
            f"roofline of this work on {roofline['hardware']}: {roofline['seconds']:.4g} s "
            f"({output_tokens / roofline['seconds']:.0f} output tok/s, {roofline['steps']} steps, "
            f"{roofline['bytes_bound_steps']} bound by bytes); 'roofline' = its share of the time"
        )
    else:
        print("roofline: not shown; this run is on the CPU, and the roofline is of a GPU (H200)")
    for mode, r in report["results"].items():
        if r.get("preemptions_per_run"):  # its own work's roofline counts recomputed prefill
            swap = r.get("timeline", {}).get("swap") or {}
            moved = (swap.get("bytes_out", 0) + swap.get("bytes_in", 0)) / 2**30
            own = r["roofline_seconds"] / r["seconds"]
            print(
                f"{mode}: {r['preemptions_per_run']:.0f} preemptions per run, "
                f"{r['swapped_per_run']:.0f} by swap; {100 * own:.3g}% "
                f"of its own work's roofline; traced run swapped {moved:.2f} GiB "
                f"in {swap.get('gpu_ms', 0):.1f} GPU ms"
            )
        for kind, k in r.get("roofline_by_step_kind", {}).items():
            if k["roofline_fraction"] is not None:  # GPU compute spans: CUDA only
                print(
                    f"{mode} {kind} steps: {k['steps']}, GPU compute {k['gpu_ms']:.1f} ms, "
                    f"roofline {k['roofline_ms']:.1f} ms ({100 * k['roofline_fraction']:.1f}%); "
                    f"host launch {k['launch_ms']:.1f} ms, idle before {k['idle_before_ms']:.1f} ms"
                )
    copy = report["environment"].get("copy_tb_per_s")
    if copy is not None:
        print(f"this machine's device copy: {copy:.2f} TB/s (read + write)")
    if report["mode"] == "latency":
        print(f"{'mode':18} {'ms':6} {'p50':>9} {'p90':>9} {'p99':>9}")
        for mode, r in report["results"].items():
            for key in LATENCY_KEYS[:3]:
                stats = r[f"{key}_ms"]
                print(
                    f"{mode:18} {key.upper():6} "
                    + " ".join(
                        f"{'-' if stats[p] is None else f'{stats[p]:.2f}':>9}"
                        for p in ("p50", "p90", "p99")
                    )
                )
    for name, reason in report.get("transformers", {}).get("skipped", {}).items():
        print(f"{name}: skipped ({reason})")
    for name, ratio in report["ratios"].items():
        print(f"{name} output tok/s: {ratio:.3f}")


def add_bench_args(parser: argparse.ArgumentParser, latency: bool = False) -> None:
    parser.add_argument(  # the second spellings are vLLM's `bench` flags
        "--dataset",
        "--dataset-name",
        choices=["random", "sharegpt"],
        default="random",
        help="random token prompts, or ShareGPT conversations",
    )
    parser.add_argument(
        "--dataset-path", help="ShareGPT JSON file (default: the small sample tandem ships)"
    )
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        type=at_least(1),
        default=128,
        help="prompt tokens (random dataset only)",
    )
    parser.add_argument(
        "--output-len",
        "--random-output-len",
        type=at_least(1),
        help=f"default: {DEFAULT_OUTPUT_LEN} (random), the gpt turn's length (sharegpt)",
    )
    parser.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=fraction,
        default=0.0,
        help="lengths uniform in [len x (1 - r), len x (1 + r)] (random dataset only)",
    )
    parser.add_argument(
        "--shared-prefix-len",
        "--random-prefix-len",
        type=at_least(0),
        default=0,
        help="random tokens every prompt starts with, a shared system prompt (random dataset)",
    )
    parser.add_argument(
        "--n",
        type=at_least(1),
        default=1,
        help="samples per prompt, asked together (random dataset)",
    )
    parser.add_argument(
        "--num-prompts",
        type=at_least(1),
        help="default: one batch" if latency else f"default: {DEFAULT_NUM_PROMPTS}",
    )
    if latency:
        parser.add_argument(
            "--batch-size",
            type=at_least(1),
            default=1,
            help="requests that arrive together; the next batch arrives when this one is done",
        )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="every request's")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="every request's")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="every request's")
    parser.add_argument(
        "--logprobs",
        type=int,
        help="every request's SamplingParams.logprobs: its sampled tokens' logprobs and this many "
        "top ones (0: the sampled token's alone, as RL rollouts ask)",
    )
    parser.add_argument(
        "--json-schema",
        help="a JSON schema file every request's output follows (structured outputs; a request "
        "ends where its grammar does); --compare unconstrained runs the same requests without "
        "it, each at the length its constrained run reached",
    )
    parser.add_argument("--repeats", type=at_least(1), default=3, help="timed runs after a warm-up")
    parser.add_argument(
        "--async",
        dest="async_batching",
        action="store_true",
        default=argparse.SUPPRESS,
        help="same as --async-batching",
    )
    parser.add_argument(
        "--sync",
        dest="async_batching",
        action="store_false",
        default=argparse.SUPPRESS,
        help="same as --no-async-batching",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        choices=[
            "sync",
            "no-prefix-caching",
            "unconstrained",
            "transformers",
            "transformers-async",
            "transformers-sync",
            *PREEMPTION_MODES,
        ],
        help="also run our other batching mode on the same engine, our engine with prefix "
        "caching off or another preemption mode (recompute, swap, auto), and/or transformers' "
        "continuous batching (both its modes, or the one named) on the same weights and requests",
    )
    parser.add_argument(
        "--output-json", help="write the report here (rewritten as each part finishes)"
    )
    parser.add_argument(
        "--trace", help="also record one traced run per mode to this Chrome trace path"
    )
    parser.add_argument(
        "--trace-timed",
        action="store_true",
        help="with --trace: record the last timed run instead of one more run (for workloads too "
        "long to run twice; its time then includes the recording, 0.3-1.6%% on the H200)",
    )


def require_transformers(compare: list[str] | None) -> None:
    """Before the run: --compare transformers* needs the `compare` extra."""
    if not any(name.startswith("transformers") for name in compare or ()):
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(
            "--compare transformers needs transformers: pip install 'tandem[compare]'"
        ) from None


def cmd_bench(args: argparse.Namespace, engine_args: dict) -> None:
    require_transformers(args.compare)
    if args.trace_timed and not args.trace:
        raise ValueError(
            "--trace-timed records the last timed run into --trace's path: give --trace"
        )
    save = None
    if args.output_json:

        def save(report: dict) -> None:
            with open(args.output_json, "w") as f:
                json.dump(report, f, indent=2, default=str)

    print_report(run_bench(args, engine_args, save))
