"""Repetition detection: the check against its definition, and requests that stop where their
output first ends in a repeated n-gram (the tiny random model's greedy outputs fall into loops)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.repetition import RepetitionDetectionParams, ends_in_repetition
from tandem.server.app import build_app
from test_server import running

ENGINE_ARGS = {"max_model_len": 256, "block_size": 8, "dtype": "float32"}
PROMPTS = [[5, 17, 30, 9, 11], [40, 41, 3, 7], [8, 8, 8, 8, 2], [100, 200, 300], [1, 2, 3, 4, 5, 6]]
LONG = 120


def by_definition(tokens: list[int], params: RepetitionDetectionParams) -> bool:
    """Some size in range whose last size x min_count tokens are the last `size` repeated."""
    sizes = range(max(params.min_pattern_size, 1), params.max_pattern_size + 1)
    count = params.min_count
    return any(
        size * count <= len(tokens) and tokens[len(tokens) - size * count :] == tokens[-size:] * count
        for size in sizes
    ) if params.max_pattern_size > 0 else False  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 2), max_size=30),
    st.integers(0, 4),
    st.integers(0, 4),
    st.integers(2, 4),
)
def test_the_check_matches_its_definition(tokens, low, high, count):
    low, high = min(low, high), max(low, high)
    params = RepetitionDetectionParams(max_pattern_size=high, min_pattern_size=low, min_count=count)
    assert ends_in_repetition(tokens, params) == by_definition(tokens, params)


def first_repetition(tokens: list[int], params: RepetitionDetectionParams, min_tokens=0) -> int:
    """The output length at which the check first holds (len + 1: never)."""
    for length in range(max(min_tokens, 1), len(tokens) + 1):
        if by_definition(tokens[:length], params):
            return length
    return len(tokens) + 1


@pytest.fixture(scope="module")
def unstopped(make_tiny) -> tuple[str, list[list[int]]]:
    folder = str(make_tiny("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
    outputs = LLM(folder, **ENGINE_ARGS).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )
    return folder, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("async_batching", [True, False])
@pytest.mark.parametrize(
    ("pattern", "min_tokens"),
    [((1, 1, 3), 0), ((4, 2, 2), 0), ((8, 1, 3), 0), ((2, 1, 4), 0), ((1, 1, 3), 40)],
)
def test_a_request_stops_where_its_output_first_repeats(
    unstopped, async_batching, pattern, min_tokens
):
    folder, full = unstopped
    detect = RepetitionDetectionParams(*pattern)
    stops = [first_repetition(tokens, detect, min_tokens) for tokens in full]
    assert any(stop <= LONG for stop in stops), "no output repeats: the test says nothing"
    params = SamplingParams(
        temperature=0.0, max_tokens=LONG, ignore_eos=True, min_tokens=min_tokens,
        repetition_detection={"max_pattern_size": pattern[0], "min_pattern_size": pattern[1],
                              "min_count": pattern[2]},
    )  # fmt: skip
    llm = LLM(folder, **ENGINE_ARGS, async_batching=async_batching)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for output, tokens, stop in zip(outputs, full, stops, strict=True):
        choice = output.outputs[0]
        if stop <= LONG:
            assert choice.token_ids == tokens[:stop]
            assert (choice.finish_reason, choice.stop_reason) == (
                "repetition",
                "repetition_detected",
            )
        else:
            assert choice.token_ids == tokens
            assert choice.finish_reason == "length"
        assert choice.text == llm.get_tokenizer().decode(choice.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"max_pattern_size": 2, "min_count": 1}, "min_count"),
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size"),
        ({"max_pattern_size": -1}, "max_pattern_size"),
        ({"max_pattern_size": 2, "min_count": 2, "window": 3}, "window"),
    ],
)
def test_bad_repetition_detection_is_a_value_error(fields, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(repetition_detection=fields)


def test_the_server_takes_repetition_detection(unstopped):
    folder, full = unstopped
    detect = {"max_pattern_size": 1, "min_count": 3}
    stop = first_repetition(full[0], RepetitionDetectionParams(**detect))
    assert stop <= LONG
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with running(build_app(llm, "tiny")) as url:
            body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True, "repetition_detection": detect}  # fmt: skip
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            bad = {**body, "repetition_detection": {"max_pattern_size": 2, "min_count": 1}}
            refused = httpx.post(f"{url}/v1/completions", json=bad, timeout=60)
    finally:
        llm.shutdown()
    assert answer["choices"][0]["token_ids"] == full[0][:stop]
    assert answer["choices"][0]["finish_reason"] == "repetition"
    assert refused.status_code == 400 and "min_count" in refused.text
