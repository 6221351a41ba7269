"""Timeline: Chrome trace export, summary arithmetic, the PNG, the `tandem trace` commands."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.cli import main
from tandem.plot import BUSY, CPU_BUSY, IDLE, busy_fraction, plot_timeline
from tandem.profiler import CPU_PHASES, GPU_LANES, Timeline
from tandem.trace import (
    format_summary,
    idle_before,
    intersection_length,
    length,
    summarize,
    union,
)

ENGINE_ARGS = {"max_model_len": 128, "block_size": 8}
CLI_ENGINE_ARGS = ["--max-model-len", "128", "--block-size", "8"]

# Two sync steps by hand, times in µs. The run window is step 0's launch (30) to step 1's D2H
# end (290): 260 µs. The GPU is idle 140-185 (the CPU processes step 0, then schedules, builds
# and launches step 1), 195-200 and 280-285 (between step 1's streams).
TWO_STEPS = {
    0: {"schedule": (0, 10), "build": (10, 30), "launch": (30, 40), "wait": (40, 140),
        "process": (140, 150), "h2d": (35, 45), "compute": (45, 135), "d2h": (135, 140)},
    1: {"schedule": (150, 160), "build": (160, 180), "launch": (180, 190), "wait": (190, 290),
        "process": (290, 310), "h2d": (185, 195), "compute": (200, 280), "d2h": (285, 290)},
}  # fmt: skip


def synthetic_trace(steps: dict[int, dict[str, tuple[float, float]]]) -> dict:
    events = []
    for step, lanes in steps.items():
        for name, (start, end) in lanes.items():
            pid, tid = (
                (1, CPU_PHASES.index(name)) if name in CPU_PHASES else (2, GPU_LANES.index(name))
            )
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": start,
                           "dur": end - start, "args": {"step": step}})  # fmt: skip
        launch = lanes["launch"][0]
        events.append({"ph": "C", "pid": 1, "tid": 0, "name": "batch", "ts": launch,
                       "args": {"num_seqs": 2, "num_tokens": 2, "step": step}})  # fmt: skip
    return {"traceEvents": events, "metadata": {"mode": "sync", "model": "by hand"}}


def cpu_only(steps: dict[int, dict[str, tuple[float, float]]]) -> dict:
    return {
        step: {k: v for k, v in lanes.items() if k in CPU_PHASES} for step, lanes in steps.items()
    }


def assert_valid_chrome_trace(trace: dict) -> None:
    assert json.loads(json.dumps(trace)) == trace
    lane_names = {}
    for event in trace["traceEvents"]:
        assert {"ph", "pid", "tid", "ts"} <= event.keys(), event
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
        if event["ph"] == "M" and event["name"] == "thread_name":
            lane_names[event["pid"], event["tid"]] = event["args"]["name"]
    assert lane_names == {
        **{(1, tid): name for tid, name in enumerate(CPU_PHASES)},
        **{(2, tid): name for tid, name in enumerate(GPU_LANES)},
    }
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert processes == {1: "CPU", 2: "GPU"}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            assert lane_names[event["pid"], event["tid"]] == event["name"]


def complete_events(trace: dict, name: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == name]


def pixels(path: Path) -> np.ndarray:
    """[height, width, 3] uint8 RGB of a PNG."""
    image = matplotlib.image.imread(path)
    return np.round(image[..., :3] * 255).astype(np.uint8)


def has_color(image: np.ndarray, color: str) -> bool:
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return bool(np.all(image == rgb, axis=-1).any())


# ---- a traced run of the tiny model on the CPU ----------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def traced_run(make_tiny, request) -> tuple[dict, range, Timeline]:
    """(Chrome trace, the steps the run launched, its timeline) of a traced tiny-model run."""
    llm = LLM(str(make_tiny("llama")), async_batching=request.param, **ENGINE_ARGS)
    # 4, 16 and 29 tokens, no shared prefix (the prefix cache would skip blocks of a common one)
    prompts = [
        {"prompt_token_ids": list(range(100 * i + 1, 100 * i + n))}
        for i, n in enumerate((5, 17, 30))
    ]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    first_step = llm.engine.num_steps
    llm.engine.start_trace()
    llm.generate(prompts, params, use_tqdm=False)
    timeline = llm.engine.stop_trace()
    mode = "async" if request.param else "sync"
    trace = timeline.to_chrome_trace({"mode": mode, "model": "tiny-llama"})
    return trace, range(first_step, llm.engine.num_steps), timeline


def test_a_traced_run_is_valid_chrome_trace_json_with_named_lanes(traced_run):
    trace, _, _ = traced_run
    assert_valid_chrome_trace(trace)


def test_a_traced_cpu_run_has_every_cpu_phase_lane_and_one_launch_per_step(traced_run):
    trace, steps, timeline = traced_run
    assert len(steps) >= 9
    for phase in CPU_PHASES:  # "mask" only in steps with structured outputs: none here
        assert bool(complete_events(trace, phase)) == (phase != "mask"), phase
    for phase in ("build", "launch", "wait", "process"):
        assert sorted(e["args"]["step"] for e in complete_events(trace, phase)) == list(steps)
    assert not [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    counters = [e["args"] for e in trace["traceEvents"] if e["ph"] == "C"]
    assert [c["step"] for c in counters] == list(steps)
    assert all(1 <= c["num_seqs"] <= c["num_tokens"] for c in counters)
    # the first step prefills all three prompts (4, 16 and 29 tokens) from scratch, causal
    assert counters[0] == {"step": steps[0], "num_seqs": 3, "num_tokens": 49,
                           "context_tokens": 49, "attention_pairs": 10 + 136 + 435}  # fmt: skip
    # a decode step's one new token per sequence sees its whole context
    decodes = [c for c in counters if c["num_tokens"] == c["num_seqs"]]
    assert decodes and all(c["attention_pairs"] == c["context_tokens"] for c in decodes)
    assert timeline.overhead_ns > 0


def test_the_phases_of_one_step_follow_each_other(traced_run):
    trace, steps, _ = traced_run
    for step in steps:
        starts = [
            [e["ts"] for e in complete_events(trace, phase) if e["args"]["step"] == step]
            for phase in ("build", "launch", "wait", "process")
        ]
        assert [s for [s] in starts] == sorted(s for [s] in starts)


def test_a_timeline_with_gpu_intervals_exports_them_on_the_gpu_lanes():
    timeline = Timeline(cuda=False)
    with timeline.phase("launch", 7):
        pass
    for stream, (start, end) in enumerate([(100, 200), (200, 5_000), (5_000, 5_100)]):
        timeline.gpu.add(
            stream, 7, timeline.cpu.view()[0, 2] + start, timeline.cpu.view()[0, 2] + end
        )
    trace = timeline.to_chrome_trace({})
    assert_valid_chrome_trace(trace)
    gpu = [
        (e["name"], e["ts"], e["dur"])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["pid"] == 2
    ]
    assert gpu == [("h2d", 0.1, 0.1), ("compute", 0.2, 4.8), ("d2h", 5.0, 0.1)]


# ---- summary arithmetic ---------------------------------------------------------------------


def test_idle_before_counts_only_gaps_after_the_step_just_before():
    steps = np.array([3, 4, 6, 7])
    compute = np.array([[0.0, 5.0], [7.0, 9.0], [12.0, 14.0], [13.0, 20.0]])
    # 4 waited 2 after 3; 6 follows a step not in the trace; 7 started before 6 ended: no idle
    assert idle_before(steps, compute).tolist() == [0.0, 2.0, 0.0, 0.0]


def test_summary_of_two_hand_made_steps_is_exact():
    summary = summarize(synthetic_trace(TWO_STEPS))
    assert summary["window_ms"] == 0.26
    assert summary["steps"] == 2
    # GPU busy: [35, 140] (h2d, compute and d2h touch), [185, 195], [200, 280], [285, 290]
    assert summary["gpu_active_pct"] == pytest.approx(100 * 200 / 260, rel=1e-12)
    assert summary["gpu_idle_gaps"] == {
        "count": 3,
        "total_ms": pytest.approx(0.055, rel=1e-12),  # 45 + 5 + 5 µs
        "histogram_us": {"0-10": 2, "10-50": 1, "50-100": 0, "100-500": 0, "500-1000": 0,
                         "1000-5000": 0, "5000-inf": 0},
    }  # fmt: skip
    # CPU busy (waiting is not): [30, 40] and [140, 190] inside the window; [290, 310] is after it
    assert summary["cpu_busy_pct"] == pytest.approx(100 * 60 / 260, rel=1e-12)
    # overlap: [35, 40] with step 0's H2D, [185, 190] with step 1's
    assert summary["cpu_gpu_overlap_pct"] == pytest.approx(100 * 10 / 260, rel=1e-12)
    phases = summary["cpu_phase_ms_per_step"]
    assert phases["process"]["median"] == pytest.approx(0.015, rel=1e-12)  # 10 and 20 µs
    assert phases["process"]["p99"] == pytest.approx(0.0199, rel=1e-12)  # 10 + 0.99 * 10 µs
    assert phases["wait"] == {"median": 0.1, "p99": 0.1}
    assert summary["gpu_stream_ms_per_step"] == pytest.approx(
        {"h2d": 0.01, "compute": 0.085, "d2h": 0.005}, rel=1e-12
    )


def test_summary_of_a_cpu_only_trace_has_no_gpu_figures_and_ends_at_the_last_phase():
    summary = summarize(synthetic_trace(cpu_only(TWO_STEPS)))
    assert summary["window_ms"] == 0.28  # launch at 30 to the last process' end at 310
    assert summary["gpu_active_pct"] is None
    assert summary["cpu_gpu_overlap_pct"] is None
    assert summary["gpu_idle_gaps"]["count"] == 0
    assert summary["cpu_busy_pct"] == pytest.approx(100 * 80 / 280, rel=1e-12)


def test_formatted_summary_shows_the_gpu_active_share_and_every_phase():
    text = format_summary(summarize(synthetic_trace(TWO_STEPS)))
    assert "GPU active 76.92%  idle gaps 3 (0.06 ms)  CPU/GPU overlap 3.8%" in text
    assert all(f"  {phase:8} median" in text for phase in CPU_PHASES if phase != "mask")


def test_the_compute_streams_wait_for_token_masks_is_idle_time_and_is_reported():
    """Step 0's compute span [45, 135] holds a 10 µs wait for its masks: 190 of the 260 µs
    window busy instead of 200, and the wait reported as 10 µs, 3.85% of the run."""
    steps = {0: {**TWO_STEPS[0], "mask": (150, 152), "mask_wait": (60, 70)}, 1: TWO_STEPS[1]}
    summary = summarize(synthetic_trace(steps))
    assert summary["gpu_active_pct"] == pytest.approx(100 * 190 / 260, rel=1e-12)
    assert summary["mask_wait"]["steps"] == 1
    assert summary["mask_wait"]["total_ms"] == pytest.approx(0.01, rel=1e-12)
    assert summary["mask_wait"]["pct"] == pytest.approx(100 * 10 / 260, rel=1e-12)
    assert "mask wait 0.01 ms (3.846% of the run) over 1 masked steps" in format_summary(summary)
    assert summarize(synthetic_trace(TWO_STEPS))["mask_wait"]["steps"] == 0


def test_every_lane_has_a_color_in_the_plot(tmp_path):
    from tandem.plot import LANE_COLORS

    assert set(CPU_PHASES) | set(GPU_LANES) <= set(LANE_COLORS)
    steps = {0: {**TWO_STEPS[0], "mask": (150, 152), "mask_wait": (60, 70)}, 1: TWO_STEPS[1]}
    plot_timeline(synthetic_trace(steps), tmp_path / "masked.png")
    assert (tmp_path / "masked.png").stat().st_size > 0


def rasterize(spans, size: int = 80) -> np.ndarray:
    """Unit cells [i, i + 1) covered by any integer [start, end] span."""
    covered = np.zeros(size, dtype=bool)
    for start, end in spans:
        covered[int(start) : int(end)] = True
    return covered


integer_spans = st.lists(
    st.tuples(st.integers(0, 64), st.integers(0, 12)).map(lambda s: (s[0], s[0] + s[1])),
    max_size=20,
)


def as_array(spans) -> np.ndarray:
    return np.asarray(spans, dtype=np.float64).reshape(-1, 2)


@settings(max_examples=300, deadline=None)
@given(spans=integer_spans)
def test_union_covers_exactly_what_its_spans_cover_sorted_and_disjoint(spans):
    merged = union(as_array(spans))
    assert np.all(merged[1:, 0] > merged[:-1, 1])
    assert np.array_equal(rasterize(merged), rasterize(spans))
    assert length(merged) == rasterize(spans).sum()


@settings(max_examples=300, deadline=None)
@given(a=integer_spans, b=integer_spans)
def test_intersection_length_of_two_unions_counts_the_cells_both_cover(a, b):
    both = rasterize(a) & rasterize(b)
    assert intersection_length(union(as_array(a)), union(as_array(b))) == both.sum()


@settings(max_examples=300, deadline=None)
@given(spans=integer_spans)
def test_busy_fraction_of_a_column_is_the_share_of_its_cells_covered(spans):
    merged = union(as_array(spans))
    merged = merged[merged[:, 1] > merged[:, 0]]
    edges = np.arange(0, 81, 4, dtype=np.float64)  # 20 columns of 4 cells
    expected = rasterize(spans).reshape(20, 4).mean(axis=1)
    np.testing.assert_allclose(busy_fraction(merged, edges), expected, atol=1e-12)


# ---- the PNG --------------------------------------------------------------------------------


def test_a_trace_with_swap_copies_plots_them_on_their_lane_without_a_step(tmp_path):
    from tandem.plot import NO_STEP, lane_intervals

    timeline = Timeline(cuda=False)
    for step, lanes in TWO_STEPS.items():
        timeline.record_step(step, (2, 2, 0, 0))
        for name, (start, end) in lanes.items():
            log = timeline.cpu if name in CPU_PHASES else timeline.gpu
            names = CPU_PHASES if name in CPU_PHASES else GPU_LANES
            log.add(names.index(name), step, int(start * 1e3), int(end * 1e3))
    # a batch of swap copies during step 1's compute, as Timeline._read_swaps adds one
    timeline.swaps.append((200_000, 4096, 0))
    timeline.gpu.add(GPU_LANES.index("swap"), 0, 205_000, 230_000)
    trace = timeline.to_chrome_trace({"mode": "async", "model": "by hand"})
    spans, steps = lane_intervals(trace)["swap"]
    assert spans.tolist() == [[205.0, 230.0]] and steps.tolist() == [NO_STEP]
    plot_timeline(trace, tmp_path / "swap.png")
    assert pixels(tmp_path / "swap.png").shape[0] > 0


def test_plot_of_a_gpu_trace_shows_busy_in_green_and_idle_in_red(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(synthetic_trace(TWO_STEPS), path)
    image = pixels(path)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 1
    assert has_color(image, BUSY) and has_color(image, IDLE)


def test_plot_of_a_cpu_run_shows_the_cpu_lanes_only(traced_run, tmp_path):
    trace, _, _ = traced_run
    path = tmp_path / "cpu.png"
    plot_timeline(trace, path, window_steps=3)
    image = pixels(path)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 1
    assert has_color(image, CPU_BUSY) and not has_color(image, IDLE)


def test_plot_rejects_an_empty_window_and_a_trace_without_steps(tmp_path):
    with pytest.raises(ValueError, match="window_steps"):
        plot_timeline(synthetic_trace(TWO_STEPS), tmp_path / "x.png", window_steps=0)
    with pytest.raises(ValueError, match="no launched steps"):
        plot_timeline({"traceEvents": []}, tmp_path / "x.png")


# ---- the command line -----------------------------------------------------------------------


@pytest.fixture
def trace_file(tmp_path) -> Path:
    path = tmp_path / "two_steps.json"
    path.write_text(json.dumps(synthetic_trace(TWO_STEPS)))
    return path


def test_trace_summarize_prints_the_formatted_summary(trace_file, capsys):
    main(["trace", "summarize", str(trace_file)])
    assert capsys.readouterr().out == format_summary(summarize(synthetic_trace(TWO_STEPS))) + "\n"


def test_trace_summarize_json_prints_the_summary_dict(trace_file, capsys):
    main(["trace", "summarize", str(trace_file), "--json"])
    summary = summarize(synthetic_trace(TWO_STEPS))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(summary))


def test_trace_plot_writes_the_png(trace_file, tmp_path, capsys):
    png = tmp_path / "out.png"
    main(["trace", "plot", str(trace_file), "-o", str(png), "--window-steps", "1"])
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes().startswith(b"\x89PNG")


def test_trace_commands_name_a_file_that_is_not_a_trace(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"results": []}')
    with pytest.raises(SystemExit, match="not a Chrome trace"):
        main(["trace", "summarize", str(path)])


def test_generate_with_trace_writes_it_and_prints_summary_and_overhead(make_tiny, tmp_path, capsys):
    path = tmp_path / "generate.json"
    folder = str(make_tiny("llama"))
    main(
        [
            "generate",
            folder,
            "hello",
            "--max-tokens",
            "4",
            "--quiet",
            "--trace",
            str(path),
            *CLI_ENGINE_ARGS,
        ]
    )
    out = capsys.readouterr().out
    assert "CPU busy" in out and "  launch   median" in out
    assert f"trace: {path} (recording overhead " in out and "% of " in out
    trace = json.loads(path.read_text())
    assert_valid_chrome_trace(trace)
    assert len(complete_events(trace, "launch")) == 4
    assert trace["metadata"] == {"mode": "async", "model": folder}


def test_bench_with_trace_writes_a_png_next_to_each_trace(make_tiny, tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--repeats", "1"]
    main(["bench", "throughput", "--model", str(make_tiny("llama")), *args, "--compare", "sync",
          "--trace", str(path), *CLI_ENGINE_ARGS])  # fmt: skip
    capsys.readouterr()
    for mode in ("sync", "async"):
        assert (tmp_path / f"bench_{mode}.png").read_bytes().startswith(b"\x89PNG")
        assert_valid_chrome_trace(json.loads((tmp_path / f"bench_{mode}.json").read_text()))


def test_bench_trace_timed_records_the_last_timed_run_and_runs_nothing_more(
    make_tiny, tmp_path, capsys
):
    out, path = tmp_path / "bench.json", tmp_path / "trace.json"
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--repeats", "2"]
    main(["bench", "throughput", "--model", str(make_tiny("llama")), *args, "--trace", str(path),
          "--trace-timed", "--output-json", str(out), *CLI_ENGINE_ARGS])  # fmt: skip
    capsys.readouterr()
    result = json.loads(out.read_text())["results"]["async"]
    trace = json.loads(path.read_text())
    assert_valid_chrome_trace(trace)
    # the trace is the second timed run: its time and its launches, one a step
    assert result["trace_seconds"] == result["seconds_all"][-1]
    assert len(complete_events(trace, "launch")) == result["steps"]
    assert (tmp_path / "trace.png").read_bytes().startswith(b"\x89PNG")


def test_bench_trace_timed_without_a_trace_path_is_a_clean_error(make_tiny):
    with pytest.raises(SystemExit, match="give --trace"):
        main(["bench", "throughput", "--model", str(make_tiny("llama")), "--trace-timed"])
