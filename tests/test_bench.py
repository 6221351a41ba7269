"""`tandem bench throughput|latency`: JSON reports, the roofline arithmetic, ShareGPT workloads, and
transformers' continuous batching on the same weights."""

from __future__ import annotations

import json
import math
import multiprocessing
import re
from dataclasses import fields, replace

import numpy as np
import pytest
import torch
import triton

from tandem import LLM, SamplingParams, envs
from tandem.bench import (
    counting_jit_compiles,
    request_latencies,
    roofline_by_step_kind,
    transformers_modes,
    warmup_workload,
    waves,
)
from tandem.cli import build_parser, main
from tandem.config import EngineConfig, ModelConfig
from tandem.engine import Engine
from tandem.model.loader import read_hf_config
from tandem.roofline import (
    H200,
    ModelCost,
    on_devices,
    roofline_summary,
    step_rooflines,
    step_work,
)
from tandem.tokenizer import Tokenizer
from tandem.trace import STEP_WORK_FIELDS
from tandem.workload import SHAREGPT_SAMPLE, Workload, sharegpt_workload

ENGINE_FLAGS = ["--max-num-seqs", "4", "--block-size", "8"]
WORKLOAD_KEYS = {
    "model",
    "dataset",
    "dataset_path",
    "num_prompts",
    "input_len",
    "output_len",
    "range_ratio",
    "shared_prefix_len",
    "n",
    "batch_size",
    "temperature",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "json_schema",
    "repeats",
    "prompt_tokens",
    "output_tokens",
    "max_len",
}
RESOLVED_KEYS = {
    "device",
    "dtype",
    "kv_cache_dtype",
    "linear_bytes",  # 1 with FP8 weights
    "kv_bytes",  # 1 with an FP8 KV cache
    "attention_backend",
    "max_model_len",
    "num_blocks",
    "cuda_graph_sizes",
}
ENVIRONMENT_KEYS = {
    "tandem",
    "torch",
    "transformers",
    "triton",
    "numpy",
    "python",
    "platform",
    "date",
    "copy_tb_per_s",  # None on the CPU
    "pdl",
    "splitk",
    "blas",
    "decode_tiles",
}
ROOFLINE_KEYS = {
    "hardware",
    "bandwidth_bytes_per_s",
    "peak_flops_per_s",
    "dtype_bytes",
    "linear_weight_bytes",
    "kv_value_bytes",
    "weight_bytes",
    "seconds",
    "steps",
    "bytes_bound_steps",
    "bytes",
    "flops",
}
RESULT_KEYS = {
    "seconds",
    "seconds_all",
    "steps",
    "output_tokens",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "ms_per_step",
    "roofline_fraction",
}
LATENCY_KEYS = {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_hf(read_hf_config(name)[0])


def ideal_schedule(num_requests: int, prompt_len: int, output_len: int) -> np.ndarray:
    """step_work rows when every prompt is prefilled in step 0, which samples the first token."""
    prefill = (num_requests, num_requests * prompt_len, num_requests * prompt_len)
    pairs = num_requests * prompt_len * (prompt_len + 1) // 2
    decode = [
        (num_requests, num_requests, num_requests * c, num_requests * c)
        for c in range(prompt_len + 1, prompt_len + output_len)
    ]
    return np.array([(*prefill, pairs), *decode])


def run_bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "bench.json"
    main(["bench", *argv, "--repeats", "1", *ENGINE_FLAGS, "--output-json", str(out)])
    return json.loads(out.read_text())


def check_report(report: dict, modes: set[str], latency: bool) -> None:
    assert {"mode", "workload", "engine", "environment", "roofline", "results", "ratios"} <= set(
        report
    )
    assert set(report["workload"]) == WORKLOAD_KEYS
    config_fields = {f.name for f in fields(EngineConfig)}
    assert set(report["engine"]) == config_fields | {"resolved"}
    assert set(report["engine"]["resolved"]) == RESOLVED_KEYS
    assert set(report["environment"]) >= ENVIRONMENT_KEYS
    assert report["environment"]["transformers"] == "5.17.0"
    assert set(report["environment"]["switches"]) == set(envs.SWITCHES)  # every one, set or not
    assert set(report["roofline"]) == ROOFLINE_KEYS
    assert set(report["results"]) == modes
    for mode, result in report["results"].items():
        ours = mode.split()[0] in ("sync", "async")
        expected = RESULT_KEYS | (
            {"roofline_seconds", "allocator_retries", "jit_compiles", "prefix_cache_hit_rate"}
            | {"preemptions_per_run", "swapped_per_run"}
            if ours
            else set()
        )
        assert set(result) == expected | (LATENCY_KEYS if latency else set()), mode
        assert result["output_tokens_per_s"] > 0 and result["steps"] > 0
        for key in LATENCY_KEYS & set(result):
            stats = result[key]
            assert set(stats) == {"mean", "p50", "p90", "p99"}
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (mode, key, stats)


# ---- roofline arithmetic -----------------------------------------------------------------------


def test_roofline_of_a_llama_3_8b_decode_step_matches_a_hand_computation():
    cfg, bf16 = preset("llama-3-8b"), 2
    # per layer: qkv 4096 x (4096 + 2 x 1024), o 4096 x 4096, gate/up/down 3 x 4096 x 14336
    layer_params = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    lm_head_params = 128256 * 4096
    assert (layer_params + lm_head_params) * bf16 == 15_009_316_864  # "15.0 GB incl. LM head"
    kv_bytes_per_token = 2 * 32 * 8 * 128 * bf16  # K and V, 32 layers, 8 KV heads of 128
    # batch 1, one new token at position 999: 1,000 KV tokens read, 1 written
    moved = 15_009_316_864 + 4096 * bf16 + (1000 + 1) * kv_bytes_per_token
    flops = 2 * layer_params + 2 * lm_head_params + 4 * 32 * 128 * 32 * 1000
    expected = max(moved / 4.22e12, flops / 760e12)

    seconds, got_bytes, got_flops = step_rooflines(
        ModelCost.of(cfg, bf16), [step_work([1000], [0, 1])]
    )
    assert (got_bytes[0], got_flops[0]) == (moved, flops)
    assert seconds[0] == pytest.approx(expected, rel=1e-12)
    assert 3.58e-3 < seconds[0] < 3.59e-3  # bound by bytes: 15.1 GB / 4.22 TB/s
    # with ~no KV, the weights alone: DESIGN.md's 3.56-3.57 ms per decode step at batch 1
    empty_kv = step_rooflines(ModelCost.of(cfg, bf16), [step_work([1], [0, 1])])[0][0]
    assert empty_kv == pytest.approx(3.557e-3, abs=1e-6)


def test_a_large_prefill_chunk_is_bound_by_flops():
    cost = ModelCost.of(preset("llama-3-8b"), 2)
    seconds, moved, flops = step_rooflines(cost, [step_work([4096], [0, 4096])])
    assert flops[0] / H200.flops > moved[0] / H200.bandwidth
    assert seconds[0] == flops[0] / H200.flops


def test_step_work_counts_causal_pairs_for_prefill_and_plain_pairs_for_decode():
    # a 3-token prefill from scratch (1 + 2 + 3 pairs), a decode at context 5, a 2-token chunk
    # after 4 cached tokens (5 + 6 pairs)
    assert step_work([3, 5, 6], [0, 3, 4, 6]) == (3, 6, 14, 6 + 5 + 11)


@pytest.mark.parametrize(
    ("workload", "expected_seconds"),
    [
        ((1, 128, 512), 512 * 3.57e-3),  # latency: 3.57 ms/token by bytes
        ((32, 128, 1024), 4.38),  # seed
        ((32, 128, 8192), 63.6),  # seed at 8K new tokens
    ],
    ids=["latency", "seed", "seed-8k"],
)
def test_ideal_schedule_rooflines_match_design_md(workload, expected_seconds):
    summary = roofline_summary(preset("llama-3-8b"), 2, ideal_schedule(*workload))
    assert summary["seconds"] == pytest.approx(expected_seconds, rel=5e-3)


def test_roofline_by_step_kind_sets_each_steps_compute_against_its_own_roofline():
    """Two traced steps by hand (µs): a decode step of 90 on the GPU, launched in 30, then a
    prefill step of 80, launched in 120, that the compute stream waited 60 for."""
    cost = ModelCost.of(preset("qwen3-0.6b"), 2)
    decode, prefill = step_work([600, 300], [0, 1, 2]), step_work([512, 40], [0, 512, 552])

    def batch(step, work):
        return {
            "ph": "C",
            "name": "batch",
            "args": {"step": step, **dict(zip(STEP_WORK_FIELDS, work, strict=True))},
        }

    def span(name, step, ts, dur):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"step": step}}

    events = [
        batch(4, decode),
        span("launch", 4, 0.0, 30.0),
        span("compute", 4, 10.0, 90.0),
        batch(5, prefill),
        span("launch", 5, 40.0, 120.0),
        span("compute", 5, 160.0, 80.0),
        batch(6, decode),
        span("launch", 6, 170.0, 20.0),
    ]  # step 6 has no compute span (not read back yet): left out
    kinds = roofline_by_step_kind({"traceEvents": events}, cost, H200)
    decode_s, prefill_s = (step_rooflines(cost, [w])[0][0] for w in (decode, prefill))
    assert kinds["decode"] == {"steps": 1, "gpu_ms": 0.09, "roofline_ms": decode_s * 1e3,
                               "roofline_fraction": decode_s * 1e3 / 0.09, "launch_ms": 0.03,
                               "idle_before_ms": 0.0}  # fmt: skip
    assert kinds["with_prefill"] == {"steps": 1, "gpu_ms": 0.08, "roofline_ms": prefill_s * 1e3,
                                     "roofline_fraction": prefill_s * 1e3 / 0.08,
                                     "launch_ms": 0.12, "idle_before_ms": 0.06}  # fmt: skip


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_engine_records_each_steps_tokens_and_context(make_tiny, async_batching):
    llm = LLM(str(make_tiny("llama")), block_size=8, async_batching=async_batching)
    llm.engine.step_work = []
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1] * 5}, {"prompt_token_ids": [2] * 3}], params, False)
    assert llm.engine.step_work == [
        (2, 8, 8, 15 + 6),  # both prompts whole, causal
        (2, 2, 6 + 4, 6 + 4),  # decode at contexts 6 and 4
        (2, 2, 7 + 5, 7 + 5),
    ]


