"""What a request constrains its output to (response_format, structured_outputs, forced tool
calls) and how its chat output is read (tool_calls.py): the request's fields -> one
StructuredOutputsParams and an output reader, or a 400 naming the field."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.server.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    OpenAIError,
    SamplingRequest,
)
from tandem.server.tool_calls import (
    PARSERS,
    NamedToolOutput,
    OutputReader,
    PlainOutput,
    RequiredToolOutput,
    required_schema,
)
from tandem.structured import KINDS, StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes no arguments


@dataclass
class ToolMode:
    """How a chat request uses its tools."""

    reader: Callable[[], OutputReader]  # a fresh reader per choice
    constraint: dict[str, Any] | None = None  # a StructuredOutputsParams kind, e.g. {"json": ...}
    skip_special_tokens: bool = True  # False where the parser's markers are special tokens


def output_constraint(
    body: SamplingRequest, tool_constraint: dict[str, Any] | None = None
) -> StructuredOutputsParams | None:
    """The one constraint that response_format, structured_outputs and tool_choice ask for, with
    structured_outputs' options (e.g. disable_any_whitespace); None when none asks for one."""
    options = dict(body.structured_outputs or {})
    asked = {
        "structured_outputs": {
            kind: value
            for kind in KINDS
            if (value := options.pop(kind, None)) is not None and value is not False
        },
        "response_format": response_format_constraint(body),
        "tool_choice": tool_constraint or {},
    }
    asking = [name for name, kinds in asked.items() if kinds]
    if len(asking) > 1:
        raise OpenAIError(
            f"{' and '.join(asking)} each constrain the output; give one of them",
            param=asking[-1],
        )
    try:
        if not asking:  # options alone constrain nothing; their names are still checked
            StructuredOutputsParams.from_dict({**options, "json_object": True})
            return None
        return StructuredOutputsParams.from_dict({**options, **asked[asking[0]]})
    except ValueError as error:
        raise OpenAIError(str(error), param=asking[0] if asking else "structured_outputs") from None


def constraint_field(body: SamplingRequest) -> str:
    """The field a request's constraint came from, for the backend's errors."""
    if isinstance(body, ChatCompletionRequest) and (
        body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
    ):
        return "tools"
    fmt = body.response_format
    return "response_format" if fmt is not None and fmt.type != "text" else "structured_outputs"


def response_format_constraint(body: SamplingRequest) -> dict[str, Any]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "structural_tag":  # the object as xgrammar reads it (either form)
        return {"structural_tag": fmt.model_dump(exclude_none=True, exclude={"json_schema"})}
    if fmt.json_schema is None:
        raise OpenAIError(
            'response_format of type "json_schema" needs its json_schema object',
            param="response_format",
        )
    if fmt.json_schema.schema_ is None:  # OpenAI's schema is optional: then any JSON object
        return {"json_object": True}
    return {"json": fmt.json_schema.schema_}


def tool_mode(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolMode:
    """The reader and constraint of tool_choice: "none", "auto" (the default; with tools it
    needs a parser), "required" or a named function."""
    tools = [(t.function.name, t.function.parameters or EMPTY_PARAMETERS) for t in body.tools or []]
    choice = body.tool_choice or "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return ToolMode(PlainOutput)
    if not tools:
        raise OpenAIError(f"tool_choice {choice_name(choice)} needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        schema = dict(tools).get(choice.function.name)
        if schema is None:
            known = ", ".join(name for name, _ in tools)
            raise OpenAIError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({known})",
                param="tool_choice",
            )
        return ToolMode(lambda: NamedToolOutput(choice.function.name), {"json": schema})
    parallel = body.parallel_tool_calls is not False
    if choice == "required":
        try:
            schema = required_schema(tools, parallel)
        except ValueError as error:
            raise OpenAIError(str(error), param="tools") from None
        return ToolMode(RequiredToolOutput, {"json": schema})
    if tool_call_parser is None:
        raise OpenAIError(
            'tool_choice "auto" needs a tool call parser: start the server with '
            f"--enable-auto-tool-choice --tool-call-parser NAME ({', '.join(PARSERS)})",
            param="tool_choice",
        )
    parser = PARSERS[tool_call_parser]
    reader = parser if parallel else functools.partial(parser, max_calls=1)
    return ToolMode(reader, skip_special_tokens=parser.skip_special_tokens)


def choice_name(choice: str | NamedToolChoice) -> str:
    return f"{choice!r}" if isinstance(choice, str) else f"function {choice.function.name!r}"
