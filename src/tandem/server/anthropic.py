"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`; vLLM
serves it too), over the chat endpoint.

    MessagesRequest ─chat_request─> ChatCompletionRequest ─OpenAIServing.chat─> completion
        (system a system message, tool_result blocks tool messages, an assistant's tool_use
        blocks its tool_calls and its thinking its reasoning)
    completion ─message─> Message (thinking, text and tool_use blocks)
    a stream's chat chunks ─MessageEvents─> message_start, content_block_start / _delta / _stop
        per block, message_delta, message_stop

Content is text: an image block is a 400. `thinking` turns the chat template's
enable_thinking on or off (its budget_tokens taken, with no effect). As vLLM's:
`output_config.effort` is the chat's
`reasoning_effort`, a json_schema `output_config.format` its `response_format`; tool_choice
"any" is "required"; a tool_result's `is_error` and the request's `metadata` are taken, with no
effect (and `service_tier`, a label); `usage.input_tokens` leaves out the prompt tokens read from or written into the prefix
cache (`cache_read_input_tokens`, `cache_creation_input_tokens`). Errors take Anthropic's shape
(`error_response`), and Anthropic's clients may send the API key as `x-api-key`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, model_validator

from tandem.server.protocol import (
    ChatCompletionRequest,
    MessagePart,
    OpenAIError,
    RequestOption,
    Text,
    validated,
)
from tandem.server.response_output import chat_stream, new_id
from tandem.server.serving import OpenAIServing, chat_ids

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Claude Code's system block of a per-request hash: left out, as vLLM does, so that prompts share
# their prefix in the cache
BILLING_HEADER = "x-anthropic-billing-header"
# the block types each role's messages may hold, beside text
ROLE_BLOCKS = {"user": ("tool_result",), "assistant": ("tool_use", "thinking", "redacted_thinking")}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # the chat's, by Anthropic's
# Anthropic's error type of a status; any other is "invalid_request_error", or 5xx "api_error"
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class Block(MessagePart):
    """A content block. Fields of earlier answers sent back are ignored, as a chat message's."""

    # Anthropic's mark of a prefix to cache: tandem's prefix cache needs none
    cache_control: dict[str, Any] | None = None


class TextBlock(Block):
    type: Literal["text"]
    text: Text


class ImageBlock(Block):
    type: Literal["image"]
    source: dict[str, Any] | None = None


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


ToolResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[ToolResultPart] | None = None
    is_error: bool | None = None  # taken, no effect (vLLM's)


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(MessagePart):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class ToolDefinition(RequestOption):
    name: Text = Field(min_length=1)
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # a client tool; Anthropic's server tools are not served
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(RequestOption):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None  # type "tool": the tool's
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def named_tool(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError('a tool_choice of type "tool" needs the tool\'s name')
        return self


class JsonOutputFormat(RequestOption):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class Thinking(RequestOption):
    """Extended thinking: on ("enabled", "adaptive") or off, as the chat template's
    enable_thinking (vLLM ignores the field)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)  # taken, no effect
    display: str | None = None  # how Anthropic shows thinking: taken, no effect


class OutputConfig(RequestOption):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(RequestOption):
    """What a count_tokens request renders: the conversation, its tools and template options."""

    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None  # effort is the chat template's reasoning_effort
    thinking: Thinking | None = None
    chat_template_kwargs: dict[Text, Any] | None = None  # vLLM's


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(gt=0)
    stop_sequences: list[Text] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # taken, no effect
    # Anthropic's capacity tier, a label of the request as OpenAI's service_tier: no effect
    service_tier: Literal["auto", "standard_only"] | None = None


async def create(serving: OpenAIServing, body: MessagesRequest, http: HttpRequest) -> Response:
    """POST /v1/messages: the chat request's answer as a Message, or as its events."""
    answer = await serving.chat(chat_request(body), http)
    if isinstance(answer, StreamingResponse):
        events = chat_stream(answer.body_iterator, MessageEvents(new_id("msg")))
        return StreamingResponse(events, media_type="text/event-stream")
    if answer.status_code != 200:  # the client left (499)
        return answer
    return JSONResponse(message(new_id("msg"), json.loads(answer.body)))


async def count_tokens(serving: OpenAIServing, body: CountTokensRequest) -> dict[str, int]:
    """POST /v1/messages/count_tokens: the prompt tokens of the chat the request renders."""
    chat = validated(ChatCompletionRequest, chat_fields(body))
    serving.check_model(chat.model)
    _, ids = await asyncio.to_thread(chat_ids, serving.tokenizer(), chat, serving.options)
    return {"input_tokens": len(ids)}


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers `body`; a stream's asks for usage with every chunk."""
    chat = chat_fields(body) | {
        "max_tokens": body.max_tokens,
        "stop": body.stop_sequences,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stream": body.stream,
    }
    if body.stream:  # message_start carries the prompt's usage, message_delta the answer's
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return validated(ChatCompletionRequest, chat)


def chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat request's messages, tools, tool_choice and template options."""
    kwargs = body.chat_template_kwargs
    if body.thinking is not None:  # the request's own kwargs win
        kwargs = {"enable_thinking": body.thinking.type != "disabled", **(kwargs or {})}
    chat = {"model": body.model, "messages": chat_messages(body), "chat_template_kwargs": kwargs}
    if body.tools:
        chat["tools"] = [chat_tool(tool) for tool in body.tools]
    choice = body.tool_choice
    if choice is not None and choice.type == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = TOOL_CHOICES[choice.type]
    if choice is not None and choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    config = body.output_config or OutputConfig()
    if config.effort is not None:
        chat["reasoning_effort"] = config.effort
    if config.format is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"schema": config.format.schema_},
        }
    return chat


