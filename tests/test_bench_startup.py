"""`tandem bench startup` (vLLM's): engines started in processes of their own, cold (empty
compile caches) and warm, their times reported as vLLM's benchmark reports them; and
Engine.startup_seconds, which splits a start."""

from __future__ import annotations

import json
import os
import time

import pytest

from tandem import LLM, bench_startup
from tandem.bench_startup import start, start_cold
from tandem.cli import main


def test_startup_seconds_split_the_engine_s_start(make_tiny):
    """Loading and graph capture (none on CPU) fit within the whole, which is about as long as
    the LLM took to build."""
    began = time.perf_counter()
    llm = LLM(str(make_tiny("llama")), max_model_len=64)
    took = time.perf_counter() - began
    parts = llm.engine.startup_seconds
    assert set(parts) == {"load", "graph_capture", "total"}
    assert parts["graph_capture"] == 0 and 0 < parts["load"] <= parts["total"] <= took


def test_bench_startup_reports_cold_and_warm_starts(make_tiny, tmp_path, capsys):
    """One cold and one warm start (after no warm-up): each printed with its percentiles and
    written as vLLM's JSON fields; a start times at least its engine's own start."""
    report = tmp_path / "startup.json"
    main(["bench", "startup", "--model", str(make_tiny("llama")), "--max-model-len", "64",
          "--num-iters-cold", "1", "--num-iters-warmup", "0", "--num-iters-warm", "1",
          "--output-json", str(report)])  # fmt: skip
    out = capsys.readouterr().out
    assert "Cold startup (1 starts):" in out and "Warm startup (1 starts):" in out
    results = json.loads(report.read_text())
    for phase in ("cold", "warm"):
        [whole] = results[f"{phase}_startup_times"]
        [load] = results[f"{phase}_load_times"]
        assert results[f"{phase}_graph_capture_times"] == [0.0]  # no CUDA graphs on CPU
        assert 0 < load < whole == results[f"avg_{phase}_startup_time"]
        assert set(results[f"{phase}_startup_percentiles"]) == {"10", "25", "50", "75", "90", "99"}
        assert f"Avg startup time: {whole:.2f} seconds" in out


def test_a_cold_start_gets_empty_triton_and_inductor_caches_of_its_own(monkeypatch):
    """Each cold start's child sees TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR in a new empty
    folder, removed after it."""
    seen = []

    def fake_start(model, engine_args, env):
        seen.append({name: (path, os.path.isdir(os.path.dirname(path)),
                            os.listdir(os.path.dirname(path))) for name, path in env.items()})  # fmt: skip
        return {}

    monkeypatch.setattr(bench_startup, "start", fake_start)
    start_cold("m", {})
    start_cold("m", {})
    assert [set(env) for env in seen] == [{"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"}] * 2
    folders = {os.path.dirname(path) for env in seen for path, _, _ in env.values()}
    assert len(folders) == 2 and not any(os.path.exists(f) for f in folders)
    assert all(exists and listing == [] for env in seen for _, exists, listing in env.values())


def test_a_start_that_fails_is_a_value_error_and_leaves_the_environment(tmp_path):
    before = dict(os.environ)
    with pytest.raises(ValueError, match=r"the engine did not start: .*not-a-model"):
        start(str(tmp_path / "not-a-model"), {}, {"TRITON_CACHE_DIR": str(tmp_path / "t")})
    assert dict(os.environ) == before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-iters-cold", "-1"], "--num-iters-cold must be at least 0"),
        (["--num-iters-cold", "0", "--num-iters-warm", "0"], "nothing to time"),
    ],
)
def test_bad_iteration_counts_are_refused_before_any_start(make_tiny, flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "startup", "--model", str(make_tiny("llama")), *flags])
