"""/v1/completions with echo: the prompt's text and logprobs before the completion, as OpenAI's
legacy logprobs object, checked with the official client against transformers (fp32, CPU)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from tandem.async_llm import AsyncLLM
from tandem.server.app import build_app
from test_server import running

transformers = pytest.importorskip("transformers")

MODEL = "tiny-llama"
PROMPT = "Our scheduler reads the queue"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.fixture(scope="module")
def server(folder) -> Iterator[tuple[str, AsyncLLM]]:
    # 8-token steps: a prompt's logprobs come from several chunks
    llm = AsyncLLM.from_model(folder, max_model_len=256, block_size=8, max_num_batched_tokens=8)
    with running(build_app(llm, MODEL)) as url:
        yield url, llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)


@functools.cache
def reference(folder: str, ids: tuple[int, ...]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: transformers' log_softmax predicting each token after the first."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1]


def prompt_ids(server) -> list[int]:
    return server[1].tokenizer.encode(PROMPT)


def assert_offsets_fit_the_text(logprobs, text: str) -> None:
    """Each token starts at its offset, except special tokens the text leaves out (zero-width)."""
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets) and len(offsets) == len(logprobs.tokens)
    for token, offset, following in zip(
        logprobs.tokens, offsets, [*offsets[1:], len(text)], strict=True
    ):
        assert text[offset : offset + len(token)] == token or following == offset, (token, offset)


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client, server, folder):
    ids = prompt_ids(server)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=3
    )
    choice = response.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    tokenizer = server[1].tokenizer
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    rows = reference(folder, tuple(ids))
    for p in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[p] - rows[p - 1, ids[p]].item()) < TOLERANCE
        # keyed by text: ids with the same piece (ids past the tokenizer's) share one key
        top, wanted = logprobs.top_logprobs[p], rows[p - 1].topk(3).values.tolist()
        assert 1 <= len(top) <= 4 and logprobs.tokens[p] in top
        wanted.append(logprobs.token_logprobs[p])
        assert all(min(abs(v - w) for w in wanted) < TOLERANCE for v in top.values())
    assert_offsets_fit_the_text(logprobs, choice.text)
    assert logprobs.text_offset[0] == logprobs.text_offset[1] == 0  # BOS is not in the text


def test_echo_puts_the_prompt_before_the_completion_and_its_logprobs(client, server):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(**args).choices[0]
    echoed = client.completions.create(**args, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text
    num_prompt = len(prompt_ids(server))
    assert len(echoed.logprobs.tokens) == num_prompt + 5
    assert echoed.logprobs.tokens[num_prompt:] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[num_prompt:] == pytest.approx(
        plain.logprobs.token_logprobs, abs=TOLERANCE
    )
    assert_offsets_fit_the_text(echoed.logprobs, echoed.text)
    streamed = client.completions.create(**args, echo=True, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == echoed.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == echoed.logprobs.tokens
    # the first chunk is the prompt and the first token (later chunks place a token by the text
    # streamed so far, which holds back the pieces of an unfinished UTF-8 character)
    first = num_prompt + 1
    assert offsets[:first] == echoed.logprobs.text_offset[:first]
    assert chunks[0].text.startswith(PROMPT)


def test_echo_without_logprobs_returns_text_only(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert response.choices[0].text == PROMPT and response.choices[0].logprobs is None
    generated = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=3, temperature=0
    )
    assert generated.choices[0].text.startswith(PROMPT)
    assert generated.usage.completion_tokens == 3


def test_echo_scores_a_batch_of_token_id_prompts(client, folder):
    prompts = [[1, 50, 60, 70, 80, 90, 100, 110, 120, 130], [1, 300, 200]]
    response = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, max_tokens=0, logprobs=0
    )
    assert len(response.choices) == 2
    for choice in sorted(response.choices, key=lambda c: c.index):
        ids = prompts[choice.index]
        rows = reference(folder, tuple(ids))
        values = choice.logprobs.token_logprobs
        assert values[0] is None
        expected = [rows[p - 1, ids[p]].item() for p in range(1, len(ids))]
        assert values[1:] == pytest.approx(expected, abs=TOLERANCE)
        assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])  # the token alone


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": "sometimes"}, "echo"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": False}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": -2}, "logprobs"),
    ],
)  # fmt: skip
def test_bad_echo_requests_are_400s_naming_the_field(server, path, body, field):
    response = httpx.post(f"{server[0]}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_echo_of_a_truncated_prompt_is_the_part_the_model_read(client, server, folder):
    """truncate_prompt_tokens=3: the echo is the 3 tokens the tokenizer's cut kept (the BOS
    and the prompt's last 2, as transformers' truncation on the left), their text and their
    logprobs (the first of them has none: nothing before it was read)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, truncation_side="left")
    ids = tokenizer(PROMPT, truncation=True, max_length=3).input_ids
    assert ids == prompt_ids(server)[:1] + prompt_ids(server)[-2:]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1,
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    choice = response.choices[0]
    assert response.usage.prompt_tokens == 3
    assert choice.text == server[1].tokenizer.decode(ids, skip_special_tokens=False)
    assert choice.logprobs.token_logprobs[0] is None
    rows = reference(folder, tuple(ids))
    for p in (1, 2):
        assert abs(choice.logprobs.token_logprobs[p] - rows[p - 1, ids[p]].item()) < TOLERANCE