def test_request_latencies_from_token_times():
    stats = request_latencies([0.0, 1.0], [[0.5, 0.7, 1.0], [1.25]])
    assert stats["ttft"] == [0.5, 0.25]
    assert stats["tpot"] == pytest.approx([0.25])  # a one-token request has no TPOT
    assert stats["itl"] == pytest.approx([0.2, 0.3])
    assert stats["e2e"] == [1.0, 0.25]
    assert waves(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert waves(5, None) == [range(0, 5)]


# ---- workloads ---------------------------------------------------------------------------------


def test_sharegpt_prompts_are_human_turns_and_output_lengths_the_gpt_turns(make_tiny):
    tokenizer = Tokenizer.from_dir(make_tiny("llama"))
    conversations = json.loads(SHAREGPT_SAMPLE.read_text(encoding="utf-8"))
    assert len(conversations) >= 20
    expected = {
        tuple(tokenizer.encode(c["conversations"][0]["value"])): len(
            tokenizer.encode(c["conversations"][1]["value"], add_special_tokens=False)
        )
        for c in conversations
    }
    workload = sharegpt_workload(SHAREGPT_SAMPLE, 30, tokenizer.encode, None, 10_000, seed=0)
    assert len(workload.prompts) == 30  # more than the file has: conversations repeat
    assert set(map(tuple, workload.prompts)) == set(expected)
    for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True):
        assert output_len == expected[tuple(prompt)]

    fixed = sharegpt_workload(SHAREGPT_SAMPLE, 5, tokenizer.encode, 7, 10_000, seed=0)
    assert fixed.output_lens == [7] * 5
    assert fixed.prompts == workload.prompts[:5]  # the same shuffle for the same seed


