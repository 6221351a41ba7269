"""Beam search against the same search run directly over transformers' log-softmax (fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tandem import LLM, BeamSearchParams, SamplingParams

ENGINE_ARGS = {"max_model_len": 64, "block_size": 8, "dtype": "float32"}
PROMPTS = [[5, 17, 30, 9, 11], [40, 41, 3, 7], [8, 8, 8, 8, 8, 8, 8, 8, 2]]


@pytest.fixture(scope="module")
def hf_model(make_tiny):
    from transformers import AutoModelForCausalLM

    folder = make_tiny("llama")
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def next_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)


def reference(
    model, prompt, width, max_tokens, eos=(), length_penalty=1.0, max_len=64, ignore_eos=False,
    live_by_score=False,
):  # fmt: skip
    """vLLM's search written out: extend every beam by its 2 x width most likely tokens, keep
    the width best by cumulative logprob (`live_by_score`: by the final ranking's score); EOS
    ends a beam unless `ignore_eos`; the best by cumulative logprob / length ** length_penalty,
    not counting a last EOS, are the answer."""

    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] in eos)) ** length_penalty

    def cumulative(beam):
        return beam[1]

    beams, complete = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        complete += [b for b in beams if len(b[0]) >= max_len]
        beams = [b for b in beams if len(b[0]) < max_len]
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            top = next_logprobs(model, tokens).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                beam = ([*tokens, token], cum + logprob)
                (complete if token in eos and not ignore_eos else candidates).append(beam)
        beams = sorted(candidates, key=score if live_by_score else cumulative, reverse=True)
        beams = beams[:width]
    return sorted(complete + beams, key=score, reverse=True)[:width]


def assert_same(outputs, expected_per_prompt) -> None:
    for output, expected in zip(outputs, expected_per_prompt, strict=True):
        assert [s.tokens for s in output.sequences] == [t for t, _ in expected]
        for sequence, (_, cum) in zip(output.sequences, expected, strict=True):
            assert sequence.cum_logprob == pytest.approx(cum, abs=1e-4)
            generated = sequence.tokens[len(sequence.tokens) - len(sequence.logprobs) :]
            each = [float(top[t]) for top, t in zip(sequence.logprobs, generated, strict=True)]
            assert sum(each) == pytest.approx(sequence.cum_logprob)


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (3, 1.0), (4, 0.5), (2, 2.0)])
def test_beams_equal_the_search_over_transformers_logprobs(hf_model, width, length_penalty):
    folder, model = hf_model
    llm = LLM(str(folder), **ENGINE_ARGS)
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    expected = [reference(model, p, width, 6, length_penalty=length_penalty) for p in PROMPTS]
    assert_same(outputs, expected)
    sequence = outputs[0].sequences[0]
    assert sequence.text == llm.get_tokenizer().decode(sequence.tokens)  # prompt included
    assert sequence.finish_reason == "length"


def test_width_one_is_greedy(hf_model):
    folder, _ = hf_model
    llm = LLM(str(folder), **ENGINE_ARGS)
    [output] = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(1, 8))
    [greedy] = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert output.sequences[0].tokens == PROMPTS[0] + greedy.outputs[0].token_ids


def test_an_eos_ends_its_beam_and_ignore_eos_extends_it(hf_model, tmp_path):
    """The second most likely first token made the model's EOS (generation_config.json): the
    beam through it is complete after one token, scored without the EOS in its length."""
    folder, model = hf_model
    eos_folder = Path(shutil.copytree(folder, tmp_path / "eos"))
    eos = int(next_logprobs(model, PROMPTS[0]).topk(2).indices[1])
    (eos_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    llm = LLM(str(eos_folder), **ENGINE_ARGS)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    for length_penalty in (1.0, 0.0):  # 0: the EOS beam's single logprob wins against sums
        params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty)
        [output] = llm.beam_search(prompt, params)
        expected = reference(model, PROMPTS[0], 3, 5, eos=(eos,), length_penalty=length_penalty)
        assert_same([output], [expected])
        ended = [s for s in output.sequences if s.tokens[-1] == eos]
        assert all(s.finish_reason == "stop" and len(s.logprobs) == 1 for s in ended)
    assert ended  # with length_penalty 0 the one-token beam is among the best
    [output] = llm.beam_search(prompt, BeamSearchParams(3, 5, ignore_eos=True, length_penalty=0.0))
    assert all(len(s.tokens) == len(PROMPTS[0]) + 5 for s in output.sequences)


def test_live_beams_are_kept_by_their_sum_of_logprobs_as_in_vllm(hf_model, tmp_path):
    """With ignore_eos a live beam may end in an EOS, which the length penalty's score counts one
    token shorter: the beams kept each round are the best by cumulative logprob all the same
    (found by search: EOS 327 and this prompt keep other beams when ranked by score)."""
    folder, model = hf_model
    eos_folder = Path(shutil.copytree(folder, tmp_path / "eos"))
    (eos_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 327}))
    prompt, args = [139, 176], (3, 5, (327,), 3.0)
    expected = reference(model, prompt, *args, ignore_eos=True)
    assert expected != reference(model, prompt, *args, ignore_eos=True, live_by_score=True)
    llm = LLM(str(eos_folder), **ENGINE_ARGS)
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=3.0, ignore_eos=True)
    assert_same(llm.beam_search([{"prompt_token_ids": prompt}], params), [expected])


def test_beams_stop_at_the_context_length(hf_model):
    folder, model = hf_model
    llm = LLM(str(folder), **{**ENGINE_ARGS, "max_model_len": 8})
    [output] = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(2, 10))
    assert [s.tokens for s in output.sequences] == [
        t for t, _ in reference(model, PROMPTS[0], 2, 10, max_len=8)
    ]
    assert all(len(s.tokens) == 8 for s in output.sequences)


def test_a_concurrency_limit_searches_a_few_prompts_at_a_time_to_the_same_beams(hf_model):
    folder, _ = hf_model
    llm = LLM(str(folder), **ENGINE_ARGS)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    together = llm.beam_search(prompts, params)
    apart = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in apart] == [
        [s.tokens for s in o.sequences] for o in together
    ]


@pytest.mark.parametrize(
    ("params", "error"),
    [
        (BeamSearchParams(beam_width=11, max_tokens=4), "at most 10"),
        (BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
        (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
        (BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
        (BeamSearchParams(2, 4, temperature=3.0), r"temperature must be in \[0, 2\]"),
        (BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=object()), "structured"),
        (BeamSearchParams(2, 4, length_penalty=float("nan")), "length_penalty must be finite"),
        (BeamSearchParams(2, 4, ignore_eos="no"), "ignore_eos must be True or False"),  # was on
        (BeamSearchParams(2, 4, include_stop_str_in_output=3), "include_stop_str_in_output"),
    ],
)
def test_bad_params_are_value_errors(hf_model, params, error):
    folder, _ = hf_model
    llm = LLM(str(folder), **ENGINE_ARGS)
    with pytest.raises(ValueError, match=error):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)


@pytest.mark.parametrize("params", [None, {"beam_width": 2}, SamplingParams(max_tokens=4)])
def test_params_other_than_beam_search_params_are_a_type_error(hf_model, params):
    llm = LLM(str(hf_model[0]), **ENGINE_ARGS)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)


def test_a_prompt_filling_the_context_is_a_value_error(hf_model):
    folder, _ = hf_model
    llm = LLM(str(folder), **{**ENGINE_ARGS, "max_model_len": 8})
    with pytest.raises(ValueError, match="max_model_len=8"):
        llm.beam_search([{"prompt_token_ids": list(range(3, 11))}], BeamSearchParams(2, 2))


@pytest.fixture(scope="module")
def server(hf_model):
    from tandem.async_llm import AsyncLLM
    from tandem.server.app import build_app
    from test_server import running

    folder, _ = hf_model
    llm = AsyncLLM.from_model(str(folder), **ENGINE_ARGS)
    try:
        with running(build_app(llm, "tiny")) as url:
            yield url
    finally:
        llm.shutdown()


def test_the_servers_use_beam_search_answers_the_best_beams(hf_model, server):
    """vLLM's use_beam_search: n beams per prompt, the generated part of each, best first, as
    the offline search finds them."""
    import httpx

    folder, _ = hf_model
    llm = LLM(str(folder), **ENGINE_ARGS)
    offline = llm.beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]],
        BeamSearchParams(beam_width=3, max_tokens=5, temperature=0.0),
    )
    body = {"model": "tiny", "prompt": PROMPTS[:2], "max_tokens": 5, "n": 3, "temperature": 0.0,
            "use_beam_search": True}  # fmt: skip
    answer = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in answer["choices"]]
    tokenizer = llm.get_tokenizer()
    want = [
        tokenizer.decode(s.tokens[len(p) :], skip_special_tokens=True)
        for p, out in zip(PROMPTS[:2], offline, strict=True)
        for s in out.sequences
    ]
    assert texts == want and answer["usage"]["completion_tokens"] == 6 * 5
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 4,
            "n": 2, "temperature": 0.0, "use_beam_search": True}  # fmt: skip
    choices = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in choices)
    text_format = {**chat, "response_format": {"type": "text"}}  # constrains nothing: taken
    same = httpx.post(f"{server}/v1/chat/completions", json=text_format, timeout=60).json()
    assert [c["message"] for c in same["choices"]] == [c["message"] for c in choices]


def test_streamed_beam_search_sends_the_whole_answer_as_vllm_does(server):
    """With stream, vLLM's events: a completion's whole response as one event, a chat's as each
    choice's role chunk then its text and finish reason (then usage where asked); [DONE] last.
    The texts are those of the same request unstreamed."""
    import httpx

    from tandem.server.response_output import sse_data

    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "n": 2, "temperature": 0.0,
            "use_beam_search": True}  # fmt: skip
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    streamed = httpx.post(f"{server}/v1/completions", json=body | {"stream": True}, timeout=60)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n")
    [event] = sse_data(streamed.text)
    assert event["object"] == "text_completion"
    assert event["choices"] == whole["choices"] and event["usage"] == whole["usage"]

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 4,
            "n": 2, "temperature": 0.0, "use_beam_search": True}  # fmt: skip
    whole = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).json()
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    streamed = httpx.post(f"{server}/v1/chat/completions", json=chat | usage, timeout=60)
    assert streamed.text.endswith("data: [DONE]\n\n")
    events = sse_data(streamed.text)
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    roles = [c["delta"].get("role") for e in events[:2] for c in e["choices"]]
    texts = {c["index"]: c["delta"]["content"] for e in events[2:4] for c in e["choices"]}
    finish = {c["index"]: c["finish_reason"] for e in events[2:4] for c in e["choices"]}
    assert roles == ["assistant", "assistant"]
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert events[4]["choices"] == [] and events[4]["usage"] == whole["usage"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 2}, "logprobs"),
        ({"n": 11}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_beam_search_refuses_what_it_does_not_take_with_a_400(server, extra, param):
    import httpx

    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "use_beam_search": True}
    response = httpx.post(f"{server}/v1/completions", json={**body, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_length_penalty_that_is_not_finite_is_a_400_naming_it(server, value):
    import httpx

    body = (
        f'{{"model": "tiny", "prompt": "hi", "max_tokens": 3, "use_beam_search": true, "n": 2, '
        f'"length_penalty": {value}}}'
    )  # JSON has no NaN, but Python's parser takes it
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{server}/v1/completions", content=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "length_penalty"
    assert "finite" in response.json()["error"]["message"]
