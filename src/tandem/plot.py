"""PNG timeline of a Chrome trace: the whole run's GPU busy vs idle, and a zoom on a few steps."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from tandem.profiler import CPU_PHASES, GPU_LANES, GPU_STREAMS
from tandem.trace import clip, intervals, run_window, summarize, union

BUSY, IDLE, CPU_BUSY, CPU_IDLE = "#2ca02c", "#d62728", "#1f77b4", "#dddddd"
LANE_COLORS = {
    "h2d": "#9467bd",
    "compute": BUSY,
    "d2h": "#ff7f0e",
    "schedule": "#1f77b4",
    "build": "#17becf",
    "launch": "#393b79",
    "wait": "#bbbbbb",
    "process": "#8c564b",
    "mask": "#e377c2",
    "swap": "#2ca02c",
    "mask_wait": "#d62728",  # the compute stream waiting for structured outputs' masks
}
NUM_COLUMNS = 1000
NO_STEP = -1  # a lane's interval that belongs to no step: a batch of swap copies
LABEL_MIN_WIDTH = 0.04  # of the zoom window: narrower bars get no step label


def plot_timeline(trace: dict, path: str | Path, window_steps: int = 6) -> None:
    """Write a PNG: the whole run's GPU busy vs idle on top, every lane over a few steps below."""
    if window_steps < 1:
        raise ValueError(f"window_steps must be at least 1, got {window_steps}")
    lanes = lane_intervals(trace)
    if "launch" not in lanes:
        raise ValueError("the trace has no launched steps to plot")
    has_gpu = any(stream in lanes for stream in GPU_STREAMS)
    start, end = run_window(*intervals(trace))
    summary = summarize(trace)
    fig = Figure(figsize=(14, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    whole, zoom = fig.subplots(2, 1, height_ratios=(1, 2.4))
    zoom_lo, zoom_hi, steps = zoom_window(lanes, window_steps)
    if has_gpu:
        busy = _busy_union(lanes, GPU_LANES, start, end)
        gaps = summary["gpu_idle_gaps"]
        title = (
            f"GPU active {summary['gpu_active_pct']:.2f}%: busy (green) vs idle waiting for "
            f"the CPU (red); {gaps['count']} idle gaps, {gaps['total_ms']:.1f} ms in all"
        )
        _plot_run(whole, busy, start, end, (BUSY, IDLE), "GPU busy share")
    else:
        busy = _busy_union(lanes, [p for p in CPU_PHASES if p != "wait"], start, end)
        title = f"CPU busy {summary['cpu_busy_pct']:.1f}% (no GPU lanes: a CPU run)"
        _plot_run(whole, busy, start, end, (CPU_BUSY, CPU_IDLE), "CPU busy share")
    whole.axvspan((zoom_lo - start) / 1e6, (zoom_hi - start) / 1e6, color="black", alpha=0.35)
    whole.set_title(f"{_run_name(trace)}{title}", loc="left")
    counters = batch_counters(trace)
    _plot_zoom(zoom, lanes, busy if has_gpu else None, counters, start, (zoom_lo, zoom_hi))
    zoom.set_title(
        f"steps {steps[0]}-{steps[-1]} from the middle of the run (dark band above)", loc="left"
    )
    fig.savefig(path, dpi=110)


def lane_intervals(trace: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Lane name -> ([n, 2] start/end µs, [n] step) for each CPU phase and GPU stream present;
    swap copies, batched apart from the steps, have NO_STEP."""
    rows = defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("ph") == "X":
            start, step = event["ts"], event["args"].get("step", NO_STEP)
            rows[event["name"]].append((start, start + event["dur"], step))
    lanes = {}
    for name, lane_rows in rows.items():
        table = np.asarray(lane_rows, dtype=np.float64)
        lanes[name] = (table[:, :2], table[:, 2].astype(np.int64))
    return lanes


def batch_counters(trace: dict) -> dict[int, tuple[float, int, int]]:
    """Step -> (launch µs, num_seqs, num_tokens) from the trace's batch counters."""
    return {
        event["args"]["step"]: (event["ts"], event["args"]["num_seqs"], event["args"]["num_tokens"])
        for event in trace["traceEvents"]
        if event.get("ph") == "C" and event.get("name") == "batch"
    }


def busy_fraction(spans: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Share of each column [edges[i], edges[i + 1]] that sorted, disjoint `spans` cover.

    E.g. spans [[1, 3]], edges [0, 2, 4] -> [0.5, 0.5].
    """
    if len(spans) == 0:
        return np.zeros(len(edges) - 1)
    lengths = spans[:, 1] - spans[:, 0]
    covered_by_end = np.cumsum(lengths)
    # busy time before each span boundary: s0, e0, s1, e1, ... -> 0, l0, l0, l0 + l1, ...
    covered = np.stack([covered_by_end - lengths, covered_by_end], axis=1).reshape(-1)
    covered_at_edges = np.interp(edges, spans.reshape(-1), covered)
    return np.diff(covered_at_edges) / np.diff(edges)


def zoom_window(
    lanes: dict[str, tuple[np.ndarray, np.ndarray]], window_steps: int
) -> tuple[float, float, np.ndarray]:
    """(start µs, end µs, steps): `window_steps` consecutive launched steps from the middle."""
    launched = np.unique(lanes["launch"][1])
    first = max(0, len(launched) // 2 - window_steps // 2)
    steps = launched[first : first + window_steps]
    chosen = [spans[np.isin(lane_steps, steps)] for spans, lane_steps in lanes.values()]
    rows = np.concatenate(chosen)
    lo, hi = float(rows[:, 0].min()), float(rows[:, 1].max())
    margin = 0.02 * (hi - lo)
    return lo - margin, hi + margin, steps


def _busy_union(
    lanes: dict[str, tuple[np.ndarray, np.ndarray]], names: Iterable[str], start: float, end: float
) -> np.ndarray:
    spans = [lanes[name][0] for name in names if name in lanes]
    return clip(union(np.concatenate([np.zeros((0, 2)), *spans])), start, end)


def _run_name(trace: dict) -> str:
    metadata = trace.get("metadata", {})
    words = [str(metadata[key]) for key in ("mode", "model") if key in metadata]
    return f"{' '.join(words)}: " if words else ""


def _plot_run(
    ax: Axes, busy: np.ndarray, start: float, end: float, colors: tuple[str, str], label: str
) -> None:
    edges = np.linspace(start, end, NUM_COLUMNS + 1)
    fraction = busy_fraction(busy, edges)
    seconds = (edges - start) / 1e6
    ax.stairs(fraction, seconds, fill=True, color=colors[0], baseline=0)
    ax.stairs(np.ones_like(fraction), seconds, fill=True, color=colors[1], baseline=fraction)
    ax.set_xlim(seconds[0], seconds[-1])
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds since the first launch")
    ax.set_ylabel(label)


def _plot_zoom(
    ax: Axes,
    lanes: dict[str, tuple[np.ndarray, np.ndarray]],
    gpu_busy: np.ndarray | None,
    counters: dict[int, tuple[float, int, int]],
    start: float,
    window: tuple[float, float],
) -> None:
    """One row per lane, top to bottom: GPU busy/idle, streams, CPU phases; x in ms."""
    names = [name for name in (*GPU_LANES, *CPU_PHASES) if name in lanes]
    rows = (["GPU busy"] if gpu_busy is not None else []) + names
    lo, hi = window
    ax.set_xlim((lo - start) / 1e3, (hi - start) / 1e3)
    ax.set_ylim(len(rows), -0.9)  # the space above row 0 holds the step markers' labels
    ax.set_yticks(np.arange(len(rows)) + 0.5, rows)
    ax.set_xlabel("ms since the first launch")
    if gpu_busy is not None:
        ms = (clip(gpu_busy, lo, hi) - start) / 1e3
        ax.broken_barh([((lo - start) / 1e3, (hi - lo) / 1e3)], (0.1, 0.8), color=IDLE)
        ax.broken_barh(
            list(zip(ms[:, 0], ms[:, 1] - ms[:, 0], strict=True)), (0.1, 0.8), color=BUSY
        )
    min_label_width = LABEL_MIN_WIDTH * (hi - lo) / 1e3
    for row, name in enumerate(names, start=len(rows) - len(names)):
        spans, steps = lanes[name]
        inside = (spans[:, 1] > lo) & (spans[:, 0] < hi)
        ms, steps = (spans[inside] - start) / 1e3, steps[inside]
        widths = ms[:, 1] - ms[:, 0]
        # consecutive steps alternate between the lane's colour and a lighter shade of it
        colors = [to_rgba(LANE_COLORS[name], 1.0 if s % 2 == 0 else 0.55) for s in steps]
        bars = list(zip(ms[:, 0], widths, strict=True))
        # the edge keeps a 5 µs copy visible as a thin line in a window of tens of ms
        ax.broken_barh(bars, (row + 0.1, 0.8), facecolors=colors, edgecolors=colors, linewidth=0.8)
        for (left, right), width, step in zip(ms, widths, steps, strict=True):
            if width >= min_label_width and step != NO_STEP:
                ax.text((left + right) / 2, row + 0.5, str(step), ha="center", va="center",
                        fontsize=8, clip_on=True)  # fmt: skip
    for step, (launch, num_seqs, num_tokens) in counters.items():
        if lo <= launch <= hi:
            x = (launch - start) / 1e3
            ax.axvline(x, color="black", linestyle=":", linewidth=0.8)
            ax.text(x, -0.1, f" step {step}\n {num_seqs} seqs\n {num_tokens} tok", fontsize=7,
                    va="bottom", ha="left", clip_on=True)  # fmt: skip
