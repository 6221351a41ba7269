"""OpenAI's Responses API (server/responses.py) through OpenAI's own client: a response answers
what the chat endpoint answers for the same messages (instructions, previous_response_id's
conversation, function calls and their outputs), as a Response or as its events; the stored
responses; bad input."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import openai
import pytest

from tandem.async_llm import AsyncLLM
from tandem.server import responses
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.server.protocol import OpenAIError
from tandem.server.response_output import StreamEvents
from test_server import running

GREEDY = {"temperature": 0.0, "max_output_tokens": 8}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


# the tiny models' template knows no tool messages: one that writes them all (--chat-template)
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}[call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] }} as {{ c['id'] }}]{% endfor %}"
    "{% if m['role'] == 'tool' %} for {{ m['tool_call_id'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def served(make_tiny):
    llm = AsyncLLM.from_model(str(make_tiny("llama")), max_model_len=256)
    try:
        with running(build_app(llm, "tiny", options=ServerOptions(chat_template=TEMPLATE))) as url:
            yield url, llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def chat(client, messages, max_tokens=8, **fields):
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0.0, **fields
    )


def test_a_response_answers_what_the_chat_does(client):
    response = client.responses.create(
        model="tiny", input="Name a cache.", instructions="Be terse.", **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a cache."},
    ]
    want = chat(client, messages)
    assert response.output_text == want.choices[0].message.content
    [item] = response.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert response.status == (
        "incomplete" if want.choices[0].finish_reason == "length" else "completed"
    )
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == want.usage.prompt_tokens
    assert response.usage.output_tokens == want.usage.completion_tokens
    assert response.model == "tiny" and response.instructions == "Be terse."
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_the_events_of_a_stream_make_the_same_response(client):
    fields = {"model": "tiny", "input": [{"role": "user", "content": "Why?"}], **GREEDY}
    whole = client.responses.create(**fields)
    events = list(client.responses.create(stream=True, **fields))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))  # OpenAI's: from 0
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**fields) as stream:  # the client checks each event's place
        assert list(stream)[-1].response.output_text == whole.output_text
    stop = whole.output_text[-3:]  # a stop string ends it before max_output_tokens: completed
    assert len(stop) == 3 and stop.strip()
    with client.responses.stream(**fields, extra_body={"stop": [stop]}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == whole.output_text[: -len(stop)]


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="Name a cache.", **GREEDY)
    second = client.responses.create(
        model="tiny", input="Another?", previous_response_id=first.id, **GREEDY
    )
    messages = [
        {"role": "user", "content": "Name a cache."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another?"},
    ]
    assert second.output_text == chat(client, messages).choices[0].message.content
    assert second.previous_response_id == first.id
    third = client.responses.create(  # each stored turn joins the ones before it
        model="tiny", input="And a third?", previous_response_id=second.id, **GREEDY
    )
    messages += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And a third?"},
    ]
    assert third.output_text == chat(client, messages).choices[0].message.content
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match=r"previous_response_id|not stored") as gone:
        client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert gone.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.body["param"] == "response_id"  # the path's id, not a field's
    unstored = client.responses.create(model="tiny", input="x", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_request_id_is_the_response_s_id(client):
    """vLLM's request_id names the response, as it is: stored, retrieved and continued by it;
    a stored response's id again is a 400 (that response's turn would change under the turns
    after it), an unstored one's is not."""
    request_id = f"my-request-{uuid.uuid4().hex}"
    named = {"model": "tiny", "input": "Name a cache.", **GREEDY}
    response = client.responses.create(**named, extra_body={"request_id": request_id})
    assert response.id == request_id
    assert client.responses.retrieve(request_id).output_text == response.output_text
    follow = client.responses.create(
        model="tiny", input="Another?", previous_response_id=request_id, **GREEDY
    )
    again = client.responses.create(
        model="tiny", input="Another?", previous_response_id=client.responses.create(**named).id,
        **GREEDY,
    )  # fmt: skip
    assert follow.output_text == again.output_text
    with pytest.raises(openai.BadRequestError, match="stored response") as taken:
        client.responses.create(**named, extra_body={"request_id": request_id})
    assert taken.value.body["param"] == "request_id"
    for _ in range(2):  # not stored: nothing is replaced
        unstored = client.responses.create(**named, store=False, extra_body={"request_id": "u"})
        assert unstored.id == "u"
    events = list(
        client.responses.create(**named, stream=True, extra_body={"request_id": "streamed"})
    )
    assert {e.response.id for e in events if hasattr(e, "response")} == {"streamed"}