def test_sharegpt_skips_conversations_longer_than_max_len(make_tiny):
    encode = Tokenizer.from_dir(make_tiny("llama")).encode
    workload = sharegpt_workload(SHAREGPT_SAMPLE, 40, encode, None, 64, seed=1)
    assert workload.max_len <= 64
    with pytest.raises(ValueError, match="fits in 4 tokens"):
        sharegpt_workload(SHAREGPT_SAMPLE, 4, encode, None, 4, seed=1)


def test_sharegpt_file_without_conversations_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "hi"}]}]))
    with pytest.raises(ValueError, match="human turn"):
        sharegpt_workload(path, 4, lambda text, special: [1, 2], None, 100, seed=0)


def test_sharegpt_on_a_preset_without_tokenizer_exits_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match=r"tokenizer\.json"):
        main(
            [
                "bench",
                "throughput",
                "--model",
                "llama-3-8b",
                "--load-format",
                "dummy",
                "--dataset",
                "sharegpt",
            ]
        )


# ---- end to end --------------------------------------------------------------------------------


def test_sync_and_async_flags_set_the_batching_mode():
    parser = build_parser()
    base = ["bench", "throughput", "--model", "m"]
    assert parser.parse_args(base).async_batching is True
    assert parser.parse_args([*base, "--sync"]).async_batching is False
    assert parser.parse_args([*base, "--sync", "--async"]).async_batching is True
    assert parser.parse_args([*base, "--no-async-batching"]).async_batching is False


