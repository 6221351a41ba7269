"""Tool-call readers (server/tool_calls.py): the model's own formats for tool_choice "auto",
and the constrained outputs of "required" and a named function, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.server.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedToolOutput,
    OutputReader,
    RequiredToolOutput,
    collect,
    required_schema,
)

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {})


def hermes(name: str, arguments: dict, spacing: str = "\n") -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{spacing}{call}{spacing}</tool_call>"


def llama3(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def calls_of(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI tool_calls, after checking their shape."""
    for call in tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert set(call) == {"id", "type", "function"}
    assert len({c["id"] for c in tool_calls}) == len(tool_calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def streamed(reader: OutputReader, text: str, chunk: int) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of `chunk` characters and join the deltas as a client does."""
    content, calls = "", []
    pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    for i, piece in enumerate(pieces or [""]):
        delta = reader.feed(piece, final=i == len(pieces) - 1 or not pieces)
        content += delta.content
        for call in delta.calls:
            if call.name is None:
                calls[call.index]["function"]["arguments"] += call.arguments
            else:
                assert call.index == len(calls)
                calls.append({k: v for k, v in call.as_openai().items() if k != "index"})
    return content, calls


HERMES_CASES = {
    "no call": ("The weather is fine.", "The weather is fine.", []),
    "one call": (hermes(*WEATHER), None, [WEATHER]),
    "content then a call": (f"Let me look.\n{hermes(*WEATHER)}", "Let me look.\n", [WEATHER]),
    "two calls among content": (
        f"First {hermes(*WEATHER)}\n{hermes(*TIME, spacing='')} then done.",
        "First then done.",
        [WEATHER, TIME],
    ),
    "malformed JSON stays content": (
        '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> ok',
        '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> ok',
        [],
    ),
    "a call among malformed ones": (
        f"<tool_call>[1, 2]</tool_call>{hermes(*TIME)}",
        "<tool_call>[1, 2]</tool_call>",
        [TIME],
    ),
    "unclosed call at the end of the output": (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
        None,
        [TIME],
    ),
    "arguments as a JSON string": (
        '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
        None,
        [TIME],
    ),
    "a cut-off marker stays content": ("Done <tool_ca", "Done <tool_ca", []),
    "whitespace that starts the content is kept": (" see.\n", " see.\n", []),
    "whitespace before a first call is dropped": (f"\n\n {hermes(*TIME)}", None, [TIME]),
}

LLAMA3_CASES = {
    "no call": ("Paris is sunny today.", "Paris is sunny today.", []),
    "one call": (llama3(*WEATHER), None, [WEATHER]),
    "after the python tag": (f"<|python_tag|>{llama3(*WEATHER)}", None, [WEATHER]),
    "two calls separated by ';'": (f"{llama3(*WEATHER)}; {llama3(*TIME)}", None, [WEATHER, TIME]),
    "content around a call": (
        f"Checking: {llama3(*WEATHER)}\nback soon",
        "Checking: back soon",
        [WEATHER],
    ),
    "JSON that is not a call stays content": (
        '{"name": "Bob"} and {"name": "f", "parameters": {}, "extra": 1} {"a": {"b": 2}}',
        '{"name": "Bob"} and {"name": "f", "parameters": {}, "extra": 1} {"a": {"b": 2}}',
        [],
    ),
    "malformed JSON stays content": (
        '{"name": "get_time", "parameters": {} x',
        '{"name": "get_time", "parameters": {} x',
        [],
    ),
    "braces in prose": ("set {x} to {1, 2}", "set {x} to {1, 2}", []),
    "a call that names its type": (
        '{"type": "function", "name": "get_time", "parameters": {}}',
        None,
        [TIME],
    ),
    "another type stays content": (
        '{"type": "tool", "name": "get_time", "parameters": {}}',
        '{"type": "tool", "name": "get_time", "parameters": {}}',
        [],
    ),
}


@pytest.mark.parametrize(
    ("parser", "case"),
    [(HermesParser, c) for c in HERMES_CASES.values()]
    + [(Llama3JsonParser, c) for c in LLAMA3_CASES.values()],
    ids=[f"hermes: {k}" for k in HERMES_CASES] + [f"llama3_json: {k}" for k in LLAMA3_CASES],
)
def test_a_parser_finds_the_calls_and_keeps_the_rest_as_content(parser, case):
    text, content, calls = case
    got_content, tool_calls = collect(parser(), text)
    assert got_content == content
    assert calls_of(tool_calls) == calls


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser])
def test_an_escaped_lone_surrogate_in_arguments_stays_escaped_json(parser):
    """JSON's "\\ud83d" alone is a lone surrogate once read, which no UTF-8 body holds (the
    response was a 500): the arguments keep it escaped, and read back to the same value."""
    call = '{"name": "search", "arguments": {"q": "\\ud83d", "r": "é"}}'
    text = f"<tool_call>{call}</tool_call>" if parser is HermesParser else call
    content, tool_calls = collect(parser(), text)
    [arguments] = [c["function"]["arguments"] for c in tool_calls]
    arguments.encode()  # no UnicodeEncodeError
    assert json.loads(arguments) == {"q": "\ud83d", "r": "é"} and not content
    assert collect(parser(), text.replace('"search"', '"\\udfff"'))[1] == []  # a name cannot


def test_llama3_prose_with_json_that_can_never_be_a_call_streams_on():
    """`{"key": value}` fails to decode before its end: no more text makes it JSON, so what
    follows streams as it comes (it was held to the answer's end); JSON cut off still waits."""
    reader = Llama3JsonParser()
    text = 'Write `const o = {"key": value};` then call it. More words.'
    content = "".join(reader.feed(text[i : i + 3], final=False).content for i in range(0, 60, 3))
    assert content == text[: len(content)] and len(content) >= len(text) - 1
    for cut in (
        '{"name": "f", "parameters": {"a": tr',
        '{"name": "f", "parameters": {"a": "x',
        '{"name": "f", "parameters": {"a": -',
        '{"name": "f", "parameters": {"a": 1',
        '{"name": "f", "parameters": {"a": 12.',
        '{"name": "f", "parameters": {"a": 1e-',
    ):
        assert Llama3JsonParser().feed(cut, final=False).content == ""


def test_a_call_streamed_a_character_at_a_time_is_found_wherever_a_chunk_ends():
    """Cut inside a number ("12." "3.5e-") a call is still JSON to come, not content."""
    text = '{"name": "get_weather", "parameters": {"lat": 12.5, "lon": 3.5e-2, "n": -4}}'
    content, tool_calls = streamed(Llama3JsonParser(), text, 1)
    assert content == ""
    assert calls_of(tool_calls) == [("get_weather", {"lat": 12.5, "lon": 0.035, "n": -4})]


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    ("parser", "case"),
    [(HermesParser, c) for c in HERMES_CASES.values()]
    + [(Llama3JsonParser, c) for c in LLAMA3_CASES.values()],
    ids=[f"hermes: {k}" for k in HERMES_CASES] + [f"llama3_json: {k}" for k in LLAMA3_CASES],
)
def test_streaming_any_chunking_gives_the_same_calls_and_content(parser, case, chunk):
    text, content, calls = case
    got_content, tool_calls = streamed(parser(), text, chunk)
    assert got_content == (content or "")
    assert calls_of(tool_calls) == calls