def chat_tool(tool: ToolDefinition) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages, as vLLM makes them: the system text first; a user
    message's tool_result blocks each a tool message, then its text (if any) a user message;
    an assistant's text, its tool_use blocks as tool_calls and its thinking as reasoning."""
    system = system_text(body.system)
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(body.messages):
        messages += turn_messages(turn, f"messages.{i}")
    return messages


def turn_messages(turn: Message, place: str) -> list[dict[str, Any]]:
    """One message's chat messages; `place` names it in an error."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    results, texts, calls, thoughts = [], [], [], []
    for j, block in enumerate(turn.content):
        check_block(block, turn.role, f"{place}.content.{j}")
        if isinstance(block, TextBlock) and block.text:  # an empty one is left out (vLLM's)
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            content = tool_result_text(block, f"{place}.content.{j}")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
    # one text is the content, several its text parts (vLLM's)
    content = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    if turn.role == "user":  # a user message of tool results alone is its tool messages
        return results + ([{"role": "user", "content": content}] if texts else [])
    answer: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        answer["tool_calls"] = calls
    if thoughts:
        answer["reasoning"] = "".join(thoughts)
    return [answer]


def check_block(block: ContentBlock, role: str, place: str) -> None:
    """A 400 for an image, or a block of the other role's (a user's tool_use)."""
    if isinstance(block, ImageBlock):
        raise refused_image(place)
    if block.type != "text" and block.type not in ROLE_BLOCKS[role]:
        other = "user" if role == "assistant" else "assistant"
        raise OpenAIError(
            f"{block.type} blocks belong in {other} messages, not in {role} messages", param=place
        )


def system_text(system: str | list[TextBlock] | None) -> str:
    if not isinstance(system, list):
        return system or ""
    return "".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))


def tool_result_text(block: ToolResultBlock, place: str) -> str:
    """A tool_result's content as a tool message's text: its text blocks' joined by newlines."""
    if not isinstance(block.content, list):
        return block.content or ""
    for k, part in enumerate(block.content):
        if isinstance(part, ImageBlock):
            raise refused_image(f"{place}.content.{k}")
    return "\n".join(part.text for part in block.content)


def refused_image(place: str) -> OpenAIError:
    return OpenAIError(
        "image blocks are not supported: tandem serves text models; send the content as text",
        param=place,
    )


