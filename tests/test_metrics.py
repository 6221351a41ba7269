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