def test_max_tool_calls_is_echoed_and_cuts_no_call(client):
    """As vLLM's: taken and echoed, nothing more."""
    named = {"type": "function", "name": "get_weather"}
    fields = {"model": "tiny", "input": "Paris?", "tools": [WEATHER], "tool_choice": named}
    response = client.responses.create(**fields, max_tool_calls=0, temperature=0.0)
    assert response.max_tool_calls == 0
    assert [item.type for item in response.output] == ["function_call"]
    assert client.responses.create(**fields, temperature=0.0).max_tool_calls is None


def test_a_response_echoes_the_sampling_it_did(served, monkeypatch):
    """As vLLM's echo of its SamplingParams: temperature, top_p, presence_penalty and
    frequency_penalty are the request's, else the model's generation config's, else 1, 1, 0
    and 0; top_p is 1 when greedy; top_logprobs is null unless logprobs are included."""
    url, llm = served

    def echoed(**fields):
        body = {"model": "tiny", "input": "x", "max_output_tokens": 2, **fields}
        response = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
        names = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs")
        return tuple(response[name] for name in names)

    assert echoed() == (1.0, 1.0, 0.0, 0.0, None)  # the tiny model's config sets none
    monkeypatch.setattr(llm, "sampling_defaults", {"temperature": 0.7, "top_p": 0.9,
                                                   "presence_penalty": 0.5})  # fmt: skip
    assert echoed() == (0.7, 0.9, 0.5, 0.0, None)
    given = {"temperature": 0.3, "top_p": 0.8, "frequency_penalty": 0.2, "top_logprobs": 2}
    assert echoed(**given) == (0.3, 0.8, 0.5, 0.2, None)  # top_logprobs: no logprobs asked
    assert echoed(temperature=0.0, top_p=0.8)[:2] == (0.0, 1.0)  # greedy
    included = {"include": ["message.output_text.logprobs"]}
    assert echoed(**included)[-1] == 0 and echoed(**included, top_logprobs=2)[-1] == 2
    body = {"model": "tiny", "input": "x", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line[:6] == "data: "]
    assert {(e["response"]["temperature"], e["response"]["top_p"]) for e in events
            if "response" in e} == {(0.7, 0.9)}  # fmt: skip


def test_a_response_s_output_items_sent_back_continue_its_conversation(client):
    """Its output items as input (an assistant's output message: type, id, status and
    output_text parts) answer as previous_response_id does."""
    first = client.responses.create(model="tiny", input="Name a cache.", **GREEDY)
    items = [item.model_dump(exclude_none=True) for item in first.output]
    assert items[0]["type"] == "message" and items[0]["content"][0]["type"] == "output_text"
    sent_back = client.responses.create(
        model="tiny", input=[{"role": "user", "content": "Name a cache."}, *items,
                             {"role": "user", "content": "Another?"}], **GREEDY,
    )  # fmt: skip
    continued = client.responses.create(
        model="tiny", input="Another?", previous_response_id=first.id, **GREEDY
    )
    assert sent_back.output_text == continued.output_text


