"""OpenAI's Responses API (`POST /v1/responses`; vLLM serves it too), over the chat endpoint.

    ResponsesRequest ─chat_request─> ChatCompletionRequest ─OpenAIServing.chat─> completion
        (instructions, the stored conversation of previous_response_id, the input items)
    completion ─output_items─> Response (reasoning, message, function_call items)
    a stream's chat chunks ─StreamEvents─> response.created ... output_text.delta ...
        response.completed (or response.incomplete)

Input items: text, messages (text content parts), `function_call` and `function_call_output`
(an assistant's tool call and its result); `reasoning` items sent back are left out, as chat
templates leave past thinking out. Tools are function tools (the function's fields at the top
level); `text.format` is the chat's `response_format`, `reasoning.effort` its
`reasoning_effort`, `max_output_tokens` its `max_completion_tokens`; other chat fields (top_k,
seed, ...) pass to the chat request as they are. With `store` (the default), a response is kept
in this server's memory, the latest MAX_STORED, for GET /v1/responses/{id} and for a later
request's `previous_response_id` to continue its conversation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from tandem.server.protocol import ChatCompletionRequest, OpenAIError, Text, validated
from tandem.server.serving import OpenAIServing

MAX_STORED = 1000  # responses kept for previous_response_id, the oldest dropped first
LABELS = ("user", "safety_identifier", "prompt_cache_key", "service_tier")  # echoed, no effect
# the chat request's fields that an error names, by the names of the fields they came from
RENAMED = {
    "response_format.json_schema": "text.format",  # a json_schema format's fields are its own
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


class ResponsesRequest(BaseModel):
    """OpenAI's response-create body (its hosted tools, files and images aside); fields it does
    not declare go to the chat request, which refuses those it does not know."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    user: Text | None = None  # LABELS: echoed in the response
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Text | None = None


class ResponseStore:
    """The latest MAX_STORED responses and, for each, its conversation in chat messages (the
    input and the output; not the instructions, which a next request gives anew). `tag`, in
    every id it makes, names the store (one engine replica's: `owner`)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.responses: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = (
            OrderedDict()
        )

    def new_id(self) -> str:
        return f"resp_{self.tag}_{uuid.uuid4().hex}" if self.tag else new_id("resp")

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.responses[response["id"]] = (response, conversation)
        while len(self.responses) > MAX_STORED:
            self.responses.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if response_id not in self.responses:
            raise OpenAIError(
                f"no response {response_id!r} here: it was not stored (store=false), was deleted, "
                f"or is older than this server's latest {MAX_STORED}",
                404,
                param="previous_response_id",
                code="not_found",
            )
        return self.responses[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.responses[response_id]


async def create(
    serving: OpenAIServing, store: ResponseStore, body: ResponsesRequest, http: HttpRequest
) -> Response:
    """POST /v1/responses: the chat request's answer as a Response, or as its events."""
    refuse_unsupported(body)
    history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
    inputs = input_messages(body.input)
    try:
        chat = chat_request(body, [*instructions(body), *history, *inputs])
        answer = await serving.chat(chat, http)
    except OpenAIError as error:  # the chat request's field, by this request's name
        error.param = renamed(error.param)
        raise
    base = response_base(store.new_id(), body, serving.answered_name(body.model))
    conversation = [*history, *inputs]
    if isinstance(answer, StreamingResponse):
        events = StreamEvents(base, serving, store if body.store else None, conversation)
        stream = events.run(answer.body_iterator)
        return StreamingResponse(stream, media_type="text/event-stream")
    if answer.status_code != 200:  # an error the chat endpoint answered, or a client gone (499)
        return answer
    completion = json.loads(answer.body)
    [choice] = completion["choices"]
    response = finished(base, output_items(choice["message"]), choice["finish_reason"])
    response["usage"] = usage(completion["usage"], choice["message"], serving)
    if body.store:
        store.put(response, [*conversation, assistant_message(response["output"])])
    return JSONResponse(response)


def renamed(param: str | None) -> str | None:
    """A chat request's field (e.g. max_completion_tokens) by the name this request gave it."""
    for chat_name, name in RENAMED.items():  # the longer names first
        if param == chat_name or (param or "").startswith(chat_name + "."):
            return name + param[len(chat_name) :]
    return param


def refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise OpenAIError("background responses are not supported", param="background")
    if body.include:
        raise OpenAIError(f"include {body.include} is not supported", param="include")
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            raise OpenAIError(
                f"only function tools are supported, got {tool.get('type')!r}",
                param=f"tools.{i}.type",
            )


def instructions(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [] if body.instructions is None else [{"role": "system", "content": body.instructions}]


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages; consecutive function calls join one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": message_text(item, i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        elif kind != "reasoning":
            raise OpenAIError(f"input items of type {kind!r} are not supported", param=f"input.{i}")
    return messages


def message_text(item: dict[str, Any], index: int) -> Any:
    """A message item's content as chat takes it: its text, or its text parts' texts."""
    content = item.get("content")
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(
                f"content parts of type {kind!r} are not supported (text parts only)",
                param=f"input.{index}.content.{j}",
            )
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers `body`, its messages given."""
    chat: dict[str, Any] = dict(body.model_extra or {})
    chat |= {"model": body.model, "messages": messages, "stream": bool(body.stream)}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for name, value in (
        ("max_completion_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("parallel_tool_calls", body.parallel_tool_calls),
    ):
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [chat_tool(tool) for tool in body.tools]
    if isinstance(body.tool_choice, dict):
        chat["tool_choice"] = {
            "type": "function",
            "function": {"name": body.tool_choice.get("name")},
        }
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    text_format = (body.text or {}).get("format")
    if text_format is not None and text_format.get("type") != "text":
        chat["response_format"] = response_format(text_format)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return validated(ChatCompletionRequest, chat)


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


def response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """`text.format` as the chat's response_format."""
    if text_format.get("type") != "json_schema":
        return text_format
    schema = {k: v for k, v in text_format.items() if k != "type"}
    return {"type": "json_schema", "json_schema": schema}


def response_base(response_id: str, body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object's fields that echo the request, status in progress."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store is not False,
        "temperature": body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "metadata": body.metadata or {},
        **{name: getattr(body, name) for name in LABELS},
    }


def finished(base: dict[str, Any], output: list[dict[str, Any]], reason: str | None) -> dict:
    """The final response: completed, or incomplete where max_output_tokens cut it."""
    response = {**base, "output": output, "status": "completed"}
    if reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its reasoning, its text, its tool calls."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(
            call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    return items


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the assistant's chat message, for the conversation stored."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def usage(chat_usage: dict[str, Any], message: dict[str, Any], serving: OpenAIServing) -> dict:
    """The chat's usage in the Responses API's names; reasoning tokens are its reasoning
    text's tokens, encoded again."""
    details = chat_usage.get("prompt_tokens_details") or {}
    reasoning = message.get("reasoning")
    tokenizer = serving.llm.tokenizer
    thought = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": thought},
        "total_tokens": chat_usage["total_tokens"],
    }


