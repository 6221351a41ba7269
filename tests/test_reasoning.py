"""Reasoning parsers: a chat answer's thinking apart from its content, whole and streamed (any
cut of the text into deltas gives the whole answer's split), and through the server, where a
regex constraint makes the tiny random model write a thinking part."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Iterator

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.reasoning import PARSERS, ThinkTokens, split
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.tokenizer import Tokenizer
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
    # thinking that mentions the tag goes on to its </think>, which wins (vLLM's)
    (
        "qwen3",
        True,
        "<think>wrap it in <tool_call> tags</think>\n\nNoon.",
        ("wrap it in <tool_call> tags", "\n\nNoon."),
    ),
    (
        "qwen3",
        True,
        "a <tool_call> b</think><tool_call>{}</tool_call>",
        ("a <tool_call> b", "<tool_call>{}</tool_call>"),
    ),
    ("qwen3", False, "<think>x</think>Answer", ("", "<think>x</think>Answer")),
    ("qwen3", True, "  <think>p</think>", ("p", "")),
    ("qwen3", True, "", ("", "")),
]


def test_a_call_without_end_tag_streams_once_it_closes_not_at_the_answers_end():
    """qwen3: text from a <tool_call> is held while a </think> may still come; once the call
    closes with none, it and what follows stream as they come."""
    splitter = PARSERS["qwen3"].splitter(True, {"enable_thinking": True})
    text = "plan<tool_call>{}</tool_call> then more words"
    pieces = [splitter.feed(ch, final=False) for ch in text]
    seen = "".join(content for _, content in pieces)
    assert seen == "<tool_call>{}</tool_call> then more words"
    assert "".join(reasoning for reasoning, _ in pieces) == "plan"


def feed_in_pieces(parser: str, thinking: bool, pieces: list[str]) -> tuple[str, str]:
    splitter = PARSERS[parser].splitter(True, {"enable_thinking": thinking})
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(("parser", "thinking", "text", "expected"), CASES)
def test_a_whole_answer_splits_as_vllm_splits_it(parser, thinking, text, expected):
    reasoning, content = split(PARSERS[parser].splitter(True, {"enable_thinking": thinking}), text)
    assert (reasoning or "", content) == expected


@pytest.mark.parametrize(("parser", "thinking", "text", "expected"), CASES)
def test_any_cut_into_deltas_gives_the_whole_answers_split(parser, thinking, text, expected):
    cuts = list(itertools.combinations(range(1, len(text)), 2))
    for a, b in cuts or [(len(text), len(text))]:
        assert feed_in_pieces(parser, thinking, [text[:a], text[a:b], text[b:]]) == expected
    assert feed_in_pieces(parser, thinking, [*text, ""]) == expected  # a character at a time


def test_a_prompt_closes_the_thinking_when_its_last_tag_is_the_end_tag():
    think = ThinkTokens(start=7, end=8)
    assert not think.ended([1, 2, 3]) and not think.ended([8, 1, 7, 4])
    assert think.ended([7, 5, 8, 2]) and think.ended([8])
    splitter = PARSERS["deepseek_r1"].splitter(thinking=False)  # the prompt closed it
    assert split(splitter, "plain</think>x") == (None, "plain</think>x")


def test_an_earlier_turns_end_tag_leaves_the_new_answer_thinking(make_tiny, tmp_path):
    """Qwen3's template writes back the thinking of a tool call's turn: its </think> closed
    that answer's thinking, not the new one's, which a special token (<|im_start|>) begins."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    folder = tmp_path / "model"
    shutil.copytree(make_tiny("qwen3"), folder)
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.add_tokens(
        [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
    )
    backend.save(str(folder / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(folder)
    think = ThinkTokens.of("qwen3", tokenizer)
    history = "<|im_start|>assistant\n<think>\nCall add.\n</think>\n\n<tool_call>{}</tool_call>"
    turn = "<|im_end|>\n<|im_start|>user\n<tool_response>4</tool_response><|im_end|>\n"
    prompt = history + turn + "<|im_start|>assistant\n"
    assert not think.ended(tokenizer.encode(prompt, add_special_tokens=False))
    closed = prompt + "<think>\n\n</think>\n\n"  # enable_thinking=False's generation prompt
    assert think.ended(tokenizer.encode(closed, add_special_tokens=False))


def test_an_unknown_reasoning_parser_is_a_value_error(make_tiny):
    with pytest.raises(ValueError, match="qwen3"):
        LLM(str(make_tiny("llama")), reasoning_parser="qwen4", **ENGINE_ARGS)


def test_a_vocabulary_without_the_tags_is_a_value_error(make_tiny):
    with pytest.raises(ValueError, match="</think> as tokens"):
        LLM(str(make_tiny("llama")), reasoning_parser="qwen3", **ENGINE_ARGS)


# a small KV cache: on a GPU, several engines of one test live at once
ENGINE_ARGS = {"max_model_len": 256, "dtype": "float32", "num_blocks": 128}
LETTERS = "[a-z]{5}"
PROMPT = [40, 41, 3, 7, 90, 12]


@pytest.fixture(scope="module")
def thinking_model(make_tiny, tmp_path_factory) -> tuple[str, ThinkTokens]:
    """The tiny llama with <think> and </think> added to its tokenizer (ids inside the model's
    vocabulary, which is larger than the tokenizer's)."""
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(make_tiny("llama"), folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens(
        [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    think = ThinkTokens(tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>"))
    return str(folder), think


def thinking_then_end(folder: str, end: int) -> tuple[int, list[int]]:
    """A logit bias on </think> under which the greedy answer thinks a few tokens and then
    ends its thinking, and those tokens (found by trying; the model is fixed)."""
    llm = LLM(folder, **ENGINE_ARGS)
    for bias in range(2, 40, 2):
        params = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={end: bias})
        [out] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        tokens = out.outputs[0].token_ids
        if end in tokens[2:10]:
            return bias, tokens[: tokens.index(end)]
    raise AssertionError("no bias makes the answer think and then end: the test is void")


@pytest.mark.parametrize("async_batching", [True, False])
def test_the_grammar_starts_once_the_thinking_ends(thinking_model, async_batching):
    """While thinking, the answer samples as if unconstrained (the same tokens as without a
    grammar); the </think> read back starts the grammar, which shapes the rest."""
    folder, think = thinking_model
    bias, thought = thinking_then_end(folder, think.end)
    llm = LLM(folder, reasoning_parser="qwen3", async_batching=async_batching, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={think.end: bias},
                            structured_outputs={"regex": LETTERS})  # fmt: skip
    [out] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert tokens[: len(thought) + 1] == [*thought, think.end]
    rest = llm.get_tokenizer().decode(tokens[len(thought) + 1 :], skip_special_tokens=True)
    assert re.fullmatch(LETTERS, rest) and out.outputs[0].finish_reason == "stop"
    # a prompt that closed the thinking is constrained from its first token
    closed = {"prompt_token_ids": [*PROMPT, think.start, 5, think.end]}
    [out] = llm.generate(closed, params, use_tqdm=False)
    assert re.fullmatch(LETTERS, out.outputs[0].text)
    # without the parser the grammar holds from the first token: </think> is never sampled
    plain = LLM(folder, async_batching=async_batching, **ENGINE_ARGS)
    [out] = plain.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    assert re.fullmatch(LETTERS, out.outputs[0].text) and think.end not in out.outputs[0].token_ids


@pytest.fixture(scope="module")
def server(thinking_model) -> Iterator[tuple[str, ThinkTokens, int, str]]:
    folder, think = thinking_model
    bias, thought = thinking_then_end(folder, think.end)
    llm = AsyncLLM.from_model(folder, reasoning_parser="qwen3", **ENGINE_ARGS)
    text = llm.tokenizer.decode(thought, skip_special_tokens=True)
    try:
        with running(build_app(llm, "tiny")) as url:
            yield url, think, bias, text
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
    url, think, bias, _ = server
    fields = {"logit_bias": {str(think.end): bias}, "structured_outputs": {"regex": LETTERS}}
    message = chat(url, **fields).json()["choices"][0]["message"]
    assert message["reasoning"] and re.fullmatch(LETTERS, message["content"])
    assert streamed(url, **fields) == (message["reasoning"], message["content"])
    hidden = chat(url, include_reasoning=False, **fields).json()["choices"][0]["message"]
    assert hidden["reasoning"] is None and hidden["content"] == message["content"]


def test_left_out_reasoning_shows_no_logprobs_or_token_ids_that_would_tell_it(server):
    """vLLM's: include_reasoning false hides the answer's logprobs and token ids too, whole
    and streamed (no chunk carries the thinking's tokens)."""
    url, think, bias, _ = server
    fields = {"logit_bias": {str(think.end): bias}, "structured_outputs": {"regex": LETTERS},
              "logprobs": True, "return_token_ids": True}  # fmt: skip
    shown = chat(url, **fields).json()["choices"][0]
    assert shown["logprobs"] and shown["token_ids"]
    hidden = chat(url, include_reasoning=False, **fields).json()["choices"][0]
    assert hidden["logprobs"] is None and "token_ids" not in hidden
    assert hidden["message"]["content"] == shown["message"]["content"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 24,
            "temperature": 0.0, "stream": True, "include_reasoning": False, **fields}  # fmt: skip
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += json.loads(line[6:])["choices"]
    assert chunks and all(c["logprobs"] is None and "token_ids" not in c for c in chunks)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == shown["message"]["content"]
    assert all(c["delta"] or c["finish_reason"] for c in chunks[1:])  # no empty chunk


def test_the_thinking_runs_until_the_end_tag_unless_the_template_turns_it_off(server):
    """Without the bias the answer never closes its thinking: all of it is reasoning.
    enable_thinking false, or reasoning_effort "none", makes it all content."""
    url, _, _, _ = server
    thought = chat(url).json()["choices"][0]["message"]
    assert thought["reasoning"] and thought["content"] is None
    for fields in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        said = chat(url, **fields).json()["choices"][0]["message"]
        assert said["reasoning"] is None and said["content"]
    assert chat(url, reasoning_effort="sometimes").status_code == 400


def test_the_servers_default_template_kwargs_turn_the_thinking_off_too(server, thinking_model):
    """--default-chat-template-kwargs '{"enable_thinking": false}' splits as the request's own
    key does (the template renders no closed thinking: the parser alone decides)."""
    url, _, _, _ = server
    asked = chat(url, chat_template_kwargs={"enable_thinking": False}).json()
    llm = AsyncLLM.from_model(thinking_model[0], reasoning_parser="qwen3", **ENGINE_ARGS)
    options = ServerOptions(default_chat_template_kwargs={"enable_thinking": False})
    try:
        with running(build_app(llm, "tiny", options=options)) as default_url:
            by_default = chat(default_url).json()
    finally:
        llm.shutdown()
    message = by_default["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"]
    assert message == asked["choices"][0]["message"]


def test_a_response_puts_the_thinking_in_a_reasoning_item(server):
    """/v1/responses: the chat's reasoning as a reasoning item before the message, whole and
    streamed; reasoning tokens are the output's ids before </think>, <think> left out (vLLM
    counts them from the ids), whole and streamed, and all of an output cut off thinking."""
    url, think, bias, _ = server
    fields = {"logit_bias": {str(think.end): bias}, "temperature": 0.0}
    [choice] = chat(url, max_tokens=24, return_token_ids=True, **fields).json()["choices"]
    message, ids = choice["message"], choice["token_ids"]
    thought_ids = [t for t in ids[: ids.index(think.end)] if t != think.start]
    body = {"model": "tiny", "input": "Why?", "max_output_tokens": 24, **fields}
    response = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
    reasoning, said = response["output"]
    assert reasoning["type"] == "reasoning" and said["type"] == "message"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": message["reasoning"]}]
    assert said["content"][0]["text"] == message["content"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == len(thought_ids)
    with httpx.stream(
        "POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    final = events[-1]["response"]
    assert thought == message["reasoning"]
    assert [{**item, "id": None} for item in final["output"]] == [
        {**reasoning, "id": None},
        {**said, "id": None},
    ]
    assert final["usage"] == response["usage"]
    # cut off thinking: its text, partial characters and all, encoded again made 50 of 32
    cut = {"model": "tiny", "input": "Hello there", "max_output_tokens": 32, "temperature": 0.0}
    usage = httpx.post(f"{url}/v1/responses", json=cut, timeout=60).json()["usage"]
    said = {"messages": [{"role": "user", "content": "Hello there"}], "return_token_ids": True}
    [choice] = chat(url, max_tokens=32, temperature=0.0, **said).json()["choices"]
    assert think.end not in choice["token_ids"]
    thinking = [t for t in choice["token_ids"] if t != think.start]
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(thinking)
    assert len(thinking) <= usage["output_tokens"] == 32


def greedy(llm: LLM, prompt: list[int], **fields) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, **fields)
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.mark.parametrize("async_batching", [True, False])
@pytest.mark.parametrize("budget", [0, 2, 5])
def test_a_thinking_budget_forces_the_end_tag_after_that_many_tokens(
    thinking_model, async_batching, budget
):
    """The first `budget` tokens are the free answer's, then </think>, then the answer goes
    on as it would from a prompt holding those tokens and the tag."""
    folder, think = thinking_model
    llm = LLM(folder, reasoning_parser="qwen3", async_batching=async_batching, **ENGINE_ARGS)
    free = greedy(llm, PROMPT)
    assert think.end not in free[: budget + 1], "the free answer ends its thinking: test void"
    tokens = greedy(llm, PROMPT, thinking_token_budget=budget)
    assert tokens[: budget + 1] == [*free[:budget], think.end]
    rest = greedy(llm, [*PROMPT, *tokens[: budget + 1]])
    assert tokens[budget + 1 :] == rest[: len(tokens) - budget - 1]


def test_a_budget_the_thinking_stays_within_forces_nothing(thinking_model):
    folder, think = thinking_model
    bias, thought = thinking_then_end(folder, think.end)
    llm = LLM(folder, reasoning_parser="qwen3", **ENGINE_ARGS)
    biased = greedy(llm, PROMPT, logit_bias={think.end: bias})
    assert greedy(llm, PROMPT, logit_bias={think.end: bias}, thinking_token_budget=10) == biased
    # a spent budget, then a grammar: </think>, then the regex's letters
    params = {"thinking_token_budget": 1, "structured_outputs": {"regex": LETTERS}}
    tokens = greedy(llm, PROMPT, **params)
    assert tokens[1] == think.end and len(thought) > 1
    assert re.fullmatch(LETTERS, llm.get_tokenizer().decode(tokens[2:], skip_special_tokens=True))


def test_a_thinking_budget_without_a_reasoning_parser_is_a_value_error(thinking_model):
    folder, _ = thinking_model
    llm = LLM(folder, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="reasoning_parser"):
        greedy(llm, PROMPT, thinking_token_budget=3)
    for budget in (-2, -1.0):  # vLLM's: an int, -1 alone below 0
        with pytest.raises(ValueError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=budget)
    # vLLM's -1 is unlimited: no budget, which needs no parser
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert greedy(llm, PROMPT, thinking_token_budget=-1) == greedy(llm, PROMPT)


def test_the_server_takes_a_thinking_budget(server):
    url, think, _, _ = server
    [choice] = chat(url, thinking_token_budget=3, return_token_ids=True).json()["choices"]
    assert choice["token_ids"][3] == think.end and think.end not in choice["token_ids"][:3]
    assert choice["message"]["reasoning"] and choice["message"]["content"]
