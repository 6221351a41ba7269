"""Summaries of a Chrome trace written by the profiler: GPU-active %, idle gaps, CPU/GPU overlap."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from tandem.profiler import CPU_PHASES, GPU_LANES, MASK_WAIT

GAP_BUCKETS_US = (0, 10, 50, 100, 500, 1000, 5000, float("inf"))
STEP_WORK_FIELDS = ("num_seqs", "num_tokens", "context_tokens", "attention_pairs")


def load_trace(path: str | Path) -> dict:
    """A Chrome trace JSON file as written by `Timeline.save` or `--trace`."""
    trace = json.loads(Path(path).read_text())
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"{path} is not a Chrome trace: it has no traceEvents")
    return trace


def intervals(trace: dict) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(CPU phase -> [n, 2] start/end µs, GPU stream -> [n, 2]) from a trace's complete events."""
    cpu, gpu = defaultdict(list), defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        lanes = cpu if event["pid"] == 1 else gpu
        lanes[event["name"]].append((event["ts"], event["ts"] + event["dur"]))
    return _as_arrays(cpu), _as_arrays(gpu)


def _as_arrays(lanes: dict[str, list]) -> dict[str, np.ndarray]:
    return {
        name: np.asarray(spans, dtype=np.float64).reshape(-1, 2) for name, spans in lanes.items()
    }


def union(spans: np.ndarray) -> np.ndarray:
    """Merge overlapping [start, end] rows. E.g. [[0, 2], [1, 3], [5, 6]] -> [[0, 3], [5, 6]]."""
    if len(spans) == 0:
        return spans.reshape(0, 2)
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    merged = [list(spans[0])]
    for start, end in spans[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return np.asarray(merged)


def clip(spans: np.ndarray, lo: float, hi: float) -> np.ndarray:
    clipped = np.clip(spans, lo, hi)
    return clipped[clipped[:, 1] > clipped[:, 0]]


def length(spans: np.ndarray) -> float:
    return float((spans[:, 1] - spans[:, 0]).sum()) if len(spans) else 0.0


def difference(spans: np.ndarray, holes: np.ndarray) -> np.ndarray:
    """The union `spans` without the union `holes` (each sorted and disjoint). E.g. [[0, 10]]
    without [[2, 3], [5, 6]] -> [[0, 2], [3, 5], [6, 10]]."""
    kept, first = [], 0
    for start, end in spans.tolist():
        while first < len(holes) and holes[first, 1] <= start:
            first += 1  # holes before this span are before every later one too
        k = first
        while k < len(holes) and holes[k, 0] < end:
            if holes[k, 0] > start:
                kept.append((start, float(holes[k, 0])))
            start = max(start, float(holes[k, 1]))
            k += 1
        if end > start:
            kept.append((start, end))
    return np.asarray(kept, dtype=np.float64).reshape(-1, 2)


def intersection_length(a: np.ndarray, b: np.ndarray) -> float:
    """Total length covered by both unions a and b (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i, 1], b[j, 1]) - max(a[i, 0], b[j, 0]))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


def step_spans(trace: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each traced step that has a launch and a compute span, in step order: ([n] step number,
    [n, 4] its work as `roofline.step_work` counts it (num_seqs, num_tokens, context_tokens,
    attention_pairs), [n, 2] its host launch phase and [n, 2] its compute span, start/end µs)."""
    work, launch, compute = {}, {}, {}
    for event in trace["traceEvents"]:
        args = event.get("args", {})
        if event.get("name") == "batch" and "context_tokens" in args:
            work[args["step"]] = [args[k] for k in STEP_WORK_FIELDS]
        elif event.get("ph") == "X" and event.get("name") in ("launch", "compute"):
            spans = launch if event["name"] == "launch" else compute
            spans[args["step"]] = (event["ts"], event["ts"] + event["dur"])
    steps = sorted(work.keys() & launch.keys() & compute.keys())
    return (
        np.asarray(steps, dtype=np.int64),
        np.asarray([work[s] for s in steps], dtype=np.float64).reshape(-1, 4),
        np.asarray([launch[s] for s in steps], dtype=np.float64).reshape(-1, 2),
        np.asarray([compute[s] for s in steps], dtype=np.float64).reshape(-1, 2),
    )


def idle_before(steps: np.ndarray, compute: np.ndarray) -> np.ndarray:
    """[n] µs the compute stream sat idle between the step before each step and it (0 where
    that step is not in the trace). E.g. steps [3, 4, 6], compute [[0, 5], [7, 9], [12, 14]]
    -> [0, 2, 0]."""
    gaps = np.zeros(len(steps))
    follows = np.diff(steps) == 1
    gaps[1:][follows] = np.maximum(compute[1:, 0] - compute[:-1, 1], 0)[follows]
    return gaps


def run_window(cpu: dict[str, np.ndarray], gpu: dict[str, np.ndarray]) -> tuple[float, float]:
    """From the first launch to the last D2H copy's end (or the last CPU phase on CPU), in µs."""
    empty = np.zeros((0, 2))
    launches = cpu.get("launch", empty)
    start = float(launches[:, 0].min()) if len(launches) else 0.0
    last = (
        gpu.get("d2h", empty)
        if len(gpu.get("d2h", empty))
        else np.concatenate([empty, *cpu.values()])
    )
    end = float(last[:, 1].max()) if len(last) else start
    return start, end


def summarize(trace: dict) -> dict:
    """GPU-active %, idle gaps, CPU busy % and overlap over `run_window`; per-phase times."""
    cpu, gpu = intervals(trace)
    empty = np.zeros((0, 2))
    launches = cpu.get("launch", empty)
    start, end = run_window(cpu, gpu)
    window = max(end - start, 1e-9)
    # a step's compute span holds its wait for token masks: idle time, not work
    mask_waits = clip(union(gpu.get(MASK_WAIT, empty)), start, end)
    busy = [gpu.get(s, empty) for s in GPU_LANES if s != MASK_WAIT]
    gpu_busy = difference(clip(union(np.concatenate(busy)), start, end), mask_waits)
    cpu_busy = clip(
        union(np.concatenate([cpu.get(p, empty) for p in CPU_PHASES if p != "wait"])), start, end
    )
    gaps = (gpu_busy[1:, 0] - gpu_busy[:-1, 1]) if len(gpu_busy) > 1 else np.zeros(0)
    histogram = (
        np.histogram(gaps, bins=GAP_BUCKETS_US)[0]
        if len(gaps)
        else np.zeros(len(GAP_BUCKETS_US) - 1)
    )
    steps = max(len(launches), 1)
    return {
        "window_ms": window / 1e3,
        "steps": steps,
        "gpu_active_pct": 100 * length(gpu_busy) / window if gpu else None,
        "gpu_idle_gaps": {
            "count": len(gaps),
            "total_ms": float(gaps.sum()) / 1e3,
            "histogram_us": {
                f"{lo}-{hi}": int(n)
                for lo, hi, n in zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:], histogram, strict=False)
            },
        },
        "cpu_busy_pct": 100 * length(cpu_busy) / window,
        "cpu_gpu_overlap_pct": 100 * intersection_length(cpu_busy, gpu_busy) / window
        if gpu
        else None,
        "cpu_phase_ms_per_step": {
            phase: {
                "median": float(np.median(d := (spans[:, 1] - spans[:, 0]) / 1e3)),
                "p99": float(np.percentile(d, 99)),
            }
            for phase, spans in cpu.items()
        },
        "swap": swap_totals(trace, gpu.get("swap", empty)),
        "mask_wait": {
            "steps": len(gpu.get(MASK_WAIT, empty)),
            "total_ms": length(mask_waits) / 1e3,
            "pct": 100 * length(mask_waits) / window,
        },
        "gpu_stream_ms_per_step": {
            stream: float(np.median((spans[:, 1] - spans[:, 0]) / 1e3))
            for stream, spans in gpu.items()
        },
    }