def test_a_named_tool_is_a_function_call_item_and_its_output_goes_back(client):
    response = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0,
    )  # fmt: skip
    [call] = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert set(json.loads(call.arguments)) == {"city"}
    follow_up = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]  # fmt: skip
    answer = client.responses.create(
        model="tiny", input=follow_up, tools=[WEATHER], tool_choice="none", **GREEDY
    )  # "auto" needs --tool-call-parser, as chat's
    messages = [
        follow_up[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    want = chat(client, messages, tools=tools, tool_choice="none")
    assert answer.output_text == (want.choices[0].message.content or "")
    named = {"type": "function", "name": "get_weather"}
    fields = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": named}
    streamed = list(client.responses.create(model="tiny", stream=True, temperature=0.0, **fields))
    arguments = "".join(
        e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments
    [done] = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert (done.type, done.arguments) == ("function_call", call.arguments)


def test_a_json_schema_text_format_is_the_chat_s_response_format(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response = client.responses.create(
        model="tiny", input="A number?", temperature=0.0, max_output_tokens=12,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )  # fmt: skip
    json_schema = {"name": "n", "schema": schema, "strict": True}
    want = chat(
        client, [{"role": "user", "content": "A number?"}], max_tokens=12,
        response_format={"type": "json_schema", "json_schema": json_schema},
    )  # fmt: skip
    assert response.output_text == want.choices[0].message.content
    assert response.output_text.lstrip().startswith("{")  # the grammar's first token


def test_included_logprobs_are_the_chat_s_in_a_response_and_its_events(client):
    """include message.output_text.logprobs: the text part's logprobs are the chat's logprobs
    for the same messages (top_logprobs its top_logprobs); a stream's text deltas carry each
    its own, which join to the same list in the done event and the final response."""
    fields = {"model": "tiny", "input": "Name a cache.", **GREEDY}
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = client.responses.create(**fields, **asked)
    want = chat(client, [{"role": "user", "content": "Name a cache."}], logprobs=True,
                top_logprobs=2)  # fmt: skip
    [part] = response.output[0].content
    entries = [entry.model_dump() for entry in want.choices[0].logprobs.content]
    assert [entry.model_dump() for entry in part.logprobs] == entries
    assert len(entries) == response.usage.output_tokens and response.top_logprobs == 2
    assert all(len(entry["top_logprobs"]) == 2 for entry in entries)
    assert client.responses.create(**fields).output[0].content[0].logprobs == []  # not asked
    events = list(client.responses.create(stream=True, **fields, **asked))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    # a token whose text the detokenizer holds back (part of a character) comes with the next
    assert [lp.model_dump() for e in deltas for lp in e.logprobs] == entries
    assert all(e.logprobs for e in deltas) and len(deltas) < len(entries)
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == entries
    final = events[-1].response.output[0].content[0]
    assert [lp.model_dump() for lp in final.logprobs] == entries


def wait_until_ended(client, response_id, seconds=60.0):
    deadline = time.monotonic() + seconds
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_is_queued_then_stored_as_it_ends(client):
    fields = {"model": "tiny", "input": "Name a cache.", "instructions": "Be terse.", **GREEDY}
    whole = client.responses.create(**fields)
    queued = client.responses.create(background=True, **fields)
    assert queued.background and queued.status in ("queued", "in_progress")
    ended = wait_until_ended(client, queued.id)
    assert (ended.status, ended.output_text) == (whole.status, whole.output_text)
    assert ended.usage.output_tokens == whole.usage.output_tokens and ended.background
    follow = client.responses.create(
        model="tiny", input="Another?", previous_response_id=queued.id, **GREEDY
    )
    again = client.responses.create(
        model="tiny", input="Another?", previous_response_id=whole.id, **GREEDY
    )
    assert follow.output_text == again.output_text  # its stored turn, as a foreground one's
    with pytest.raises(openai.BadRequestError, match="already ended"):
        client.responses.cancel(queued.id)
    with pytest.raises(openai.BadRequestError, match="not a background response"):
        client.responses.cancel(whole.id)


def test_a_failed_background_response_names_the_field_as_a_foreground_one(client):
    too_long = {"model": "tiny", "input": "x " * 300, "max_output_tokens": 2}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**too_long)
    assert refused.value.body["param"] == "input"
    queued = client.responses.create(background=True, **too_long)
    deadline = time.monotonic() + 30
    while (failed := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert failed.status == "failed"
    stored = client.responses.with_raw_response.retrieve(queued.id).http_response.json()
    assert stored["error"]["param"] == "input"


def test_a_cancelled_background_response_aborts_its_generation(client, url):
    long = {"model": "tiny", "input": "Go on.", "max_output_tokens": 200, "temperature": 0.0}
    long["extra_body"] = {"ignore_eos": True, "min_tokens": 200}
    running = client.responses.create(background=True, **long)
    with pytest.raises(openai.BadRequestError, match="still"):
        client.responses.create(model="tiny", input="x", previous_response_id=running.id)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # the same again
    gone = client.responses.create(background=True, **long)
    client.responses.delete(gone.id)  # deleting one ends its generation too
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    deadline = time.monotonic() + 30  # both generations aborted: nothing runs on
    while (
        'tandem_num_requests_running{model_name="tiny"} 0.0' not in httpx.get(f"{url}/metrics").text
    ):
        assert time.monotonic() < deadline, "a cancelled response's generation still runs"
        time.sleep(0.05)
    assert client.responses.create(model="tiny", input="x", **GREEDY).status  # serves on


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"background": True, "store": False}, "store"),
        ({"background": True, "stream": True}, "stream"),
        ({"background": True, "top_k": "x"}, "top_k"),  # checked before it is queued
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0"),
        ({"truncation": "auto"}, "truncation"),
        ({"tempature": 1.0}, "tempature"),  # a misspelt field
        ({"n": 2}, "n"),  # chat fields that would change the answer's shape: no response's
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"logprobs": True}, "logprobs"),
        ({"seed": "x"}, "seed"),  # a chat option taken, its value checked by the chat request
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens"),  # the chat's error, by this name
        ({"reasoning": {"effort": "sometimes"}}, "reasoning.effort"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        # the item's own index, not its chat message's (instructions, a joined function call)
        ({"input": [{"role": "robot", "content": "x"}], "instructions": "Be terse."},
         "input.0.role"),
        ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
                    {"role": "robot", "content": "x"}]}, "input.2.role"),
        ({"text": {"format": {"type": "json_schema", "name": "n", "schmea": {}}}},
         "text.format.schmea"),
        ({"user": "\udcff"}, "user"),  # echoed in the answer: UTF-8 text only
        ({"text": {"format": "json_object"}}, "text.format"),  # no object: was a 500
        ({"text": {"format": 5}}, "text.format"),
        ({"enable_response_messages": True}, "enable_response_messages"),
        # OpenAI's required fields of input items (their calls reached the template as None)
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input.0.call_id"),
        ({"input": [{"type": "function_call", "call_id": "a", "arguments": "{}"}]},
         "input.0.name"),
        ({"input": [{"type": "function_call_output", "call_id": "a"}]}, "input.0.output"),
        # as vLLM's pydantic model of OpenAI's input items
        ({"input": [{"role": "user"}]}, "input.0.content"),
        ({"input": [{"type": "message", "role": "user", "content": None}]}, "input.0.content"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
         "input.0.content.0.text"),
        # output_text is an assistant's output message's: none in another's, none untyped
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "x"}, {"type": "input_text", "text": "y"}]}]},
         "input.0.content.1.type"),
        ({"input": [{"type": "message", "role": "assistant", "status": "done",
                     "content": [{"type": "output_text", "text": "x"}]}]}, "input.0.status"),
        ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}",
                     "status": "done"}]}, "input.0.status"),
        ({"input": [{"type": "function_call_output", "call_id": "a", "output": "x", "id": 5}]},
         "input.0.id"),
        ({"input": [{"type": "reasoning"}, {"role": "user", "content": "x"}]},
         "input.0.summary"),
        ({"input": [{"type": "reasoning", "summary": [], "status": "thinking"},
                    {"role": "user", "content": "x"}]}, "input.0.status"),
    ],
)  # fmt: skip
def test_what_is_not_supported_is_a_400_naming_it(url, fields, param):
    body = {"model": "tiny", "input": "x", "max_output_tokens": 2, **fields}
    headers = {"content-type": "application/json"}  # json.dumps escapes a lone surrogate
    answer = httpx.post(f"{url}/v1/responses", content=json.dumps(body), headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    ok = {"model": "tiny", "input": "x", "max_output_tokens": 2}
    assert httpx.post(f"{url}/v1/responses", json=ok, timeout=60).status_code == 200
    neutral = {**ok, "enable_response_messages": False}  # vLLM's default, taken
    assert httpx.post(f"{url}/v1/responses", json=neutral, timeout=60).status_code == 200


def test_the_owner_of_a_request_is_the_store_its_response_id_names():
    """Under --data-parallel-size the ingress sends a request that reads a stored response
    to the replica whose tag the id carries."""
    body = json.dumps({"previous_response_id": "resp_r1_abc"}).encode()
    assert responses.owner("POST", "/v1/responses", body) == "r1"
    assert responses.owner("GET", "/v1/responses/resp_r2_abc", b"") == "r2"
    assert responses.owner("DELETE", "/v1/responses/resp_r2_abc", b"") == "r2"
    assert responses.owner("POST", "/v1/responses/resp_r3_abc/cancel", b"") == "r3"
    assert responses.owner("POST", "/v1/responses", b"{}") is None
    assert responses.owner("POST", "/v1/chat/completions", body) is None


def test_stream_events_open_and_close_items_in_order():
    """Chat chunks of reasoning, then text, then two tool calls: the events OpenAI's
    stream gives for them, each item closed before the next opens."""

    def call_start(index, call_id, name, arguments):
        function = {"name": name, "arguments": arguments}
        return {"index": index, "id": call_id, "type": "function", "function": function}

    def chunk(**delta):
        return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n"

    async def chunks():
        yield chunk(role="assistant", reasoning="think ")
        yield chunk(reasoning="more")
        yield chunk(content="Hello")
        yield chunk(content=" there")
        yield chunk(tool_calls=[call_start(0, "c0", "f", '{"a"')])
        yield chunk(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}])
        yield chunk(tool_calls=[call_start(1, "c1", "g", "{}")])
        yield "data: [DONE]\n\n"

    events = StreamEvents({"id": "resp_x", "output": []}, None, None, [])

    async def collect():
        return [json.loads(e.split("data: ", 1)[1]) async for e in events.run(chunks())]

    got = asyncio.run(collect())
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.reasoning_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    output = got[-1]["response"]["output"]
    # vLLM's reasoning part events: the thinking's part, empty, then whole, as the item's
    parts = [e for e in got if e["type"].startswith("response.reasoning_part.")]
    assert [e["part"] for e in parts] == [
        {"type": "reasoning_text", "text": ""},
        {"type": "reasoning_text", "text": "think more"},
    ]
    assert {(e["item_id"], e["output_index"], e["content_index"]) for e in parts} == {
        (output[0]["id"], 0, 0)
    }
    done = [e for e in got if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("f", '{"a": 1}'), ("g", "{}")]
    kinds = ["reasoning", "message", "function_call", "function_call"]
    assert [item["type"] for item in output] == kinds
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "think more"}]
    added = next(e for e in got if e["type"] == "response.output_item.added")
    assert (added["item"]["status"], output[0]["status"]) == ("in_progress", "completed")
    assert output[1]["content"][0]["text"] == "Hello there"
    assert [(o["call_id"], o["arguments"]) for o in output[2:]] == [
        ("c0", '{"a": 1}'),
        ("c1", "{}"),
    ]
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [
        0,
        1,
        2,
        3,
    ]