def message(message_id: str, completion: dict[str, Any]) -> dict[str, Any]:
    """The chat completion as a Message: a thinking block, a text block and a tool_use block per
    tool call, in that order; one empty text block where there are none (Anthropic's)."""
    [choice] = completion["choices"]
    answer = choice["message"]
    content = [thinking_block(answer["reasoning"])] if answer.get("reasoning") else []
    if answer.get("content"):
        content.append(text_block(answer["content"]))
    calls = answer.get("tool_calls") or []
    for call in calls:
        function = call["function"]
        content.append(tool_use_block(call["id"], function["name"], call_input(function)))
    ended = ending(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    base = message_base(message_id, completion["model"], usage(completion["usage"]))
    return {**base, "content": content or [text_block("")], **ended}


def message_base(message_id: str, model: str, used: dict[str, int]) -> dict[str, Any]:
    """A Message without content, as message_start gives it."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": used,
    }


def text_block(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, str]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call_id: str, name: str, given: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": given}


def call_input(function: dict[str, str]) -> dict[str, Any]:
    """A tool call's arguments as its input object; {} where they are not one (cut off by
    max_tokens)."""
    try:
        given = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return {}
    return given if isinstance(given, dict) else {}


def ending(reason: str | None, matched: int | str | None, called: bool) -> dict[str, str | None]:
    """Why the answer ended, from the chat's finish_reason and stop_reason (the stop string
    that ended it), and the stop sequence."""
    if reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if called:  # a named tool's call finishes "stop" in the chat
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(matched, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def usage(chat_usage: dict[str, Any]) -> dict[str, int]:
    """The chat's usage in Anthropic's names: input tokens are the prompt's past those read from
    the prefix cache and those written into it."""
    details = chat_usage.get("prompt_tokens_details") or {}
    read, written = details.get("cached_tokens") or 0, details.get("created_cache_tokens") or 0
    return {
        "input_tokens": chat_usage["prompt_tokens"] - read - written,
        "output_tokens": chat_usage.get("completion_tokens") or 0,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": written,
    }


class MessageEvents:
    """A chat stream's chunks as the Messages API's events: message_start with the first chunk,
    then each block (thinking, text, a tool call) started by its first delta and stopped
    before the next starts, then message_delta (why it stopped, the usage) and message_stop."""

    def __init__(self, message_id: str):
        self.id = message_id
        self.started = False  # message_start was sent
        self.count = 0  # blocks started; the open one is the last
        self.open: str | int | None = None  # the open block: "thinking", "text" or a call's index
        self.calls: dict[int, int] = {}  # a tool call's index -> its block's
        self.reason: str | None = None  # the choice's finish reason
        self.matched: int | str | None = None  # its stop reason: the stop string that ended it
        self.chat_usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def read(self, chunk: dict[str, Any]) -> list[str]:
        """One chat chunk's events."""
        self.chat_usage = chunk.get("usage") or self.chat_usage  # every chunk's (continuous)
        events = []
        if not self.started:
            self.started = True
            message_start = message_base(self.id, chunk["model"], usage(self.chat_usage))
            events.append(self.event("message_start", message=message_start))
        for choice in chunk.get("choices", ()):
            delta = choice["delta"]
            if delta.get("reasoning"):
                thought = {"type": "thinking_delta", "thinking": delta["reasoning"]}
                events += self.block_delta("thinking", thinking_block(""), thought)
            if delta.get("content"):
                text = {"type": "text_delta", "text": delta["content"]}
                events += self.block_delta("text", text_block(""), text)
            for call in delta.get("tool_calls") or ():
                events += self.call_delta(call)
            if choice.get("finish_reason"):
                self.reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return events

    def block_delta(self, key: str, block: dict[str, Any], delta: dict[str, str]) -> list[str]:
        """`delta` of the block `key` names, which starts as `block` unless it is open."""
        events = self.start_block(key, block)
        return [*events, self.event("content_block_delta", index=self.count - 1, delta=delta)]

    def call_delta(self, call: dict[str, Any]) -> list[str]:
        events = []
        if call["index"] not in self.calls:  # its first delta names it
            function = call["function"]
            events += self.start_block(
                call["index"], tool_use_block(call["id"], function["name"], {})
            )
            self.calls[call["index"]] = self.count - 1
        partial = call["function"].get("arguments")
        if partial:
            delta = {"type": "input_json_delta", "partial_json": partial}
            events.append(
                self.event("content_block_delta", index=self.calls[call["index"]], delta=delta)
            )
        return events

    def start_block(self, key: str | int, block: dict[str, Any]) -> list[str]:
        """The block `key` names open for the next delta: the one open, else a new one."""
        if self.open == key:
            return []
        events = self.stop_block()
        self.open, self.count = key, self.count + 1
        return [
            *events,
            self.event("content_block_start", index=self.count - 1, content_block=block),
        ]

    def stop_block(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.count - 1)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        """The chat stream's error event: the open block stops, then Anthropic's error event."""
        return [
            *self.stop_block(),
            self.event("error", error={"type": "api_error", "message": error.get("message")}),
        ]

    def finish(self) -> list[str]:
        """The last block's stop (an empty text block's where there was none, as a Message's),
        then message_delta and message_stop."""
        events = [] if self.count else self.start_block("text", text_block(""))
        ended = ending(self.reason, self.matched, bool(self.calls))
        return [
            *events,
            *self.stop_block(),
            self.event("message_delta", delta=ended, usage=usage(self.chat_usage)),
            self.event("message_stop"),
        ]


def serves(path: str) -> bool:
    """Whether a request's path (after any --root-path prefix) is this API's."""
    return path.endswith(PATHS)


def error_response(error: OpenAIError) -> JSONResponse:
    """`error` in Anthropic's shape, with the status tandem gives it."""
    status = error.status_code
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": error.body()["error"]["message"]}}
    return JSONResponse(body, status_code=status)