@pytest.mark.parametrize("mode", ["throughput", "latency"])
def test_vllm_s_bench_dataset_flags_set_the_same_workload(mode):
    parser = build_parser()
    base = ["bench", mode, "--model", "m"]
    ours = ["--dataset", "random", "--input-len", "100", "--output-len", "20"]
    ours += ["--range-ratio", "0.5", "--shared-prefix-len", "64"]
    vllm = ["--dataset-name", "random", "--random-input-len", "100", "--random-output-len", "20"]
    vllm += ["--random-range-ratio", "0.5", "--random-prefix-len", "64"]
    assert vars(parser.parse_args([*base, *vllm])) == vars(parser.parse_args([*base, *ours]))
    defaults = vars(parser.parse_args(base))
    assert {k: defaults[k] for k in ("input_len", "range_ratio", "shared_prefix_len")} == {
        "input_len": 128, "range_ratio": 0.0, "shared_prefix_len": 0
    }  # fmt: skip


BAD_SIZES = {
    "no_prompts": (
        ["bench", "throughput", "--num-prompts", "0"],
        "--num-prompts: must be at least 1",
    ),
    "negative_input": (
        ["bench", "throughput", "--input-len", "-5"],
        "--input-len.*at least 1, got -5",
    ),
    "no_output": (["bench", "latency", "--output-len", "0"], "--output-len.*at least 1"),
    "no_samples": (["bench", "throughput", "--n", "0"], "--n: must be at least 1"),
    "no_timed_run": (["bench", "throughput", "--repeats", "0"], "--repeats: must be at least 1"),
    "empty_batch": (["bench", "latency", "--batch-size", "0"], "--batch-size: must be at least 1"),
    "negative_prefix": (["bench", "throughput", "--shared-prefix-len", "-1"], "at least 0, got -1"),
    "ratio_of_one": (
        ["bench", "throughput", "--range-ratio", "1"],
        r"must be in \[0, 1\), got 1.0",
    ),
    "negative_ratio": (["bench", "latency", "--random-range-ratio", "-0.1"], r"in \[0, 1\)"),
    "not_a_number": (["bench", "throughput", "--num-prompts", "many"], "'many' is not an integer"),
    "serve_no_prompts": (
        ["bench", "serve", "--num-prompts", "0"],
        "--num-prompts: must be at least 1",
    ),
    "serve_no_concurrency": (["bench", "serve", "--max-concurrency", "0"], "at least 1, got 0"),
    "serve_ratio": (["bench", "serve", "--range-ratio", "2"], r"in \[0, 1\), got 2.0"),
}


@pytest.mark.parametrize(("argv", "message"), BAD_SIZES.values(), ids=BAD_SIZES)
def test_a_bench_size_out_of_range_is_a_usage_error_naming_the_flag(argv, message, capsys):
    model = [] if argv[1] == "serve" else ["--model", "m"]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, *model])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_throughput_runs_sync_and_async_and_writes_every_field(make_tiny, tmp_path, capsys):
    args = ["--num-prompts", "3", "--input-len", "8", "--output-len", "6", "--compare", "sync"]
    report = run_bench(tmp_path, "throughput", "--model", str(make_tiny("llama")), *args)
    check_report(report, {"sync", "async"}, latency=False)
    assert report["mode"] == "throughput"
    assert report["workload"]["output_tokens"] == 3 * 6
    assert report["roofline"]["steps"] == report["results"]["async"]["steps"]
    assert report["async_speedup"] == report["ratios"]["async/sync"]
    out = capsys.readouterr().out
    assert "async/sync output tok/s" in out
    # an H200's roofline says nothing of a CPU run: no share of it, and no ceiling
    assert "roofline of this work" not in out and "roofline: not shown" in out
    assert all(line.split()[6] == "-" for line in out.splitlines() if line.startswith("async "))


