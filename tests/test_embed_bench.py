"""benchmarks/embed.py: on the tiny model it times embedding and prefilling the same prompts and
reports both, each run embedding every prompt (the prefix cache reset between runs)."""

from __future__ import annotations

import json

from benchmark_script import import_benchmark

embed = import_benchmark("embed")


def test_the_report_times_both_and_writes_its_trace(make_tiny, tmp_path):
    trace = tmp_path / "trace.json"
    report = embed.main(
        ["--model", str(make_tiny("llama")), "--load-format", "auto", "--num-prompts", "6",
         "--input-len", "12", "--repeats", "2", "--device", "cpu", "--trace", str(trace),
         "--output-json", str(tmp_path / "report.json")]
    )  # fmt: skip
    assert len(report["runs"]["embed"]) == len(report["runs"]["prefill"]) == 2
    assert report["embed_s"] > 0 and report["prefill_s"] > 0
    assert report["embed_tok_per_s"] == 6 * 12 / report["embed_s"]
    assert report["gpu_active_pct"] is None  # a CPU run has no device timeline
    steps = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert steps  # the traced run's phases
    assert json.loads((tmp_path / "report.json").read_text())["ratio"] == report["ratio"]
