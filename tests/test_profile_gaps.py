"""benchmarks/profile_step.py's idle-time report, on a hand-made trace."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "profile_step", Path(__file__).parent.parent / "benchmarks" / "profile_step.py"
)
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur}


def test_idle_time_counts_gaps_inside_steps_and_names_the_pairs():
    events = [
        kernel("gemm", 0.0, 10.0),
        kernel("norm", 12.0, 3.0),  # 2 us after gemm
        kernel("gemm", 14.0, 10.0),  # starts 1 us early (dependent launch): no idle
        {"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 30.0, "dur": 5.0},
        kernel("norm", 25.0, 3.0),  # 1 us after gemm
        kernel("gemm", 500.0, 10.0),  # the next step
        kernel("norm", 513.0, 3.0),  # 3 us after gemm
    ]
    report = profile_step.kernel_gaps(events).splitlines()
    assert report[0].startswith(
        "6 kernels in 2 steps: 0.039 ms of kernels, 0.038 ms with one running, 0.006 ms idle"
    )
    assert "gemm -> norm" in report[1] and "3 x  2.00 us" in report[1]
    assert "norm -> gemm" in report[2] and "1 x  0.00 us" in report[2]


def test_kernels_on_two_streams_count_once_where_they_run_side_by_side():
    events = [
        kernel("attention", 0.0, 20.0),
        kernel("gemm", 2.0, 5.0),  # inside the attention kernel's time, on another stream
        kernel("norm", 9.0, 2.0),  # also inside
        kernel("attention", 24.0, 20.0),  # 4 us after the first attention, the last to end
    ]
    report = profile_step.kernel_gaps(events).splitlines()
    assert report[0].startswith(
        "4 kernels in 1 steps: 0.047 ms of kernels, 0.040 ms with one running, 0.004 ms idle"
    )
    assert "attention -> attention" in report[1] and "1 x  4.00 us" in report[1]


def test_kernels_by_step_sums_each_step_apart_and_ranks_its_kernels():
    events = [
        kernel("gemm", 0.0, 10.0),
        kernel("norm", 12.0, 3.0),
        kernel("gemm", 16.0, 20.0),
        kernel("gemm", 500.0, 7.0),  # 464 us after the last kernel's end: the next step
        kernel("copy", 508.0, 1.0),
    ]
    lines = profile_step.kernels_by_step(events).splitlines()
    assert lines == [
        "step 0: 0.033 ms, 3 kernels; gemm 0.030, norm 0.003",
        "step 1: 0.008 ms, 2 kernels; gemm 0.007, copy 0.001",
    ]
