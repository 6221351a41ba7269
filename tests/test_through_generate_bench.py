"""benchmarks/through_generate.py: on the tiny model each run makes and counts every sample's new
tokens; a run's chat prompts share one head, and the next run's have another."""

from __future__ import annotations

import pytest

from benchmark_script import import_benchmark

through_generate = import_benchmark("through_generate")


@pytest.mark.parametrize("workload", ["chat", "rollout"])
def test_each_run_counts_the_tokens_it_made(make_tiny, workload, capsys):
    runs = through_generate.main(
        [workload, "--model", str(make_tiny("llama")), "--load-format", "auto", "--runs", "2",
         "--scale", "0.03", "--max-num-seqs", "16"]
    )  # fmt: skip
    count, _, _, n, new = through_generate.WORKLOADS[workload]
    made = round(count * 0.03) * n * round(new * 0.03)
    assert [r["run"] for r in runs] == [0, 1]
    assert [r["tokens"] for r in runs] == [made, made]
    assert capsys.readouterr().out.count('"workload"') == 2


@pytest.mark.parametrize("flat", [[], ["--flat-logprobs"]], ids=["dicts", "flat"])
def test_with_logprobs_every_sample_position_brings_its_entry(make_tiny, flat):
    [run] = through_generate.main(
        ["rollout", "--model", str(make_tiny("llama")), "--load-format", "auto", "--runs", "1",
         "--scale", "0.03", "--max-num-seqs", "16", "--logprobs", "0", *flat]
    )  # fmt: skip
    assert run["logprob_entries"] == run["tokens"] > 0


def test_chat_prompts_share_their_head_and_differ_after_it():
    a = through_generate.prompts(3, 40, 8, 100, seed=1)
    b = through_generate.prompts(1, 40, 8, 100, seed=2)
    heads = {tuple(p["prompt_token_ids"][:40]) for p in a}
    assert len(heads) == 1 and all(len(p["prompt_token_ids"]) == 48 for p in a)
    assert len({tuple(p["prompt_token_ids"][40:]) for p in a}) == 3
    assert tuple(b[0]["prompt_token_ids"][:40]) not in heads  # a new head each run