def test_shared_prompts_run_with_and_without_prefix_caching_and_report_the_hit_rate(
    make_tiny, tmp_path, capsys
):
    args = ["--num-prompts", "2", "--n", "2", "--shared-prefix-len", "24", "--input-len", "8"]
    args += ["--output-len", "4", "--compare", "no-prefix-caching"]
    report = run_bench(tmp_path, "throughput", "--model", str(make_tiny("llama")), *args)
    check_report(report, {"async", "async no-cache"}, latency=False)
    assert report["workload"]["num_prompts"] == 4 and report["workload"]["output_tokens"] == 16
    cached, plain = report["results"]["async"], report["results"]["async no-cache"]
    # 4 prompts of 32 tokens, 3 blocks of 8 shared, 8 asked for, in each timed run (cold):
    # the second sample of each prompt finds all 4 of its blocks and computes only its last
    # token (the fourth block copied on write), the second prompt finds the 3 of the prefix
    assert cached["prefix_cache_hit_rate"] == pytest.approx((31 + 24 + 31) / (4 * 32))
    assert plain["prefix_cache_hit_rate"] == 0.0
    assert "cache hits" in capsys.readouterr().out


def test_throughput_with_penalty_flags_gives_every_request_those_penalties(
    make_tiny, tmp_path, monkeypatch
):
    seen = []
    make_request = Engine.make_request

    def recording(self, request_id, params, **kwargs):
        seen.append((params.presence_penalty, params.frequency_penalty, params.repetition_penalty))
        return make_request(self, request_id, params, **kwargs)

    monkeypatch.setattr(Engine, "make_request", recording)
    flags = [
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.5",
        "--repetition-penalty",
        "1.1",
    ]
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--repeats", "1", *flags]
    report = run_bench(tmp_path, "throughput", "--model", str(make_tiny("llama")), *args)
    assert report["workload"]["output_tokens"] == 2 * 4
    assert report["workload"]["repetition_penalty"] == 1.1
    assert seen and set(seen) == {(0.5, 0.5, 1.1)}


def test_throughput_with_logprobs_returns_every_sampled_tokens_logprob(
    make_tiny, tmp_path, monkeypatch
):
    made = []
    make_request = Engine.make_request

    def recording(self, request_id, params, **kwargs):
        made.append(make_request(self, request_id, params, **kwargs))
        return made[-1]

    monkeypatch.setattr(Engine, "make_request", recording)
    args = ["--num-prompts", "2", "--n", "2", "--input-len", "8", "--output-len", "4"]
    args += ["--repeats", "1", "--logprobs", "0"]
    report = run_bench(tmp_path, "throughput", "--model", str(make_tiny("llama")), *args)
    assert report["workload"]["logprobs"] == 0
    assert made and {r.params.logprobs for r in made} == {0}
    for request in made:
        assert len(request.logprobs) == 4
        for token, entry in zip(request.output_token_ids, request.logprobs, strict=True):
            assert list(entry) == [token] and -math.inf < entry[token] <= 0.0


def test_a_failed_traced_run_keeps_the_timed_results_saved_before_it(
    make_tiny, tmp_path, monkeypatch
):
    from tandem import bench

    def fail(*args, **kwargs):
        raise RuntimeError("the traced run failed")

    monkeypatch.setattr(bench, "trace_run", fail)
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--model", str(make_tiny("llama")), "--num-prompts", "2"]
    argv += ["--input-len", "8", "--output-len", "4", "--repeats", "1", *ENGINE_FLAGS]
    argv += ["--trace", str(tmp_path / "trace.json"), "--output-json", str(out)]
    with pytest.raises(RuntimeError, match="traced run"):
        main(argv)
    saved = json.loads(out.read_text())
    assert saved["results"]["async"]["output_tokens"] == 2 * 4
    assert saved["results"]["async"]["roofline_fraction"] > 0


