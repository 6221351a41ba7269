"""The server's structured outputs and tool calls, through the official openai client, on the tiny
random model: response_format and structured_outputs on both endpoints, tool_choice "required",
a named function and "auto" (the hermes and llama3_json parsers), tools and tool messages in the
chat template, and the 400s for what cannot be honoured.

With random weights the outputs test the mechanism, not the model: each is checked against the
schema it was constrained to with jsonschema. Whitespace is disabled
(`structured_outputs: {"disable_any_whitespace": true}`) where a random model would otherwise pad
the JSON with it until max_tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tandem.async_llm import AsyncLLM
from tandem.cli import main
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from test_server import assert_openai_error, running

MODEL = "tiny-llama"
PROMPT = "Our scheduler reads"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_WHITESPACE = {"structured_outputs": {"disable_any_whitespace": True}}
# the Hermes/Qwen layout: tools in the system turn, calls in <tool_call> tags, results as a turn
TOOLS_TEMPLATE = """{{- bos_token | default('') }}
{%- if tools %}
{{- '<|im_start|>system\\nTools:\\n' }}
{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>' }}
{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
{{- '</tool_call>' }}
{%- endfor %}
{%- if message.role == 'tool' %}{{- ' (answers ' + message.tool_call_id + ')' }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["label", "hour"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, ALARM]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def folder(make_tiny, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tools") / "tiny-llama"
    shutil.copytree(make_tiny("llama"), folder)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def app(folder) -> Iterator:
    llm = AsyncLLM.from_model(folder, max_model_len=1024, block_size=16)
    yield build_app(llm, MODEL, options=ServerOptions(tool_call_parser="hermes"))
    llm.shutdown()


@pytest.fixture(scope="module")
def url(app) -> Iterator[str]:
    with running(app) as url:
        yield url


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def parser(app, monkeypatch):
    """parser(name or None): the server parses tool_choice "auto" with it from now on."""
    serving = app.state.serving

    def use(name: str | None) -> None:
        options = dataclasses.replace(serving.options, tool_call_parser=name)
        monkeypatch.setattr(serving, "options", options)

    return use


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)


def check_calls(tool_calls, names: set[str]) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its arguments valid against its tool's schema."""
    calls = []
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


# ---- response_format and structured_outputs --------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{0,6}$"},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "nested": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
            "required": ["ok", "level"],
        },
    },
    "required": ["name", "score", "tags", "nested"],
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "record", "schema": SCHEMA, "strict": True},
}


@pytest.mark.parametrize("seed", range(3))
def test_chat_response_format_json_schema_is_followed(client, seed):
    args = {
        "model": MODEL,
        "messages": MESSAGES,
        "response_format": JSON_SCHEMA_FORMAT,
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": seed,
        "extra_body": NO_WHITESPACE,
    }
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = client.chat.completions.create(**args, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    assert text == choice.message.content


def test_completions_response_format_and_structured_outputs_are_followed(client):
    schema = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
    for extra in (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema},
            }
        },
        {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    ):
        completion = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=50, temperature=1.0, seed=1, extra_body=extra
        )
        jsonschema.validate(json.loads(completion.choices[0].text), schema)
    for kind, value, check in (
        ("regex", r"[a-c]{2,4}-\d", lambda text: re.fullmatch(r"[a-c]{2,4}-\d", text)),
        ("choice", ["red", "green", "blue"], lambda text: text in ("red", "green", "blue")),
        ("grammar", 'root ::= "x" ("y" | "z")', lambda text: text in ("xy", "xz")),
    ):
        completion = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            temperature=1.0,
            seed=2,
            extra_body={"structured_outputs": {kind: value}},
        )
        assert completion.choices[0].finish_reason == "stop"
        assert check(completion.choices[0].text), (kind, completion.choices[0].text)


def test_response_format_json_object_gives_a_json_object(client, folder):
    # random weights would write strings for hundreds of tokens: favour the ones that close them
    tokenizer = AutoTokenizer.from_pretrained(folder)
    closing = [i for i in range(len(tokenizer)) if set('"}') & set(tokenizer.decode([i]))]
    objects = []
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_object"},
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            logit_bias=dict.fromkeys(map(str, closing), 20),
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        objects.append(json.loads(choice.message.content))
    assert all(isinstance(o, dict) for o in objects) and any(objects)  # not only {}


