"""Reasoning parsers: a chat answer's thinking apart from its content, whole and streamed (any
cut of the text into deltas gives the whole answer's split), and through the server, where a
regex constraint makes the tiny random model write a thinking part."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import pytest

from tandem.async_llm import AsyncLLM
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.server.reasoning import PARSERS, split
from test_server import running

# (parser, enable_thinking, answer text) -> (reasoning, content), as vLLM's parsers split them
CASES = [
    ("deepseek_r1", True, "<think>\nabc\n</think>\n\nHello", ("\nabc\n", "\n\nHello")),
    ("deepseek_r1", True, "abc</think>Hi", ("abc", "Hi")),  # <think> was in the prompt
    ("deepseek_r1", True, "only thoughts, cut off", ("only thoughts, cut off", "")),
    ("deepseek_r1", False, "abc</think>Hi", ("abc", "Hi")),  # R1 always thinks
    ("deepseek_r1", True, "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", True, "x <thin", ("x <thin", "")),  # a tag cut off stays text
    ("qwen3", True, "<think>plan</think>Answer", ("plan", "Answer")),
    ("qwen3", True, "plan<tool_call>{}</tool_call>", ("plan", "<tool_call>{}</tool_call>")),
    ("qwen3", False, "<think>x</think>Answer", ("", "<think>x</think>Answer")),
    ("qwen3", True, "  <think>p</think>", ("p", "")),
    ("qwen3", True, "", ("", "")),
]


def feed_in_pieces(parser: str, thinking: bool, pieces: list[str]) -> tuple[str, str]:
    splitter = PARSERS[parser].splitter({"enable_thinking": thinking})
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(("parser", "thinking", "text", "expected"), CASES)
def test_a_whole_answer_splits_as_vllm_splits_it(parser, thinking, text, expected):
    reasoning, content = split(PARSERS[parser].splitter({"enable_thinking": thinking}), text)
    assert (reasoning or "", content) == expected


@pytest.mark.parametrize(("parser", "thinking", "text", "expected"), CASES)
def test_any_cut_into_deltas_gives_the_whole_answers_split(parser, thinking, text, expected):
    cuts = list(itertools.combinations(range(1, len(text)), 2))
    for a, b in cuts or [(len(text), len(text))]:
        assert feed_in_pieces(parser, thinking, [text[:a], text[a:b], text[b:]]) == expected
    assert feed_in_pieces(parser, thinking, [*text, ""]) == expected  # a character at a time


def test_a_constrained_answer_thinks_only_if_it_opens_with_the_tag():
    splitter = PARSERS["qwen3"].splitter(None, must_open=True)
    assert split(splitter, '{"a": 1}') == (None, '{"a": 1}')
    splitter = PARSERS["qwen3"].splitter(None, must_open=True)
    assert split(splitter, "<think>hm</think>{}") == ("hm", "{}")


def test_an_unknown_reasoning_parser_is_a_value_error():
    with pytest.raises(ValueError, match="qwen3"):
        ServerOptions(reasoning_parser="qwen4").validate()


THINKING = "<think>[a-z]{4}</think>[A-Z][a-z]{2}"  # what the regex makes the model write


@pytest.fixture(scope="module")
def server(make_tiny) -> Iterator[str]:
    llm = AsyncLLM.from_model(str(make_tiny("llama")), max_model_len=256, dtype="float32")
    try:
        with running(
            build_app(llm, "tiny", options=ServerOptions(reasoning_parser="qwen3"))
        ) as url:
            yield url
    finally:
        llm.shutdown()


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 24,
            "temperature": 0.0, **fields}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def streamed(url: str, **fields) -> tuple[str, str]:
    reasoning, content = "", ""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 24,
            "temperature": 0.0, "stream": True, **fields}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
    return reasoning, content


def test_the_server_puts_the_thinking_in_message_reasoning(server):
    constrained = {"structured_outputs": {"regex": THINKING}}
    message = chat(server, **constrained).json()["choices"][0]["message"]
    assert len(message["reasoning"]) == 4 and message["reasoning"].isalpha()
    assert len(message["content"]) == 3 and message["content"][0].isupper()
    assert streamed(server, **constrained) == (message["reasoning"], message["content"])
    hidden = chat(server, include_reasoning=False, **constrained).json()["choices"][0]["message"]
    assert hidden["reasoning"] is None and hidden["content"] == message["content"]


def test_the_thinking_runs_until_the_end_tag_unless_the_template_turns_it_off(server):
    """Without a constraint the answer thinks from its first token (a thinking template opens
    <think> in the prompt); the random model never closes it, so all of it is reasoning.
    enable_thinking false, or reasoning_effort "none", makes it all content."""
    thought = chat(server).json()["choices"][0]["message"]
    assert thought["reasoning"] and thought["content"] is None
    for fields in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        said = chat(server, **fields).json()["choices"][0]["message"]
        assert said["reasoning"] is None and said["content"]
    assert chat(server, reasoning_effort="sometimes").status_code == 400


def test_a_constrained_answer_without_the_tag_is_all_content(server):
    regex = {"structured_outputs": {"regex": "[a-z]{5}"}}
    message = chat(server, **regex).json()["choices"][0]["message"]
    assert message["reasoning"] is None and len(message["content"]) == 5