def test_preemption_modes_compare_on_one_engine_and_report_swaps(make_tiny, tmp_path):
    args = ["--num-prompts", "4", "--input-len", "8", "--output-len", "24", "--num-blocks", "8"]
    args += ["--temperature", "0", "--preemption-mode", "swap", "--compare", "recompute"]
    report = run_bench(tmp_path, "throughput", "--model", str(make_tiny("llama")), *args)
    check_report(report, {"async", "async recompute"}, latency=False)
    swapped, recomputed = report["results"]["async"], report["results"]["async recompute"]
    assert swapped["swapped_per_run"] > 0 and swapped["preemptions_per_run"] > 0
    assert recomputed["swapped_per_run"] == 0 and recomputed["preemptions_per_run"] > 0
    # the recomputed prefill is work done: more tokens through the model than when swapping
    assert recomputed["steps"] >= swapped["steps"]


def test_roofline_of_two_devices_is_half_the_time_of_one():
    work = ideal_schedule(32, 128, 64)
    one = roofline_summary(preset("llama-3-8b"), 2, work)
    two = roofline_summary(preset("llama-3-8b"), 2, work, on_devices(H200, 2))
    assert two["seconds"] == pytest.approx(one["seconds"] / 2, rel=1e-12)
    assert two["hardware"] == f"2 x {H200.name}"
    assert (two["bytes"], two["flops"]) == (one["bytes"], one["flops"])


def test_tensor_parallel_bench_counts_both_devices_and_stops_its_worker(make_tiny, tmp_path, capfd):
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4"]
    model = str(make_tiny("llama"))
    report = run_bench(
        tmp_path, "throughput", "--model", model, *args, "--tensor-parallel-size", "2"
    )
    assert report["engine"]["tensor_parallel_size"] == 2
    assert report["roofline"]["hardware"] == f"2 x {H200.name}"
    assert not multiprocessing.active_children()  # the worker got its stop order and ended
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("mode_flag", ["--sync", "--async"])
def test_latency_reports_ttft_tpot_itl_percentiles(make_tiny, tmp_path, capsys, mode_flag):
    args = ["--num-prompts", "4", "--batch-size", "2", "--input-len", "8", "--output-len", "5"]
    report = run_bench(tmp_path, "latency", "--model", str(make_tiny("qwen3")), *args, mode_flag)
    mode = mode_flag.removeprefix("--")
    check_report(report, {mode}, latency=True)
    assert report["workload"]["batch_size"] == 2
    assert report["engine"]["async_batching"] is (mode == "async")
    result = report["results"][mode]
    assert result["e2e_ms"]["p50"] >= result["ttft_ms"]["p50"]
    assert "TTFT" in capsys.readouterr().out


def test_throughput_on_sharegpt_uses_the_gpt_turn_lengths(make_tiny, tmp_path):
    folder = make_tiny("llama")
    report = run_bench(tmp_path, "throughput", "--model", str(folder), "--dataset", "sharegpt")
    encode = Tokenizer.from_dir(folder).encode
    expected = sharegpt_workload(SHAREGPT_SAMPLE, 32, encode, None, 1024, seed=0)
    assert report["workload"]["output_tokens"] == expected.num_output_tokens
    assert report["workload"]["dataset_path"] == str(SHAREGPT_SAMPLE)


def test_compare_transformers_runs_its_continuous_batching_on_the_same_requests(
    make_tiny, tmp_path
):
    args = ["--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--range-ratio", "0.5"]
    report = run_bench(
        tmp_path,
        "throughput",
        "--model",
        str(make_tiny("llama")),
        *args,
        "--compare",
        "transformers",
    )
    theirs = {"transformers_sync", "transformers_async"}
    ran = theirs if torch.cuda.is_available() else {"transformers_sync"}
    check_report(report, {"async"} | ran, latency=False)
    assert set(report["transformers"]["skipped"]) == theirs - ran
    config = report["transformers"]["configs"]["transformers_sync"]
    assert config["use_async_batching"] is False
    assert config["attn_implementation"].startswith("paged|")
    assert set(report["ratios"]) == {f"async/{name}" for name in ran}


