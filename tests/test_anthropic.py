"""Anthropic's Messages API (server/anthropic.py) over HTTP: a message answers what the chat
endpoint answers for the same conversation (its system prompt, its tool_use and tool_result
turns as the chat's tool calls and tool messages), as a Message or as its events; count_tokens
counts the chat's prompt; errors take Anthropic's shape; the API key may come as x-api-key."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from tandem.async_llm import AsyncLLM
from tandem.server import anthropic
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.server.response_output import chat_stream
from test_responses_api import TEMPLATE
from test_server import running

KEY = "sk-messages"
ANTHROPIC = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}  # as Anthropic's clients send
BEARER = {"Authorization": f"Bearer {KEY}"}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": SCHEMA,
    },
}
GREEDY = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def url(make_tiny):
    llm = AsyncLLM.from_model(str(make_tiny("llama")), max_model_len=256)
    options = ServerOptions(chat_template=TEMPLATE, api_key=KEY)
    try:
        with running(build_app(llm, "tiny", options=options)) as url:
            yield url
    finally:
        llm.shutdown()


def post(url: str, path: str, body: dict, headers: dict = ANTHROPIC) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def message(url: str, **fields) -> dict:
    answer = post(url, "/v1/messages", {"model": "tiny", **GREEDY, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def chat(url: str, messages: list[dict], **fields) -> dict:
    body = {"model": "tiny", "messages": messages, **GREEDY, **fields}
    answer = post(url, "/v1/chat/completions", body, BEARER)
    assert answer.status_code == 200, answer.text
    [choice] = answer.json()["choices"]
    return {**choice, "usage": answer.json()["usage"]}


def events(url: str, **fields) -> list[tuple[str, dict]]:
    """A streamed message's events: (the event line's name, the data)."""
    body = {"model": "tiny", **GREEDY, **fields, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers=ANTHROPIC) as answer:
        assert answer.status_code == 200
        text = answer.read().decode()
    found = re.findall(r"event: (\S+)\ndata: (.*)\n\n", text)
    assert "".join(f"event: {kind}\ndata: {data}\n\n" for kind, data in found) == text
    return [(kind, json.loads(data)) for kind, data in found]


def assert_same_usage(got: dict, chat_usage: dict) -> None:
    """Anthropic's input tokens leave out those read from or written into the prefix cache."""
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert sum(got[part] for part in parts) == chat_usage["prompt_tokens"]
    assert got["output_tokens"] == chat_usage["completion_tokens"]