def test_streamed_content_never_shows_the_start_of_a_call():
    reader, shown = HermesParser(), ""
    text = f"Let me look. {hermes(*WEATHER)}"
    for i, char in enumerate(text):
        shown += reader.feed(char, final=i == len(text) - 1).content
        assert "<" not in shown
    assert shown == "Let me look. " and reader.num_calls == 1


def test_a_call_is_sent_as_soon_as_it_closes():
    reader = HermesParser()
    call = hermes(*WEATHER)
    assert reader.feed(f"Hi {call[:-1]}", final=False).calls == []
    delta = reader.feed(call[-1] + " more", final=False)
    assert [(c.name, json.loads(c.arguments)) for c in delta.calls] == [WEATHER]


def required_output(calls: list[tuple[str, dict]]) -> str:
    return json.dumps([{"name": name, "parameters": args} for name, args in calls])


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_required_output_is_an_array_of_calls_each_sent_once_complete(chunk):
    text = required_output([WEATHER, TIME])
    assert calls_of(collect(RequiredToolOutput(), text)[1]) == [WEATHER, TIME]
    content, tool_calls = streamed(RequiredToolOutput(), text, chunk)
    assert (content, calls_of(tool_calls)) == ("", [WEATHER, TIME])
    reader = RequiredToolOutput()
    first_end = text.index("}}") + 2
    assert [c.name for c in reader.feed(text[:first_end], final=False).calls] == ["get_weather"]


