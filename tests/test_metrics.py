"""The engine's counters and gauges: LLM.get_metrics (vLLM's) counts what was served, by a direct
count of the outputs, under the names the server's /metrics gives."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.metrics import FINISH_REASONS, HELP, Counter, Gauge


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def by_key(metrics) -> dict:
    return {(m.name, tuple(sorted(m.labels.items()))): m.value for m in metrics}


def test_get_metrics_counts_the_tokens_made_and_requests_finished(folder):
    llm = LLM(folder, max_model_len=64, block_size=8)
    start = by_key(llm.get_metrics())
    assert start[("tandem_generation_tokens", ())] == 0
    assert start[("tandem_num_requests_running", ())] == 0
    every_id = list(range(llm.engine.model_config.vocab_size))  # the first token stops it
    params = [SamplingParams(max_tokens=5, ignore_eos=True, seed=1),
              SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=2),
              SamplingParams(max_tokens=4, stop_token_ids=every_id)]  # fmt: skip
    outs = llm.generate(["Hello there", "Paged attention", "Our scheduler"], params, use_tqdm=False)
    metrics = llm.get_metrics()
    got = by_key(metrics)
    samples = [c for o in outs for c in o.outputs]
    assert got[("tandem_generation_tokens", ())] == sum(len(c.token_ids) for c in samples)
    prompts = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outs)
    assert got[("tandem_prompt_tokens", ())] == prompts
    reasons = {}
    for c in samples:
        reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
    finished = {
        dict(k[1])["finished_reason"]: v for k, v in got.items() if k[0] == "tandem_request_success"
    }
    assert {r: n for r, n in finished.items() if n} == reasons  # vLLM's name and label
    assert reasons["stop"] == 1 and reasons["length"] == 3
    assert set(finished) == set(FINISH_REASONS)  # each reason from 0, as vLLM's
    assert got[("tandem_kv_cache_usage_perc", ())] == 0.0
    assert got[("tandem_prefix_cache_queries", ())] >= got[("tandem_prefix_cache_hits", ())] > 0
    kinds = {m.name: type(m) for m in metrics}
    assert (
        kinds["tandem_num_requests_waiting"] is Gauge and kinds["tandem_num_preemptions"] is Counter
    )
    assert set(kinds) == set(HELP)  # every name /metrics describes


def test_prefix_cache_counters_count_first_lookups_alone_as_vllm(folder):
    """vLLM records a lookup only where the cache is read: not with caching off, not for a
    request that skips reading it (prompt logprobs), not again for a preempted request finding
    its own blocks; by a direct count of the prompts."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [list(range(5 + 9 * i, 5 + 9 * i + 16)) for i in range(4)]  # nothing shared
    counted = []
    for extra, logprobs in (({"enable_prefix_caching": False}, None), ({}, 1)):
        llm = LLM(folder, max_model_len=64, block_size=4, **extra)
        with_logprobs = SamplingParams(**{**vars(params), "prompt_logprobs": logprobs})
        llm.generate([{"prompt_token_ids": p} for p in prompts], with_logprobs, use_tqdm=False)
        counted.append(by_key(llm.get_metrics()))
    for got in counted:
        assert (
            got[("tandem_prefix_cache_queries", ())] == got[("tandem_prefix_cache_hits", ())] == 0
        )
    # too few blocks for the four at once: preempted (recomputed) requests find their own blocks
    llm = LLM(folder, max_model_len=48, block_size=4, num_blocks=14, preemption_mode="recompute")
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = by_key(llm.get_metrics())
    assert got[("tandem_num_preemptions", ())] > 0
    assert got[("tandem_prefix_cache_queries", ())] == 4 * 16
    assert got[("tandem_prefix_cache_hits", ())] == 0


def test_swapped_requests_count_as_waiting_and_pooled_ones_finish_stopped(folder, make_tiny):
    """A request swapped out to the host waits for the device again: vLLM counts it waiting
    (running + waiting = unfinished); a pooled request finishes "stop", as vLLM's."""
    llm = LLM(folder, max_model_len=48, block_size=4, num_blocks=14, preemption_mode="swap",
              swap_space=1)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        llm.engine.enqueue(llm.engine.make_request(str(i), params, None, list(range(3, 19))))
    seen_swapped = False
    while llm.engine.has_unfinished():
        llm.engine.step()
        stats = llm.engine.stats()
        unfinished = sum(not r.finished for r in llm.engine.requests.values())
        assert stats.num_running + stats.num_waiting == unfinished
        seen_swapped |= bool(llm.engine.scheduler.swapped)
    assert seen_swapped
    embedder = LLM(str(make_tiny("llama")), max_model_len=64, runner="pooling")
    embedder.embed(["Hello there", "Paged attention"], use_tqdm=False)
    finished = by_key(embedder.get_metrics())
    assert finished[("tandem_request_success", (("finished_reason", "stop"),))] == 2
    assert finished[("tandem_request_success", (("finished_reason", "length"),))] == 0
