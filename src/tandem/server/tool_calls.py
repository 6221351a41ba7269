"""Tool calls in a chat output: read as the text grows, in the shape OpenAI streams them.

A reader turns one choice's output text into content and tool calls. It is fed the text deltas
as they arrive (`feed`), so a stream sends each part once it is settled; an answer that is not
streamed feeds the whole text at once, so both give the same calls and content.

- `PlainOutput`: everything is content (no tools, or tool_choice "none").
- `NamedToolOutput`: tool_choice names a function; the output, constrained to the function's
  parameters schema, is its arguments, streamed as they come.
- `RequiredToolOutput`: tool_choice "required"; the output, constrained to `required_schema`, is
  a JSON array of {"name", "parameters"} objects, each sent once it is complete.
- `HermesParser`, `Llama3JsonParser` (tool_choice "auto", `--tool-call-parser`): the model's own
  format. Text that may still become a call is held back; the rest is content at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

WHITESPACE = " \t\r\n"
# lenient about control characters inside strings, which some grammars let through: the calls'
# arguments are written out again, escaped
DECODER = json.JSONDecoder(strict=False)
# what a parser read at a place: None while it may still grow, else (its end, (name, arguments)
# of a call, or None when it is content)
Read = tuple[int, tuple[str, str] | None] | None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """A piece of the index-th call: its id and name come with its first piece only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is None:
            return {"index": self.index, "function": function}
        function = {"name": self.name, **function}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class OutputDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class OutputReader:
    """One choice's output text -> content and tool calls, as it grows."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> OutputDelta:
        """The content and call pieces that `text` (the next delta) settles; `final`: it is the
        last one."""
        raise NotImplementedError

    def whole_call(self, name: str, arguments: str) -> CallDelta:
        """The next call, whole in one piece."""
        self.num_calls += 1
        return CallDelta(self.num_calls - 1, arguments, new_call_id(), name)


class PlainOutput(OutputReader):
    def feed(self, text: str, final: bool) -> OutputDelta:
        return OutputDelta(content=text)


class NamedToolOutput(OutputReader):
    """The output is the named function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str, final: bool) -> OutputDelta:
        if self.num_calls == 0:
            return OutputDelta(calls=[self.whole_call(self.name, text)])
        return OutputDelta(calls=[CallDelta(0, text)] if text else [])


class RequiredToolOutput(OutputReader):
    """The output is a JSON array of {"name", "parameters"} objects (`required_schema`); each
    is sent once complete. What does not read as one (a cut-off output) ends as content."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.pos = 0  # where the next element, or the array's "[" or "]", may start

    def feed(self, text: str, final: bool) -> OutputDelta:
        self.text += text
        delta = OutputDelta()
        while True:
            self.pos = skip(self.text, self.pos, WHITESPACE + "[,")
            try:
                value, end = DECODER.raw_decode(self.text, self.pos)
            except (json.JSONDecodeError, RecursionError):  # nested too deep: not a call
                break  # the element is still growing (the grammar keeps the output valid)
            call = call_of(value, "parameters")
            if call is None:
                break
            delta.calls.append(self.whole_call(*call))
            self.pos = end
        if final:  # the element cut off, as written, unless it is the array's end
            rest = self.text[self.pos :].rstrip(WHITESPACE)
            delta.content, self.pos = "" if rest == "]" else rest, len(self.text)
        return delta


class ModelFormatParser(OutputReader):
    """Tool calls in a model's own format, among content. Subclasses say where a call may start
    (`find_start`) and read one there (`read_call`). Whitespace that starts the output is held
    and dropped where a call follows it; separators after a call are dropped."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]]
    separators: ClassVar[str] = WHITESPACE  # skipped after a call
    skip_special_tokens: ClassVar[bool] = True  # False: the markers are special tokens

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__()
        self.max_calls = max_calls  # 1 under parallel_tool_calls false: later calls are dropped
        self.text = ""
        self.pos = 0  # text before it is settled: sent as content, dropped, or a call
        self.skipping = ""  # what is dropped at pos: the separators after a call

    def feed(self, text: str, final: bool) -> OutputDelta:
        self.text += text
        delta = OutputDelta()
        while True:
            self.pos = skip(self.text, self.pos, self.skipping)
            start = self.find_start(self.text, self.pos)
            if start < 0:
                self.add_content(delta, len(self.text) if final else self.settled_end())
                break
            read = self.read_call(self.text, start, final)
            self.add_content(delta, start)
            if read is None:  # the call may still be growing
                break
            end, call = read
            if call is None:  # not a call after all: content up to its end
                self.add_content(delta, end)
                continue
            if self.max_calls is None or self.num_calls < self.max_calls:
                delta.calls.append(self.whole_call(*call))
            self.pos, self.skipping = end, self.separators
        return delta

    def add_content(self, delta: OutputDelta, end: int) -> None:
        """Content up to `end`; whitespace that starts the output is held until more follows."""
        if end > self.pos and (self.pos > 0 or self.text[:end].strip(WHITESPACE)):
            delta.content += self.text[self.pos : end]
            self.pos, self.skipping = end, ""

    def settled_end(self) -> int:
        """The end of the text that can no longer start a call: before a tail that a start
        marker begins with (E.g. "Sure <tool" -> "Sure ")."""
        text, room = self.text, len(self.text) - self.pos
        held = [
            size
            for marker in self.start_markers
            for size in range(1, min(len(marker), room + 1))
            if text.endswith(marker[:size])
        ]
        return len(text) - max(held, default=0)

    def find_start(self, text: str, pos: int) -> int:
        """The first place at or after `pos` where a call may start, or -1."""
        found = [i for i in (text.find(m, pos) for m in self.start_markers) if i >= 0]
        return min(found, default=-1)

    def read_call(self, text: str, start: int, final: bool) -> Read:
        """What is at `start` (see `Read`)."""
        raise NotImplementedError