def test_response_format_structural_tag_is_followed_in_either_form(client):
    """vLLM's structural_tag response format: xgrammar's format (a tag around a constant, so
    the whole output is known), and the older structures and triggers."""
    tag = {"type": "tag", "begin": "<f>", "content": {"type": "const_string", "value": "ok"},
           "end": "</f>"}  # fmt: skip
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=0,
        response_format={"type": "structural_tag", "format": tag},
    )  # fmt: skip
    choice = response.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("<f>ok</f>", "stop")
    older = {"type": "structural_tag", "triggers": ["<f"],
             "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}]}  # fmt: skip
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=0,
        response_format=older,
    )  # fmt: skip
    assert response.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
            "response_format",
            "each constrain",
        ),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "xgrammar rejected"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown fields"),
        ({"structured_outputs": {"disable_any_whitespace": True, "x": 1}}, None, "unknown"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "integer", "minimum": 5, "maximum": 1}}}},
            "response_format",
            "minimum greater than maximum",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema object"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "needs its format"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
         "response_format", "xgrammar rejected the structural_tag constraint"),
        ({"response_format": {"type": "structural_tag", "formt": {}}}, "response_format.formt",
         "formt"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_naming_the_field(url, body, param, words):
    for path, base in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        message = assert_openai_error(post(url, path, {**base, **body}), 400, param)
        assert words in message, message


# ---- tool_choice "required" and a named function -------------------------------------------


def required_request(seed: int, **fields) -> dict:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": seed,
        "extra_body": NO_WHITESPACE,
        **fields,
    }


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_required_returns_tool_calls_the_client_parses(client, seed):
    args = required_request(seed, parallel_tool_calls=False)  # one call: the array ends there
    choice = client.chat.completions.parse(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert choice.message.tool_calls[0].function.parsed_arguments == call[1]
    with client.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content is None
    assert check_calls(streamed.message.tool_calls, set(SCHEMAS)) == [call]


def test_parallel_tool_calls_come_as_an_array_each_call_valid(client):
    """Random weights rarely close the array: max_tokens may cut it, after complete calls."""
    args = required_request(seed=0, max_tokens=300)
    choice = client.chat.completions.create(**args).choices[0]
    calls = check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert len(calls) > 1
    if choice.finish_reason == "length":
        assert choice.message.content.startswith('{"name": "')  # the cut-off call
    else:
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == list(range(len(calls)))  # each whole in one delta
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == calls
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == (choice.message.content or "")
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    # text held back while a call grows sends no chunk (it sent one with an empty delta a token)
    assert all(c.choices[0].delta.model_dump(exclude_none=True) for c in chunks[:-1])


@pytest.mark.parametrize("name", ["get_weather", "set_alarm"])
def test_a_named_tool_choice_calls_that_function(client, name):
    args = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": name}},
        "max_tokens": 100,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": NO_WHITESPACE,
    }
    response = client.chat.completions.create(**args)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # as OpenAI
    [call] = check_calls(choice.message.tool_calls, {name})
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == name
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert len(deltas) > 2  # the arguments come as the tokens do
    assert json.loads("".join(d.function.arguments for d in deltas)) == call[1]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_each_of_n_choices_reads_its_own_tool_calls(client):
    args = required_request(seed=4, parallel_tool_calls=False, n=3)
    response = client.chat.completions.create(**args)
    calls = [check_calls(c.message.tool_calls, set(SCHEMAS)) for c in response.choices]
    assert len({json.dumps(c) for c in calls}) > 1  # seeds seed + k: different calls
    ids = [c.message.tool_calls[0].id for c in response.choices]
    assert len(set(ids)) == 3
    streamed = [[], [], []]
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.tool_calls or []
    assert [[(d.function.name, json.loads(d.function.arguments)) for d in s] for s in streamed] == (
        calls
    )


def test_a_tool_call_cut_off_by_max_tokens_finishes_with_length(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=3,
        seed=0,
        extra_body=NO_WHITESPACE,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert '{"name": "'.startswith(choice.message.content)  # the cut-off call, as content


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "each constrain",
        ),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "string", "minLength": 3, "maxLength": 1}}}], "tool_choice": "required"},
            "tools",
            "xgrammar rejected",
        ),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_a_400_naming_the_field(url, body, param, words):
    response = post(url, "/v1/chat/completions", {"messages": MESSAGES, **body})
    message = assert_openai_error(response, 400, param)
    assert words in message, message


# ---- tool_choice "auto": the model's own format -------------------------------------------------

# the tiny model's random weights never write a call; a regex constraint makes them write one,
# with a random city, so that the parser reads what the engine streams
HERMES_OUTPUT = (
    r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{1,6}", "days": [1-7], "metric": true\}\}</tool_call>'
)
LLAMA3_OUTPUT = (
    r'\{"name": "set_alarm", "parameters": \{"label": "[a-z]{1,4}", "hour": [1-9]\}\}; '
    r'\{"name": "get_weather", "parameters": \{"city": "Oslo", "days": 2, "metric": false\}\}'
)


def auto_request(regex: str, seed: int) -> dict:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": seed,
        "extra_body": {"structured_outputs": {"regex": regex}},
    }