def test_warmup_takes_the_first_prompts_that_fill_one_step():
    prompts = [[1] * n for n in (300, 500, 200, 100, 400, 600)]
    workload = Workload(prompts, [20, 8, 30, 16, 40, 50])
    warmup = warmup_workload(workload, step_tokens=1200)
    assert warmup.prompts == prompts[:5]  # 300 + 500 + 200 + 100 + 400 >= 1200
    assert warmup.output_lens == [16, 8, 16, 16, 16]
    assert warmup_workload(workload, step_tokens=100).prompts == prompts[:4]  # at least four
    assert warmup_workload(workload, step_tokens=10**6).prompts == prompts  # all there are
    assert warmup_workload(Workload(prompts[:1], [5]), step_tokens=8192).prompts == prompts[:1]


def test_transformers_modes_run_async_first_and_only_those_named():
    assert transformers_modes({"sync", "transformers"}, cuda=True) == ([True, False], {})
    assert transformers_modes({"transformers-sync"}, cuda=True) == ([False], {})
    both = {"transformers-async", "transformers-sync"}
    assert transformers_modes(both, cuda=True) == ([True, False], {})
    assert transformers_modes({"sync"}, cuda=True) == ([], {})
    skipped = {"transformers_async": "transformers' async batching needs CUDA"}
    assert transformers_modes({"transformers"}, cuda=False) == ([False], skipped)
    assert transformers_modes({"transformers-async"}, cuda=False) == ([], skipped)


def test_a_comparison_stopped_midway_leaves_the_finished_results_in_the_json(
    make_tiny, tmp_path, monkeypatch
):
    asked = []

    def stopped(model, workload, warmup, *, async_batching, **kwargs):
        asked.append(async_batching)
        raise RuntimeError("stopped")

    monkeypatch.setattr("tandem.bench_transformers.run_transformers", stopped)
    out = tmp_path / "bench.json"
    model = ["--model", str(make_tiny("llama")), "--repeats", "1", *ENGINE_FLAGS]
    argv = ["--num-prompts", "3", "--input-len", "8", "--output-len", "4", *model]
    compare = ["--compare", "sync", "transformers-sync", "--output-json", str(out)]
    with pytest.raises(RuntimeError, match="stopped"):
        main(["bench", "throughput", *argv, *compare])
    assert asked == [False]
    report = json.loads(out.read_text())
    check_report(report, {"async", "sync"}, latency=False)
    assert report["transformers"] == {"configs": {}, "skipped": {}}
    assert set(report["ratios"]) == {"async/sync"}