def test_a_message_is_the_chat_s_answer_with_its_system_prompt(url):
    got = message(url, system="Be terse.", messages=[{"role": "user", "content": "Name a cache."}])
    want = chat(url, [{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": "Name a cache."}])  # fmt: skip
    assert want["finish_reason"] == "length"  # 8 tokens of the tiny model: no end of its own
    assert got["content"] == [{"type": "text", "text": want["message"]["content"]}]
    assert (got["type"], got["role"], got["model"]) == ("message", "assistant", "tiny")
    assert got["id"].startswith("msg_")
    assert (got["stop_reason"], got["stop_sequence"]) == ("max_tokens", None)
    assert_same_usage(got["usage"], want["usage"])
    blocks = message(  # text blocks: the system's joined, Claude Code's billing block left out
        url,
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."},
                {"type": "text", "text": "x-anthropic-billing-header: cch=1;"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a cache."}]}],
    )  # fmt: skip
    assert blocks["content"] == got["content"]


def test_a_stop_sequence_ends_the_message_as_it_ends_the_chat(url):
    messages = [{"role": "user", "content": "Why?"}]
    text = chat(url, messages)["message"]["content"]
    stop = text[-3:]
    assert len(stop) == 3 and stop.strip()
    want = chat(url, messages, stop=[stop])
    assert (want["finish_reason"], want["stop_reason"]) == ("stop", stop)
    got = message(url, messages=messages, stop_sequences=[stop])
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", stop)
    assert got["content"] == [{"type": "text", "text": want["message"]["content"]}]
    _, delta = events(url, messages=messages, stop_sequences=[stop])[-2]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_a_stream_s_events_make_the_same_message(url):
    fields = {"messages": [{"role": "user", "content": "Why?"}]}
    whole = message(url, **fields)
    got = events(url, **fields)
    kinds = [kind for kind, _ in got]
    deltas = len(kinds) - 5
    assert deltas >= 1 and kinds == [
        "message_start", "content_block_start", *["content_block_delta"] * deltas,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert all(data["type"] == kind for kind, data in got)
    start = got[0][1]["message"]
    assert (start["id"], start["content"], start["stop_reason"]) == (start["id"], [], None)
    assert got[1][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}  # fmt: skip
    text = ""
    for _, data in got[2:-3]:
        assert (data["index"], data["delta"]["type"]) == (0, "text_delta")
        text += data["delta"]["text"]
    assert [{"type": "text", "text": text}] == whole["content"]
    _, delta = got[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    prompt = start["usage"]
    assert sum(prompt[k] for k in prompt if k != "output_tokens") == sum(
        whole["usage"][k] for k in whole["usage"] if k != "output_tokens"
    )  # the same prompt, read from the cache or not


def test_a_named_tool_and_any_tool_are_tool_use_blocks(url):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, chat_choice in (
        ({"type": "tool", "name": "get_weather"},
         {"type": "function", "function": {"name": "get_weather"}}),
        ({"type": "any"}, "required"),
    ):  # fmt: skip
        got = message(url, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=200)
        want = chat(url, messages, tools=[CHAT_WEATHER], tool_choice=chat_choice, max_tokens=200)
        [call] = want["message"]["tool_calls"]
        [block] = got["content"]
        assert block == {"type": "tool_use", "id": block["id"], "name": "get_weather",
                         "input": json.loads(call["function"]["arguments"])}  # fmt: skip
        assert set(block["input"]) == {"city"}
        assert (got["stop_reason"], got["stop_sequence"]) == ("tool_use", None)
    named = {"type": "tool", "name": "get_weather"}
    fields = {"messages": messages, "tools": [WEATHER], "tool_choice": named, "max_tokens": 200}
    got = events(url, **fields)
    whole = message(url, **fields)
    [start] = [data for kind, data in got if kind == "content_block_start"]
    assert start["content_block"] == {**whole["content"][0], "id": start["content_block"]["id"],
                                      "input": {}}  # fmt: skip
    partial = [data["delta"] for kind, data in got if kind == "content_block_delta"]
    assert all(delta["type"] == "input_json_delta" for delta in partial)
    assert json.loads("".join(d["partial_json"] for d in partial)) == whole["content"][0]["input"]
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_use_and_tool_result_turns_are_the_chat_s_tool_calls_and_tool_messages(url):
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "A city.", "signature": "abc"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
             "content": [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "20C"}]},
            {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
    ]  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning": "A city.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny\n20C"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    none = {"type": "none"}
    got = message(url, messages=conversation, tools=[WEATHER], tool_choice=none)
    want = chat(url, messages, tools=[CHAT_WEATHER], tool_choice="none")
    assert got["content"] == [{"type": "text", "text": want["message"]["content"]}]
    assert_same_usage(got["usage"], want["usage"])
    counted = post(url, "/v1/messages/count_tokens",
                   {"model": "tiny", "messages": conversation, "tools": [WEATHER]})  # fmt: skip
    tokenized = post(url, "/tokenize", {"model": "tiny", "messages": messages,
                                        "tools": [CHAT_WEATHER]}, BEARER)  # fmt: skip
    assert counted.json() == {"input_tokens": tokenized.json()["count"]}
    assert counted.json()["input_tokens"] == want["usage"]["prompt_tokens"]


def test_count_tokens_counts_the_chat_s_prompt(url):
    body = {"model": "tiny", "system": "Be terse.", "messages": [{"role": "user", "content": "Hi"}]}
    counted = post(url, "/v1/messages/count_tokens", body)
    assert counted.status_code == 200, counted.text
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    tokenized = post(url, "/tokenize", {"model": "tiny", "messages": messages}, BEARER)
    assert counted.json() == {"input_tokens": tokenized.json()["count"]}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


@pytest.mark.parametrize(
    ("path", "fields", "status", "kind", "said"),
    [
        ("/v1/messages", {"messages": [{"role": "user", "content": [IMAGE]}]}, 400,
         "invalid_request_error", "text models"),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}]}, 400,
         "invalid_request_error", "text models"),
        ("/v1/messages", {"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ("/v1/messages", {"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ("/v1/messages", {"top_n": 3}, 400, "invalid_request_error", "top_n"),
        ("/v1/messages", {"service_tier": "priority"}, 400, "invalid_request_error",
         "service_tier"),
        ("/v1/messages", {"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, 400,
         "invalid_request_error", "tool_result"),
        ("/v1/messages", {"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400,
         "invalid_request_error", "tool_choice"),
        ("/v1/messages", {"model": "claude-opus"}, 404, "not_found_error", "claude-opus"),
    ],
)  # fmt: skip
def test_bad_input_is_an_error_in_anthropic_s_shape(url, path, fields, status, kind, said):
    sampling = GREEDY if path == "/v1/messages" else {}  # count_tokens takes none
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **sampling, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    answer = post(url, path, body)
    assert answer.status_code == status, answer.text
    got = answer.json()
    assert got == {"type": "error", "error": {"type": kind, "message": got["error"]["message"]}}
    assert said in got["error"]["message"]
    ok = message(url, messages=[{"role": "user", "content": "Hi"}], top_n=None)  # null: taken
    assert ok["content"][0]["type"] == "text"
    labelled = {"metadata": {"user_id": "u1"}, "service_tier": "auto"}  # labels: no effect
    ok = message(url, messages=[{"role": "user", "content": "Hi"}], **labelled)
    assert ok["content"][0]["type"] == "text"


def test_the_api_key_may_come_as_x_api_key_on_the_messages_routes_alone(url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **GREEDY}
    assert post(url, "/v1/messages", body, BEARER).status_code == 200
    wrong = post(url, "/v1/messages", body, {"x-api-key": "wrong"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    chat_body = {"model": "tiny", "messages": body["messages"], **GREEDY}
    refused = post(url, "/v1/chat/completions", chat_body, ANTHROPIC)  # OpenAI's routes: Bearer
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def chunk(delta: dict, finish: str | None = None, stop: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop}
    used = {"prompt_tokens": 5, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 1, "created_cache_tokens": 2}}  # fmt: skip
    return f"data: {json.dumps({'model': 'm', 'choices': [choice], 'usage': used})}\n\n"


def converted(chunks: list[str]) -> list[dict]:
    async def stream():
        for raw in chunks:
            yield raw

    async def collect():
        events = chat_stream(stream(), anthropic.MessageEvents("msg_x"))
        return [json.loads(event.split("data: ", 1)[1]) async for event in events]

    return asyncio.run(collect())


def test_stream_events_start_and_stop_blocks_in_order():
    """Thinking, text, then two tool calls: each block starts with its first delta and stops
    before the next starts; the usage chunk's totals go in message_delta."""
    call = {"index": 0, "id": "c0", "type": "function",
            "function": {"name": "f", "arguments": '{"a"'}}  # fmt: skip
    second = {
        "index": 1,
        "id": "c1",
        "type": "function",
        "function": {"name": "g", "arguments": ""},
    }
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
             "prompt_tokens_details": {"cached_tokens": 1, "created_cache_tokens": 2}}  # fmt: skip
    got = converted([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "Hm"}), chunk({"reasoning": "m."}), chunk({"content": "Hi"}),
        chunk({"tool_calls": [call]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({"tool_calls": [second]}, "tool_calls"),
        f"data: {json.dumps({'model': 'm', 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n",
    ])  # fmt: skip
    summary = [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in got]
    assert summary == [
        ("message_start", None, None),
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, None), ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]  # fmt: skip
    assert got[0]["message"]["usage"] == {"input_tokens": 2, "output_tokens": 1,
                                          "cache_read_input_tokens": 1,
                                          "cache_creation_input_tokens": 2}  # fmt: skip
    assert got[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert got[8]["content_block"] == {"type": "tool_use", "id": "c0", "name": "f", "input": {}}
    assert [got[9]["delta"]["partial_json"], got[10]["delta"]["partial_json"]] == ['{"a"', ": 1}"]
    assert got[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2]["usage"]["output_tokens"] == 7


def test_a_chat_stream_s_error_event_is_anthropic_s_error_event():
    error = {"message": "the engine stopped", "type": "server_error", "param": None, "code": None}
    got = converted([chunk({"content": "Hi"}), f"data: {json.dumps({'error': error})}\n\n"])
    assert [e["type"] for e in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "error",
    ]  # fmt: skip
    assert got[-1]["error"] == {"type": "api_error", "message": "the engine stopped"}


def test_a_client_that_leaves_closes_the_chat_stream():
    """Closing the events closes the chat stream, which aborts its generation."""
    closed = []

    async def stream():
        try:
            while True:
                yield chunk({"content": "x"})
        finally:
            closed.append(True)

    async def leave():
        events = chat_stream(stream(), anthropic.MessageEvents("msg_x"))
        await anext(events)
        await events.aclose()

    asyncio.run(leave())
    assert closed == [True]


def test_a_completion_is_a_message_of_thinking_text_and_tool_use_blocks():
    used = {"prompt_tokens": 4, "completion_tokens": 3}
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    completion = {"model": "m", "usage": used, "choices": [{
        "message": {"role": "assistant", "reasoning": "Hm.", "content": "Hi", "tool_calls": [call]},
        "finish_reason": "tool_calls", "stop_reason": None}]}  # fmt: skip
    got = anthropic.message("msg_x", completion)
    assert got["content"] == [
        {"type": "thinking", "thinking": "Hm.", "signature": ""},
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "c0", "name": "f", "input": {"a": 1}},
    ]
    assert got["usage"] == {"input_tokens": 4, "output_tokens": 3, "cache_read_input_tokens": 0,
                            "cache_creation_input_tokens": 0}  # fmt: skip


def test_an_answer_of_nothing_is_one_empty_text_block_whole_or_streamed():
    nothing = {"model": "m", "usage": {"prompt_tokens": 4, "completion_tokens": 1},
               "choices": [{"message": {"role": "assistant", "content": None},
                            "finish_reason": "stop", "stop_reason": None}]}  # fmt: skip
    ended = anthropic.message("msg_x", nothing)
    assert ended["content"] == [{"type": "text", "text": ""}]  # Anthropic's empty answer
    assert (ended["stop_reason"], ended["stop_sequence"]) == ("end_turn", None)
    got = converted([chunk({"role": "assistant", "content": ""}, "stop")])
    assert [e["type"] for e in got] == [
        "message_start", "content_block_start", "content_block_stop", "message_delta",
        "message_stop",
    ]  # fmt: skip
    assert got[1]["content_block"] == {"type": "text", "text": ""}
    assert got[3]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


# a template that closes the thinking at once unless enable_thinking is on (as Qwen3's)
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if not enable_thinking | default(true) %}"
    "<think></think>{% endif %}{% endif %}"
)


def test_thinking_turns_the_template_s_enable_thinking_on_or_off(make_tiny):
    """Anthropic's `thinking` (which vLLM ignores): "disabled" renders the chat template with
    enable_thinking off, "enabled" on, as a chat with those chat_template_kwargs renders it;
    the request's own chat_template_kwargs win."""
    llm = AsyncLLM.from_model(str(make_tiny("llama")), max_model_len=256)
    options = ServerOptions(chat_template=THINKING_TEMPLATE)
    conversation = [{"role": "user", "content": "Hi"}]
    try:
        with running(build_app(llm, "tiny", options=options)) as served:

            def counted(**fields) -> int:
                body = {"model": "tiny", "messages": conversation, **fields}
                answer = post(served, "/v1/messages/count_tokens", body, {})
                assert answer.status_code == 200, answer.text
                return answer.json()["input_tokens"]

            def tokenized(enable_thinking: bool) -> int:
                body = {"model": "tiny", "messages": conversation,
                        "chat_template_kwargs": {"enable_thinking": enable_thinking}}  # fmt: skip
                return post(served, "/tokenize", body, {}).json()["count"]

            off, on = tokenized(False), tokenized(True)
            assert off > on
            assert counted(thinking={"type": "disabled"}) == off
            assert counted(thinking={"type": "enabled", "budget_tokens": 1024}) == on
            assert counted(thinking={"type": "adaptive"}) == on == counted()
            kept = {"enable_thinking": True}
            assert counted(thinking={"type": "disabled"}, chat_template_kwargs=kept) == on
            bad = post(served, "/v1/messages/count_tokens", {
                "model": "tiny", "messages": conversation, "thinking": {"type": "sometimes"}
            }, {})  # fmt: skip
            assert bad.status_code == 400 and bad.json()["type"] == "error"
    finally:
        llm.shutdown()