class HermesParser(ModelFormatParser):
    """Hermes and Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number."""

    name = "hermes"
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    skip_special_tokens = False  # Hermes 2 Pro's markers are special tokens

    def read_call(self, text: str, start: int, final: bool) -> Read:
        body_start = start + len(self.start_markers[0])
        close = text.find(self.end_marker, body_start)
        if close < 0 and not final:
            return None
        end = len(text) if close < 0 else close + len(self.end_marker)  # unclosed at the end
        body = text[body_start : len(text) if close < 0 else close]
        return end, call_of(loads(body), "arguments", "parameters")


class Llama3JsonParser(ModelFormatParser):
    """Llama 3.x: {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, calls
    separated by ";"."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    start_markers = (python_tag, "{")
    separators = WHITESPACE + ";"

    def read_call(self, text: str, start: int, final: bool) -> Read:
        tagged = text.startswith(self.python_tag, start)
        brace = skip(text, start + len(self.python_tag), WHITESPACE) if tagged else start
        after_brace = skip(text, brace + 1, WHITESPACE)
        if (tagged and brace == len(text)) or after_brace == len(text):
            return None if not final else (len(text), None)
        if text[brace] != "{" or text[after_brace] != '"':  # no JSON object of keys
            return brace + (0 if tagged else 1), None
        try:
            value, end = DECODER.raw_decode(text, brace)
        except json.JSONDecodeError as error:  # more text may complete it, or never will
            return None if not final and may_complete(text, error) else (brace + 1, None)
        except RecursionError:  # nested too deep: not a call
            return brace + 1, None
        call = call_of(value, "parameters", "arguments", exact=True)
        return end, call


PARSERS: dict[str, type[ModelFormatParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def call_of(value: Any, *argument_keys: str, exact: bool = False) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a {"name": ..., <an argument key>: {...}} object, or
    None. `exact`: no other keys but "type": "function" (a bare JSON object among content must
    look like a call)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [k for k in argument_keys if k in value]
    typed = value.get("type") == "function"
    if exact and (len(keys) != 1 or len(value) != 2 + typed):
        return None
    arguments = value[keys[0]] if keys else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = loads(arguments)
    if not isinstance(arguments, dict) or not utf8(value["name"]):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    if not utf8(text):  # an escaped lone surrogate ("\ud83d") stays escaped: no UTF-8 holds it
        text = json.dumps(arguments)
    return value["name"], text


JSON_STARTS = ("true", "false", "null", "NaN", "Infinity", "-Infinity", "-")


def may_complete(text: str, error: json.JSONDecodeError) -> bool:
    """Whether JSON that failed to decode may yet decode once more text comes: it failed at its
    end, inside a string, an escape or a literal cut there (`{"a": tr`), not before (prose's
    `{"key": value}` never will, and its text need not wait for the answer's end)."""
    rest = text[error.pos :]
    return (
        error.msg.startswith("Unterminated string")
        or ("escape" in error.msg and len(rest) < 6)
        or any(start.startswith(rest) for start in JSON_STARTS)
        or re.fullmatch(r"[\d.eE+-]+", rest) is not None  # a number cut there: "12." "1e-"
    )


def utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (no lone surrogate, which JSON's escapes can make)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def loads(text: str) -> Any:
    try:
        return DECODER.decode(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def collect(reader: OutputReader, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's content (None if blank) and its OpenAI `tool_calls`."""
    delta = reader.feed(text, final=True)
    calls: list[dict[str, Any]] = []
    for piece in delta.calls:
        if piece.name is None:
            calls[piece.index]["function"]["arguments"] += piece.arguments
        else:
            calls.append(piece.as_openai())
            del calls[-1]["index"]
    content = delta.content if delta.content.strip() else None
    return content, calls


def required_schema(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required": an array of one or more calls, each
    {"name": one tool's name, "parameters": that tool's parameters schema}; one call at most
    unless `parallel`. The tools' "$defs" move to the root, where their "#/$defs/..."
    references point; a name two tools define differently is a ValueError."""
    defs: dict[str, Any] = {}
    calls = []
    for name, parameters in tools:
        own = parameters.get("$defs") or {}
        for key, definition in own.items():
            if defs.setdefault(key, definition) != definition:
                raise ValueError(
                    f'tools define $defs {key!r} differently; tool_choice "required" needs '
                    "each name to mean one schema"
                )
        parameters = {k: v for k, v in parameters.items() if k != "$defs"}
        calls.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