def swap_totals(trace: dict, swap_spans: np.ndarray) -> dict:
    """Batches of swap copies, bytes each way (from the host's counters) and device ms."""
    counters = [
        e["args"] for e in trace["traceEvents"] if e.get("ph") == "C" and e.get("name") == "swap"
    ]
    return {
        "batches": len(counters),
        "bytes_out": sum(c["bytes_out"] for c in counters),
        "bytes_in": sum(c["bytes_in"] for c in counters),
        "gpu_ms": length(swap_spans) / 1e3,
    }


def format_summary(summary: dict) -> str:
    lines = [f"window {summary['window_ms']:.1f} ms over {summary['steps']} steps"]
    if summary["gpu_active_pct"] is not None:
        gaps = summary["gpu_idle_gaps"]
        lines.append(
            f"GPU active {summary['gpu_active_pct']:.2f}%  idle gaps {gaps['count']} "
            f"({gaps['total_ms']:.2f} ms)  CPU/GPU overlap {summary['cpu_gpu_overlap_pct']:.1f}%"
        )
    swap = summary.get("swap")
    if swap and swap["batches"]:
        lines.append(
            f"swap {swap['batches']} batches  out {swap['bytes_out'] / 2**20:.1f} MiB  "
            f"in {swap['bytes_in'] / 2**20:.1f} MiB  on the GPU {swap['gpu_ms']:.2f} ms"
        )
    waits = summary.get("mask_wait")
    if waits and waits["steps"]:
        lines.append(
            f"mask wait {waits['total_ms']:.2f} ms ({waits['pct']:.3f}% of the run) over "
            f"{waits['steps']} masked steps"
        )
    lines.append(f"CPU busy {summary['cpu_busy_pct']:.1f}%")
    for phase, ms in summary["cpu_phase_ms_per_step"].items():
        lines.append(f"  {phase:8} median {ms['median']:.3f} ms  p99 {ms['p99']:.3f} ms")
    return "\n".join(lines)