def test_a_stream_s_logprobs_go_with_the_text_that_follows_them():
    """Logprobs of a thinking chunk go to no event; those of a chunk without text (a character
    held back) go with the next text delta; those of text-less chunks at the end close the text
    part."""

    def chunk(tokens, **delta):
        logprobs = {"content": [{"token": t, "logprob": -1.0, "bytes": [], "top_logprobs": []}
                                for t in tokens]}  # fmt: skip
        choice = {"index": 0, "delta": delta, "logprobs": logprobs}
        return f"data: {json.dumps({'choices': [choice]})}\n\n"

    async def chunks():
        yield chunk(["<think>", "hm"], reasoning="hm")
        yield chunk(["\xe2"], content="")
        yield chunk(["\x82\xac"], content="€")
        yield chunk(["!"], content="!")
        yield chunk(["</s>"], content="")

    events = StreamEvents({"id": "resp_x", "output": []}, None, None, [])

    async def collect():
        return [json.loads(e.split("data: ", 1)[1]) async for e in events.run(chunks())]

    got = asyncio.run(collect())
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    assert [[lp["token"] for lp in e["logprobs"]] for e in deltas] == [["\xe2", "\x82\xac"], ["!"]]
    [done] = [e for e in got if e["type"] == "response.output_text.done"]
    tokens = ["\xe2", "\x82\xac", "!", "</s>"]
    assert [lp["token"] for lp in done["logprobs"]] == tokens
    part = got[-1]["response"]["output"][1]["content"][0]
    assert (part["text"], [lp["token"] for lp in part["logprobs"]]) == ("€!", tokens)