@pytest.mark.parametrize("seed", range(2))
def test_auto_tool_choice_parses_hermes_tool_calls_from_the_output(client, parser, seed):
    parser("hermes")
    args = auto_request(HERMES_OUTPUT, seed)
    response = client.chat.completions.create(**args)  # tool_choice "auto" is the default
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert re.fullmatch("[a-z]{1,6}", arguments.pop("city"))
    assert arguments == {"days": arguments["days"], "metric": True}
    chunks = list(client.chat.completions.create(**args, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == choice.message.content  # nothing of the call leaked as content
    [streamed] = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_escaped_surrogates_in_tool_call_arguments_are_a_400_not_a_template_crash(url):
    """The template renders the arguments as JSON without escapes: the surrogate comes out."""
    raw = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": '{"a": "\\ud800"}'}}]},
    ]})  # fmt: skip
    response = httpx.post(f"{url}/v1/chat/completions", content=raw,
                          headers={"Content-Type": "application/json"})  # fmt: skip
    assert "surrogate" in assert_openai_error(response, 400, "messages")


def test_a_schema_nested_too_deep_is_a_400(url):
    deep = '{"type": "array", "items": ' * 1000 + "{}" + "}" * 1000
    body = {"prompt": PROMPT, "max_tokens": 2, "structured_outputs": {"json": deep}}
    assert "too deep" in assert_openai_error(post(url, "/v1/completions", body), 400)


def test_auto_tool_choice_parses_llama3_json_tool_calls(client, parser):
    parser("llama3_json")
    args = auto_request(LLAMA3_OUTPUT, seed=5)
    response = client.chat.completions.create(**args, tool_choice="auto")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert [name for name, _ in calls] == ["set_alarm", "get_weather"]
    assert calls[1][1] == {"city": "Oslo", "days": 2, "metric": False}
    with client.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion()
    assert check_calls(final.choices[0].message.tool_calls, set(SCHEMAS)) == calls


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(client, parser):
    parser("llama3_json")
    args = {**auto_request(LLAMA3_OUTPUT, seed=5), "parallel_tool_calls": False}
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, _)] = check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert name == "set_alarm"
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "set_alarm")]


UNITS = {
    "type": "function",
    "function": {"name": "convert", "parameters": {  # as pydantic's model_json_schema writes it
        "$defs": {"Unit": {"type": "string", "enum": ["C", "F"]}},
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Unit"}},
        "required": ["to"],
        "additionalProperties": False,
    }},
}  # fmt: skip


def test_tool_choice_required_reads_tools_whose_parameters_use_defs(client):
    args = {**required_request(seed=1, parallel_tool_calls=False), "tools": [UNITS, ALARM]}
    choice = client.chat.completions.create(**args).choices[0]
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "convert":
        assert arguments in ({"to": "C"}, {"to": "F"})
    else:
        jsonschema.validate(arguments, SCHEMAS["set_alarm"])


def test_auto_without_calls_in_the_output_is_content(url, folder, parser):
    """hermes reads the text with its special tokens (some models' markers are special)."""
    parser("hermes")
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 12, "temperature": 0}
    auto = post(url, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    plain = post(url, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()
    [choice], [plain_choice] = auto["choices"], plain["choices"]
    ids = choice["token_ids"][: -1 if choice["finish_reason"] == "stop" else None]
    text = AutoTokenizer.from_pretrained(folder).decode(ids, skip_special_tokens=False)
    assert "<tool_call>" not in text and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == text  # as written, leading whitespace too
    assert choice["finish_reason"] == plain_choice["finish_reason"]
    assert plain_choice["message"]["content"] == AutoTokenizer.from_pretrained(folder).decode(ids)


def test_auto_without_a_parser_is_a_400_that_names_the_flag(url, parser):
    parser(None)
    response = post(url, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS})
    message = assert_openai_error(response, 400, "tool_choice")
    assert "--tool-call-parser" in message
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
    assert post(url, "/v1/chat/completions", body).status_code == 200


# ---- messages with tool calls and tool results --------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo, and an alarm at 7?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "set_alarm", "arguments": '{"label": "up", "hour": 7}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "set"},
]


def test_tools_tool_calls_and_tool_messages_go_through_the_chat_template(url, folder):
    """As transformers renders them, given the arguments as objects (its convention)."""
    reference = AutoTokenizer.from_pretrained(folder)
    hf_messages = json.loads(json.dumps(CONVERSATION))
    for call in hf_messages[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    hf_messages[1]["content"] = ""
    want = reference.apply_chat_template(
        hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '<tool_call>{"name": "set_alarm", "arguments": {"label": "up", "hour": 7}}' in want
    assert "(answers call_2)" in want and '"name": "get_weather"' in want.split("<|im_end|>")[0]
    tokens = post(url, "/tokenize", {"messages": CONVERSATION, "tools": TOOLS}).json()["tokens"]
    assert tokens == reference.encode(want, add_special_tokens=False)
    response = post(url, "/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(
        post(url, "/tokenize", {"messages": CONVERSATION}).json()["tokens"]
    )


def test_serve_refuses_auto_tool_choice_without_a_parser_and_unknown_parsers(folder, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", folder, "--enable-auto-tool-choice"])
    assert str(exited.value.code).startswith("tandem: error:")
    assert "--tool-call-parser" in str(exited.value.code)
    with pytest.raises(SystemExit) as exited:
        main(["serve", folder, "--tool-call-parser", "mistral"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'mistral'" in err and "'hermes'" in err and "'llama3_json'" in err
