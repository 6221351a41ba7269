"""vLLM's flat_logprobs: a request's logprobs as one FlatLogprobs of flat lists, holding entry
for entry what the list of {id: Logprob} dicts holds, with a handful of objects for the garbage
collector where the dicts give it two per position."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest

from tandem import LLM, Logprob, SamplingParams
from tandem.outputs import FlatLogprobs, no_text, sample_logprobs

PROMPTS = ["The quick brown fox", "Paged attention keeps"]


@pytest.fixture(scope="module")
def llm(make_tiny) -> LLM:
    return LLM(str(make_tiny("llama")), max_model_len=128)


def described(entries) -> list:
    """Entries as plain values, so that rank and decoded_token are compared too."""
    return [
        None if e is None else [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()]
        for e in entries
    ]


@pytest.mark.parametrize(
    "fields",
    [{"logprobs": 3, "prompt_logprobs": 2}, {"logprob_token_ids": [0, 7, 300]},
     {"logprobs": 0, "detokenize": False}],
    ids=["top", "named", "no-text"],
)  # fmt: skip
def test_flat_logprobs_hold_the_entries_of_the_dict_form(llm, fields):
    params = SamplingParams(n=2, seed=4, max_tokens=9, ignore_eos=True, **fields)
    dicts = llm.generate(PROMPTS, params, use_tqdm=False)
    flat = llm.generate(PROMPTS, replace(params, flat_logprobs=True), use_tqdm=False)
    for a, b in zip(dicts, flat, strict=True):
        for sample_a, sample_b in zip(a.outputs, b.outputs, strict=True):
            assert sample_b.token_ids == sample_a.token_ids
            assert isinstance(sample_b.logprobs, FlatLogprobs)
            assert len(sample_b.logprobs) == len(sample_a.logprobs) == 9
            assert described(sample_b.logprobs) == described(sample_a.logprobs)
            assert sample_b.cumulative_logprob == sample_a.cumulative_logprob
        if params.prompt_logprobs is None:
            assert b.prompt_logprobs is None
        else:
            assert isinstance(b.prompt_logprobs, FlatLogprobs)
            assert b.prompt_logprobs[0] is None
            assert described(b.prompt_logprobs) == described(a.prompt_logprobs)


def entries_of(positions: int) -> tuple[list[dict[int, float]], list[int], list[int]]:
    """An engine's raw entries: the top 2 ids, then the sampled one where it ranked lower."""
    entries = [{p: -0.5, p + 1: -1.5, p + 7: -4.0} for p in range(positions)]
    return entries, [p + 7 for p in range(positions)], [9] * positions


def test_a_flat_rollout_gives_the_collector_a_handful_of_objects():
    entries, tokens, ranks = entries_of(20_000)
    counts = []
    for flat in (True, False):
        gc.disable()
        try:
            before = len(gc.get_objects())
            built = sample_logprobs(entries, tokens, ranks, 2, no_text, flat)
            counts.append(len(gc.get_objects()) - before)
        finally:
            gc.enable()
        assert len(built) == 20_000
    assert counts[0] <= 10 and counts[1] >= 2 * 20_000


def test_indexing_slicing_joining_and_copying_a_flat_sequence():
    entries, tokens, ranks = entries_of(6)
    whole = sample_logprobs(entries, tokens, ranks, 2, no_text, flat=True)
    listed = sample_logprobs(entries, tokens, ranks, 2, no_text)
    assert described(whole) == described(listed)
    assert whole[-1] == listed[-1] and whole[2][9].rank == 9  # the sampled id's own rank
    assert [whole[2][2].rank, whole[2][3].rank] == [1, 2]
    assert described(whole[1:4]) == described(listed[1:4])
    joined = whole[:2] + whole[2:]
    joined += [None, {5: Logprob(-0.25, 1, "x")}]
    assert described(joined) == described([*listed, None, {5: Logprob(-0.25, 1, "x")}])
    copy = whole.copy()
    copy += whole
    assert (len(copy), len(whole)) == (12, 6)
    with pytest.raises(IndexError):
        whole[6]


def test_flat_logprobs_must_be_a_bool():
    with pytest.raises(ValueError, match="flat_logprobs must be True or False"):
        SamplingParams(flat_logprobs="yes")
