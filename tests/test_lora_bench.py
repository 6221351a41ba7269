"""benchmarks/lora.py: on the tiny model it times the same requests without adapters, under an
engine with adapters naming none, and under its random adapters, and reports all three."""

from __future__ import annotations

import json

from benchmark_script import import_benchmark

lora = import_benchmark("lora")


def test_the_report_times_all_three_and_writes_its_trace(make_tiny, tmp_path):
    trace = tmp_path / "trace.json"
    report = lora.main(
        ["--model", str(make_tiny("llama")), "--load-format", "auto", "--num-prompts", "6",
         "--input-len", "12", "--output-len", "5", "--num-adapters", "2", "--rank", "4",
         "--repeats", "2", "--device", "cpu", "--trace", str(trace),
         "--output-json", str(tmp_path / "report.json")]
    )  # fmt: skip
    assert all(len(times) == 2 for times in report["runs"].values())
    assert report["lora_tok_per_s"] > 0 and report["plain_tok_per_s"] > 0
    assert report["gpu_active_pct"] is None  # a CPU run has no device timeline
    steps = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert steps  # the traced run's phases
    assert json.loads((tmp_path / "report.json").read_text())["rank"] == 4