def test_transformers_model_for_dummy_weights_computes_what_tandem_computes(make_tiny):
    from tandem.bench_transformers import build_hf_model

    folder = make_tiny("qwen2")
    hf_config, _ = read_hf_config(str(folder))
    model = build_hf_model(hf_config, None, torch.float32, torch.device("cpu"), 3, "sdpa")
    prompt = list(range(10, 30))
    theirs = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    llm = LLM(str(folder), device="cpu", load_format="dummy", seed=3, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [ours] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert ours.outputs[0].token_ids == theirs


def test_jit_compile_count_chains_to_an_existing_hook_and_restores_it():
    seen = []
    triton.knobs.runtime.jit_cache_hook = lambda **kwargs: seen.append(kwargs) or None
    try:
        with counting_jit_compiles() as compiles:
            assert triton.knobs.runtime.jit_cache_hook(key="k", repr="kernel") is None
            triton.knobs.runtime.jit_cache_hook(key="k2", repr="kernel")
        assert compiles == [2] and [k["key"] for k in seen] == ["k", "k2"]
    finally:
        restored = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = None
    assert restored is not None and restored(key="k3") is None and len(seen) == 3


def test_compare_transformers_without_it_installed_is_one_line_naming_the_extra(
    make_tiny, tmp_path, monkeypatch, capsys
):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(SystemExit) as exited:
        main(["bench", "throughput", "--model", str(make_tiny("llama")), "--compare",
              "transformers", *ENGINE_FLAGS])  # fmt: skip
    assert exited.value.code == (
        "tandem: error: --compare transformers needs transformers: pip install 'tandem[compare]'"
    )


def test_fp8_bench_counts_fp8_weight_and_kv_bytes_in_its_roofline(make_tiny, tmp_path):
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4"]
    model = ["--model", str(make_tiny("llama"))]
    (tmp_path / "plain").mkdir(), (tmp_path / "fp8").mkdir()
    plain = run_bench(tmp_path / "plain", "throughput", *model, *args)
    fp8 = run_bench(tmp_path / "fp8", "throughput", *model, *args, "--quantization", "fp8",
                    "--kv-cache-dtype", "fp8")  # fmt: skip
    assert fp8["engine"]["quantization"] == "fp8" and fp8["engine"]["kv_cache_dtype"] == "fp8"
    assert fp8["engine"]["resolved"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert (fp8["roofline"]["linear_weight_bytes"], fp8["roofline"]["kv_value_bytes"]) == (1, 1)
    cfg = preset(str(make_tiny("llama")))
    lm_head_bytes = cfg.vocab_size * cfg.hidden_size * 4  # float32 on the CPU, either way
    layer_bytes = plain["roofline"]["weight_bytes"] - lm_head_bytes
    assert fp8["roofline"]["weight_bytes"] == layer_bytes // 4 + lm_head_bytes


def test_a_moe_decode_step_reads_the_experts_its_tokens_route_to():
    """Qwen3-30B-A3B: batch 32, top 8 of 128 experts reach about 112 per layer, about 53 GB a
    step in bf16 (issue 28's roofline); batch 1 reads its 8 experts, about 6 GB."""
    cfg = preset("qwen3-30b-a3b")
    cost = ModelCost.of(cfg, 2)
    one_expert = 48 * 3 * 2048 * 768 * 2  # every layer's copy of one expert, bf16
    assert cost.expert_bytes == one_expert
    assert cost.expected_experts(np.array([1, 32]))[0] == pytest.approx(8.0)
    assert cost.expected_experts(np.array([32]))[0] == pytest.approx(111.8, abs=0.1)
    _, moved32, flops32 = step_rooflines(cost, [step_work([1024] * 32, list(range(33)))])
    _, moved1, _ = step_rooflines(cost, [step_work([128], [0, 1])])
    kv32 = 32 * 1025 * cost.kv_bytes_per_token  # 3.2 GB of K/V beside 53 GB of weights
    assert 52e9 < moved32[0] - kv32 < 54e9 and 5.5e9 < moved1[0] < 6.5e9
    # with every expert and the embedding table: the whole model
    embedding = cfg.vocab_size * cfg.hidden_size * 2
    whole = cost.weight_bytes + 128 * one_expert + embedding
    assert whole == pytest.approx(cfg.num_params() * 2, rel=1e-4)  # the norms left out
    assert flops32[0] < 2 * cfg.num_params() * 32  # only the routed experts compute


def test_a_shared_expert_is_read_by_every_step_as_a_dense_mlp(make_tiny):
    """Qwen2-MoE: each MoE layer's shared expert and its gate count in the weights every step
    reads and computes, as in the model's parameters."""
    cfg = ModelConfig.from_hf(read_hf_config(str(make_tiny("qwen2_moe")))[0])
    plain = replace(cfg, shared_expert_intermediate_size=0)
    h, moe_layers = cfg.hidden_size, sum(cfg.moe_layers)
    shared = moe_layers * (3 * h * cfg.shared_expert_intermediate_size + h)
    assert moe_layers == 2 and cfg.shared_expert_intermediate_size == 48
    assert ModelCost.of(cfg, 2).weight_bytes - ModelCost.of(plain, 2).weight_bytes == 2 * shared
    flops = (
        ModelCost.of(cfg, 2).layer_flops_per_token - ModelCost.of(plain, 2).layer_flops_per_token
    )
    assert flops == 2 * shared
    assert cfg.num_params() - plain.num_params() == shared


def test_a_json_schema_run_counts_the_tokens_made_and_compares_at_those_lengths(
    make_tiny, tmp_path
):
    """Each request ends where its grammar does; the unconstrained run then makes exactly as
    many tokens per request, and tok/s divides the tokens actually made."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}  # fmt: skip
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    args = ["--num-prompts", "3", "--input-len", "8", "--output-len", "60"]
    args += ["--json-schema", str(path), "--compare", "unconstrained"]
    report = run_bench(tmp_path, "throughput", "--model", str(make_tiny("qwen3")), *args)
    constrained, unconstrained = (
        report["results"]["async"],
        report["results"]["async unconstrained"],
    )
    assert 3 <= constrained["output_tokens"] < 3 * 60
    assert unconstrained["output_tokens"] == constrained["output_tokens"]
    assert constrained["output_tokens_per_s"] == pytest.approx(
        constrained["output_tokens"] / constrained["seconds"]
    )
    assert report["workload"]["json_schema"] == str(path)