class StreamEvents:
    """A chat stream's chunks as the Responses API's events, each with its sequence number:
    items open as their first delta comes (reasoning, then the message, then each tool call)
    and close before the next opens or at the end; the final response is stored."""

    def __init__(
        self,
        base: dict[str, Any],
        serving: OpenAIServing,
        store: ResponseStore | None,
        conversation: list[dict[str, Any]],
    ):
        self.base, self.serving, self.store, self.conversation = base, serving, store, conversation
        self.number = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item deltas go to
        self.open_text = ""  # the open reasoning or message item's text so far
        self.calls: dict[int, dict[str, Any]] = {}  # a tool call's index -> its item
        self.reason: str | None = None  # the choice's finish reason
        self.reasoning = ""  # the answer's thinking so far (its tokens counted at the end)
        self.chat_usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        self.number += 1
        payload = {"type": kind, "sequence_number": self.number, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def run(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.base)
        yield self.event("response.in_progress", response=self.base)
        try:
            async for raw in chunks:
                for chunk in sse_data(raw):
                    if "error" in chunk:  # the chat stream's error event: the response failed
                        for event in self.failed(chunk["error"]):
                            yield event
                        return
                    for event in self.read(chunk):
                        yield event
        finally:  # a client gone: the chat stream ends, and its request is aborted
            await chunks.aclose()
        for event in self.finish():
            yield event

    def read(self, chunk: dict[str, Any]) -> list[str]:
        """One chat chunk's events."""
        events = []
        if chunk.get("usage"):
            self.chat_usage = chunk["usage"]
        for choice in chunk.get("choices", ()):
            self.reasoning += choice["delta"].get("reasoning") or ""
            events += self.feed(choice["delta"])
            self.reason = choice.get("finish_reason") or self.reason
        return events

    def failed(self, error: dict[str, Any]) -> list[str]:
        response = {**self.base, "status": "failed", "output": self.output, "error": error}
        return [
            *self.close(),
            # OpenAI's error event: its type is "error", the error's own type left out
            self.event("error", **{k: error.get(k) for k in ("code", "message", "param")}),
            self.event("response.failed", response=response),
        ]

    def finish(self) -> list[str]:
        """The last items' done events, then the response's: completed, or incomplete."""
        events = self.close()
        response = finished(self.base, self.output, self.reason)
        if self.chat_usage is not None:
            message = {"reasoning": self.reasoning}
            response["usage"] = usage(self.chat_usage, message, self.serving)
        if self.store is not None:
            self.store.put(response, [*self.conversation, assistant_message(self.output)])
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response)]

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events = []
        if delta.get("reasoning"):
            events += self.open_item("reasoning")
            events.append(self.text_delta("response.reasoning_text.delta", delta["reasoning"]))
        if delta.get("content"):
            events += self.open_item("message")
            events.append(self.text_delta("response.output_text.delta", delta["content"]))
        for call in delta.get("tool_calls") or ():
            events += self.call_delta(call)
        return events

    def open_item(self, kind: str) -> list[str]:
        """The item of `kind` open for the next delta: the one open, else a new one."""
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self.close()
        if kind == "reasoning":
            item = reasoning_item(new_id("rs"), "")
        else:
            item = message_item(new_id("msg"), None, "in_progress")
        self.open, self.open_text = item, ""
        events.append(
            self.event("response.output_item.added", output_index=len(self.output), item=item)
        )
        if kind == "message":
            place = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
            events.append(self.event("response.content_part.added", **place, part=output_text("")))
        return events

    def text_delta(self, kind: str, text: str) -> str:
        self.open_text += text
        place = {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}
        logprobs = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self.event(kind, **place, delta=text, **logprobs)

    def call_delta(self, call: dict[str, Any]) -> list[str]:
        events = []
        arguments = call.get("function", {}).get("arguments") or ""
        item = self.calls.get(call["index"])
        if item is None:  # its first delta names it
            events += self.close()
            function = call["function"]
            item = call_item(new_id("fc"), call["id"], function["name"], "", "in_progress")
            self.calls[call["index"]] = self.open = item
            index = len(self.output)
            events.append(self.event("response.output_item.added", output_index=index, item=item))
        item["arguments"] += arguments
        if arguments:
            place = {"item_id": item["id"], "output_index": len(self.output)}
            events.append(
                self.event("response.function_call_arguments.delta", **place, delta=arguments)
            )
        return events

    def close(self) -> list[str]:
        """The open item's done events; it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, text = len(self.output), self.open_text
        place = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            item.update(reasoning_item(item["id"], text))
            events = [
                self.event("response.reasoning_text.done", **place, content_index=0, text=text)
            ]
        elif item["type"] == "message":
            item.update(message_item(item["id"], text, "completed"))
            events = [
                self.event(
                    "response.output_text.done", **place, content_index=0, text=text, logprobs=[]
                ),
                self.event(
                    "response.content_part.done", **place, content_index=0, part=item["content"][0]
                ),
            ]
        else:
            item["status"] = "completed"
            arguments = item["arguments"]
            events = [
                self.event("response.function_call_arguments.done", **place, arguments=arguments)
            ]
        self.output.append(item)
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def owner(method: str, path: str, body: bytes) -> str | None:
    """The tag of the store that holds the response a request reads: a new response's
    previous_response_id, or the one GET or DELETE name; None for any other request."""
    if path.startswith("/v1/responses/") and method in ("GET", "DELETE"):
        response_id = path.removeprefix("/v1/responses/")
    elif path == "/v1/responses" and method == "POST":
        try:
            request = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return None
        response_id = request.get("previous_response_id") if isinstance(request, dict) else None
    else:
        return None
    if not isinstance(response_id, str) or not response_id.startswith("resp_"):
        return None
    tag, _, _ = response_id.removeprefix("resp_").rpartition("_")
    return tag or None


def sse_data(raw: str | bytes) -> list[dict[str, Any]]:
    """The JSON objects of a chat stream's server-sent events (its `[DONE]` left out)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