def test_a_chat_stream_s_error_event_fails_the_response():
    """The chat stream's error event (the engine failed, the server stops): the open item
    closes, then OpenAI's error event and response.failed end the stream."""

    async def chunks():
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'Hi'}}]})}\n\n"
        error = {
            "message": "the engine stopped",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        yield f"data: {json.dumps({'error': error})}\n\n"
        raise AssertionError("read past the error")

    events = StreamEvents({"id": "resp_x", "output": []}, None, None, [])

    async def collect():
        return [json.loads(e.split("data: ", 1)[1]) async for e in events.run(chunks())]

    got = asyncio.run(collect())
    assert [e["type"] for e in got][-5:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "error", "response.failed",
    ]  # fmt: skip
    assert got[-2]["message"] == "the engine stopped"
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["type"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "Hi"


def test_the_store_keeps_the_conversations_in_use(monkeypatch):
    """Each response holds its own turn; a conversation follows previous_response_id back, and
    using it keeps its responses from being the ones dropped."""
    monkeypatch.setattr(responses, "MAX_STORED", 4)
    store = responses.ResponseStore()

    def put(response_id, previous=None):
        turn = [
            {"role": "user", "content": f"{response_id}?"},
            {"role": "assistant", "content": response_id},
        ]
        store.put({"id": response_id, "previous_response_id": previous}, turn)

    for response_id, previous in (("a", None), ("b", "a"), ("x", None), ("c", "b")):
        put(response_id, previous)
    assert [m["content"] for m in store.conversation("c")] == ["a?", "a", "b?", "b", "c?", "c"]
    put("y")  # five: the least recently used, x, goes
    assert set(store.responses) == {"a", "b", "c", "y"}
    store.delete("b")
    with pytest.raises(OpenAIError, match="'b'") as error:
        store.conversation("c")
    assert error.value.status_code == 404


def test_a_response_with_no_text_and_no_call_adds_no_message_to_its_conversation():
    """Cut off while thinking, or cancelled before a token: its turn is its input alone (an
    assistant message without content made the next turn's chat request a 400)."""
    store = responses.ResponseStore()
    thought = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]}]
    for response_id, output in (("thinking", thought), ("cancelled", [])):
        response = {"id": response_id, "previous_response_id": None, "output": output}
        store.put_answered(response, [{"role": "user", "content": "Why?"}])
        assert store.conversation(response_id) == [{"role": "user", "content": "Why?"}]