@pytest.mark.parametrize(
    "cut", ['{"name": "get_time", "param', '{"name": "f", "parameters": {"a": [1, 2]']
)
def test_a_cut_off_required_output_keeps_its_complete_calls_and_the_rest_as_content(cut):
    text = f"[{json.dumps({'name': WEATHER[0], 'parameters': WEATHER[1]})}, {cut}"
    content, tool_calls = collect(RequiredToolOutput(), text)
    assert calls_of(tool_calls) == [WEATHER]
    assert content == cut  # as written, its own brackets too
    assert collect(RequiredToolOutput(), f"[{cut}") == (cut, [])


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser, f"Sure. {hermes(*WEATHER)}\n{hermes(*TIME)} Done."),
        (Llama3JsonParser, f"{llama3(*WEATHER)}; {llama3(*TIME)}"),
    ],
)
def test_parallel_tool_calls_false_keeps_the_first_call_alone(parser, text, chunk):
    """vLLM's filter under parallel_tool_calls false: later calls are dropped, content kept."""
    content, calls = collect(parser(), text)
    assert calls_of(calls) == [WEATHER, TIME]
    one_content, one = collect(parser(max_calls=1), text)
    assert calls_of(one) == [WEATHER] and one_content == content
    streamed_content, streamed_calls = streamed(parser(max_calls=1), text, chunk)
    assert calls_of(streamed_calls) == [WEATHER] and streamed_content == (content or "")


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_a_named_function_streams_its_arguments_as_they_come(chunk):
    arguments = json.dumps(WEATHER[1])
    content, tool_calls = streamed(NamedToolOutput("get_weather"), arguments, chunk)
    assert content == "" and calls_of(tool_calls) == [WEATHER]
    assert tool_calls[0]["function"]["arguments"] == arguments
    whole, whole_calls = collect(NamedToolOutput("get_weather"), arguments)
    assert whole is None and calls_of(whole_calls) == [WEATHER]


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
}
TIME_SCHEMA = {"type": "object", "properties": {}}


def test_required_schema_accepts_calls_to_the_tools_only():
    tools = [("get_weather", WEATHER_SCHEMA), ("get_time", TIME_SCHEMA)]
    schema = required_schema(tools, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [
        {"name": "get_weather", "parameters": WEATHER[1]},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(valid, schema)
    for invalid in (
        [],
        [{"name": "get_news", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "days": 0}}],
        [{"name": "get_weather"}],
        {"name": "get_time", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(invalid, schema)
    one = required_schema(tools, parallel=False)
    jsonschema.validate(valid[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid, one)


UNIT = {"type": "string", "enum": ["C", "F"]}


def with_unit(unit: dict) -> dict:
    """A parameters schema as pydantic writes one: a nested type under $defs, by reference."""
    return {"$defs": {"Unit": unit}, "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}  # fmt: skip


def test_required_schema_moves_the_tools_defs_to_its_root():
    """The references point at the root, which is now the array's (vLLM's
    get_tool_schema_defs); one name defined two ways is a ValueError."""
    tools = [("get_weather", with_unit(UNIT)), ("get_time", with_unit(UNIT))]
    schema = required_schema(tools, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate([{"name": "get_time", "parameters": {"unit": "C"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"unit": "K"}}], schema)
    assert tools[0][1]["$defs"] == {"Unit": UNIT}  # the request's own schema is left as it was
    with pytest.raises(ValueError, match="'Unit' differently"):
        required_schema([*tools, ("set_alarm", with_unit({"type": "string"}))], parallel=True)


@pytest.mark.parametrize(
    ("reader", "text"),
    [
        (RequiredToolOutput, '[{"name": "note", "parameters": {"text": "a\x12b\nc"}}]'),
        (
            HermesParser,
            '<tool_call>{"name": "note", "arguments": {"text": "a\x12b\nc"}}</tool_call>',
        ),
    ],
)
def test_raw_control_characters_in_strings_come_out_escaped(reader, text):
    """Some grammars (xgrammar's strings with maxLength) let them through; JSON forbids them."""
    _, [call] = collect(reader(), text)
    assert "\x12" not in call["function"]["arguments"]
    assert json.loads(call["function"]["arguments"]) == {"text": "a\x12b\nc"}


DEEP = "[" * 5000  # past Python's recursion limit for the json decoder


CUT_CALL = '{"name": "f", "parameters": {"a": ' + DEEP


@pytest.mark.parametrize(
    ("reader", "text", "content"),
    [
        (Llama3JsonParser, CUT_CALL, CUT_CALL),
        (HermesParser, "<tool_call>" + CUT_CALL, "<tool_call>" + CUT_CALL),
        (RequiredToolOutput, "[" + CUT_CALL, CUT_CALL),  # the array's own "[" is no content
    ],
    ids=["llama3", "hermes", "required"],
)
def test_output_nested_too_deep_to_decode_is_no_call_and_ends_as_content(reader, text, content):
    """A model stuck writing brackets: the reader gives up on a call, as vLLM's parsers do,
    instead of raising from the json decoder in the middle of a reply or a stream."""
    for chunk in (len(text), 997):
        assert streamed(reader(), text, chunk) == (content, [])
