"""vLLM's token-in, token-out endpoint (/inference/v1/generate) against the offline API on the
same model: the same tokens and logprobs, whole and streamed, and its 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.server.app import build_app
from test_server import running

ENGINE_ARGS = {"max_model_len": 128, "dtype": "float32"}
PROMPT = [1, 2, 3, 40, 41]


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.fixture(scope="module")
def url(folder) -> Iterator[str]:
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with running(build_app(llm, "tiny")) as served:
            yield served
    finally:
        llm.shutdown()


def generate(url: str, **body) -> httpx.Response:
    content = json.dumps(body)  # escapes as JSON may hold them: a lone surrogate too
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}/inference/v1/generate", content=content, headers=headers, timeout=60)


def test_tokens_and_logprobs_are_the_offline_apis(url, folder):
    fields = {"seed": 7, "temperature": 1.0, "max_tokens": 9, "n": 3, "logprobs": 2,
              "prompt_logprobs": 1, "ignore_eos": True}  # fmt: skip
    response = generate(url, token_ids=PROMPT, sampling_params=fields, request_id="r1")
    assert response.status_code == 200, response.text
    body = response.json()
    [offline] = LLM(folder, **ENGINE_ARGS).generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(**fields), use_tqdm=False
    )
    assert body["request_id"] == "generate-tokens-r1" and body["model"] == "tiny"
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 27
    assert len(body["choices"]) == 3
    for choice, sample in zip(body["choices"], offline.outputs, strict=True):
        assert choice["token_ids"] == sample.token_ids
        assert choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in sample.token_ids]
        for entry, expected, token in zip(content, sample.logprobs, sample.token_ids, strict=True):
            assert entry["logprob"] == pytest.approx(expected[token].logprob, abs=1e-5)
            tops = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
            wanted = {f"token_id:{t}": lp.logprob for t, lp in expected.items() if lp.rank <= 2}
            assert tops == pytest.approx(wanted, abs=1e-5)
    prompt_logprobs = body["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    for entry, expected in zip(prompt_logprobs[1:], offline.prompt_logprobs[1:], strict=True):
        assert {int(t): e["logprob"] for t, e in entry.items()} == pytest.approx(
            {t: lp.logprob for t, lp in expected.items()}, abs=1e-5
        )


def test_a_stream_sends_the_same_tokens_then_usage(url):
    fields = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    whole = generate(url, token_ids=PROMPT, sampling_params=fields).json()["choices"][0]
    streamed = generate(url, token_ids=PROMPT, sampling_params=fields, stream=True,
                        stream_options={"include_usage": True})  # fmt: skip
    assert streamed.status_code == 200
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
    assert tokens == whole["token_ids"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_left_out_max_tokens_fills_the_context(url):
    body = generate(url, token_ids=PROMPT, sampling_params={"ignore_eos": True}).json()
    assert len(body["choices"][0]["token_ids"]) == ENGINE_ARGS["max_model_len"] - len(PROMPT)
    assert body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids.1"),
        ({"token_ids": [1, 10**6]}, "token_ids"),  # outside the vocabulary: the engine's check
        ({"token_ids": [1], "sampling_params": {"tempature": 1}}, "sampling_params.tempature"),
        ({"token_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 1000}}, "sampling_params.max_tokens"),
        ({"token_ids": [1], "priority": 2}, "priority"),
        ({"token_ids": [1], "stream_options": {"include_usage": True}}, "stream_options"),
        ({"token_ids": [1], "stream": True, "sampling_params": {"prompt_logprobs": 1}},
         "sampling_params"),
        ({"token_ids": [1], "model": "other"}, "model"),
        ({"token_ids": [1], "prompt": "x"}, "prompt"),
        ({"token_ids": [1], "request_id": "\udcff"}, "request_id"),  # no UTF-8 answer holds it
    ],
)  # fmt: skip
def test_bad_requests_are_400s_and_the_server_goes_on(url, body, param):
    response = generate(url, **body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param
    assert generate(url, token_ids=[1], sampling_params={"max_tokens": 2}).status_code == 200


# ---- the render endpoints ----------------------------------------------------------------------


def post(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": "tiny", **body}, timeout=60)


def test_a_rendered_completion_generates_what_the_completion_does(url):
    fields = {"max_tokens": 7, "temperature": 0.8, "seed": 3, "logit_bias": {"220": 5.0},
              "logprobs": 1, "stop_token_ids": [2]}  # fmt: skip
    prompts = ["The quick brown fox", "Hello, café"]
    answer = post(url, "/v1/completions", prompt=prompts, return_token_ids=True, **fields).json()
    response = post(url, "/v1/completions/render", prompt=prompts, **fields)
    assert response.status_code == 200, response.text
    rendered = response.json()
    tokenized = post(url, "/tokenize", prompt=prompts[1]).json()["tokens"]
    assert len(rendered) == 2 and rendered[1]["token_ids"] == tokenized
    assert rendered[0]["sampling_params"]["logit_bias"] == {"220": 5.0}
    for request, choice in zip(rendered, answer["choices"], strict=True):
        out = generate(url, **request).json()["choices"][0]
        assert out["token_ids"] == choice["token_ids"]
        assert [c["logprob"] for c in out["logprobs"]["content"]] == pytest.approx(
            choice["logprobs"]["token_logprobs"], abs=1e-5
        )


def test_a_rendered_chat_holds_its_template_and_generates_what_the_chat_does(url):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    fields = {"messages": messages, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    rendered = post(url, "/v1/chat/completions/render", **fields).json()
    tokenized = post(url, "/tokenize", messages=messages).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["sampling_params"]["max_tokens"] == 6
    answer = post(url, "/v1/chat/completions", return_token_ids=True, **fields).json()
    out = generate(url, **rendered).json()["choices"][0]
    assert out["token_ids"] == answer["choices"][0]["token_ids"]


def test_a_render_gives_token_offsets_of_text_prompts_where_asked(url, folder):
    """vLLM's return_token_offsets: each token's (start, end) characters in its text prompt (the
    rendered template for a chat), as the tokenizer's offset mapping gives them; null for a
    prompt of ids, and unless asked. The render, offsets and all, still generates."""
    reference = AutoTokenizer.from_pretrained(folder)
    text = "The quick brown fox"

    def render(prompt, **fields):
        return post(url, "/v1/completions/render", prompt=prompt, max_tokens=3, **fields).json()

    assert [r["token_offsets"] for r in render([text, "café"])] == [None, None]
    rendered = render([text, "café"], return_token_offsets=True)
    for given, got in zip([text, "café"], rendered, strict=True):
        expected = reference(given, return_offsets_mapping=True)
        assert got["token_ids"] == expected["input_ids"]  # a BOS first: (0, 0)
        assert got["token_offsets"] == [list(pair) for pair in expected["offset_mapping"]]
    assert render([5, 6, 7], return_token_offsets=True)[0]["token_offsets"] is None
    assert generate(url, **rendered[0]).status_code == 200
    messages = [{"role": "user", "content": "Hi café"}]
    chat = post(url, "/v1/chat/completions/render", messages=messages, return_token_offsets=True)
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference(text, add_special_tokens=False, return_offsets_mapping=True)
    assert chat.json()["token_ids"] == expected["input_ids"]
    assert chat.json()["token_offsets"] == [list(pair) for pair in expected["offset_mapping"]]
    assert chat.json()["assistant_tokens_mask"] is None  # not asked (nor tagged: below)


# an assistant-loss template: the assistant's turns in {% generation %} tags
MARKED_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_chat_render_marks_the_assistants_tokens_as_the_tokenizer_does(folder):
    """vLLM's return_assistant_tokens_mask on /v1/chat/completions/render: transformers'
    assistant_masks of the rendered prompt under a template with {% generation %} tags (0 for a
    BOS that add_special_tokens put first); null under a template without them."""
    from tandem.server.options import ServerOptions

    reference = AutoTokenizer.from_pretrained(folder)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello café"},
        {"role": "user", "content": "More"},
    ]
    options = ServerOptions(chat_template=MARKED_TEMPLATE, trust_request_chat_template=True)
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with running(build_app(llm, "tiny", options=options)) as served:
            body = {"messages": messages, "return_assistant_tokens_mask": True, "max_tokens": 3}
            rendered = post(served, "/v1/chat/completions/render", **body).json()
            expected = reference.apply_chat_template(
                messages, chat_template=MARKED_TEMPLATE, add_generation_prompt=True,
                return_dict=True, return_assistant_tokens_mask=True,
            )  # fmt: skip
            assert rendered["token_ids"] == expected["input_ids"]
            assert rendered["assistant_tokens_mask"] == expected["assistant_masks"]
            assert 0 < sum(rendered["assistant_tokens_mask"]) < len(rendered["token_ids"])
            with_bos = post(
                served, "/v1/chat/completions/render", add_special_tokens=True, **body
            ).json()
            assert with_bos["token_ids"][1:] == expected["input_ids"]
            assert with_bos["assistant_tokens_mask"] == [0, *expected["assistant_masks"]]
            assert generate(served, **rendered).status_code == 200  # taken back as given
            plain = MARKED_TEMPLATE.replace("{% generation %}", "").replace(
                "{% endgeneration %}", ""
            )
            untagged = post(
                served, "/v1/chat/completions/render", chat_template=plain, **body
            ).json()
            assert untagged["assistant_tokens_mask"] is None
    finally:
        llm.shutdown()


def test_a_chat_answers_with_its_rendered_prompt_where_asked(url, folder):
    """vLLM's return_prompt_text: the chat-templated prompt beside the answer, and in each
    choice's first chunk of a stream; absent unless asked."""
    reference = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Hi café"}]
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    fields = {"messages": messages, "max_tokens": 3, "n": 2}
    answer = post(url, "/v1/chat/completions", return_prompt_text=True, **fields).json()
    assert answer["prompt_text"] == text
    assert "prompt_text" not in post(url, "/v1/chat/completions", **fields).json()
    stream = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny", "stream": True, "return_prompt_text": True, **fields},
        timeout=60,
    )
    chunks = [
        json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")
    ]
    shown = [c["choices"][0]["index"] for c in chunks if "prompt_text" in c]
    assert sorted(shown) == [0, 1] and all(
        c["prompt_text"] == text for c in chunks if "prompt_text" in c
    )


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/v1/completions/render", {"prompt": "Hi", "use_beam_search": True, "n": 2}, 400,
         "use_beam_search"),
        ("/v1/completions/render", {"prompt": "Hi", "model": "other"}, 404, "model"),
        ("/v1/chat/completions/render", {"messages": []}, 400, "messages"),
        ("/v1/completions/render", {"prompt": "Hi", "max_tokens": 500}, 400, "max_tokens"),
    ],
)  # fmt: skip
def test_bad_render_requests_are_errors(url, route, body, status, param):
    response = post(url, route, **body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
