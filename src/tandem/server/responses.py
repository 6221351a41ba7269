"""OpenAI's Responses API (`POST /v1/responses`; vLLM serves it too), over the chat endpoint.

    ResponsesRequest ─chat_request─> ChatCompletionRequest ─OpenAIServing.chat─> completion
        (instructions, the stored conversation of previous_response_id, the input items)
    completion ─output_items─> Response (reasoning, message, function_call items)
    a stream's chat chunks ─StreamEvents─> response.created ... output_text.delta ...
        response.completed (or response.incomplete)          (the last two: response_output.py)

Input items: text, messages (text content parts), `function_call` and `function_call_output`
(an assistant's tool call and its result); `reasoning` items sent back are left out, as chat
templates leave past thinking out. Tools are function tools (the function's fields at the top
level); `text.format` is the chat's `response_format`, `reasoning.effort` its
`reasoning_effort`, `max_output_tokens` its `max_completion_tokens`; the chat request's
sampling and template options (top_k, seed, ...: CHAT_FIELDS) pass to it as they are.
`include=["message.output_text.logprobs"]` (with `top_logprobs`, 0-20) gives the text part the
chat's logprobs: every generated token's in a response, each chunk's on its text delta event
in a stream (a reasoning model's thinking chunks give theirs to none). With
`store` (the default), a response and its turn are kept in this server's memory (MAX_STORED
of them, the least recently used dropped first), for GET /v1/responses/{id} and for a later
request's `previous_response_id` to continue its conversation. With `background` (and `store`)
the request is answered at once, queued, while a task of this server runs the chat stream and
stores the response as it ends: GET reads it in progress and then ended, POST
/v1/responses/{id}/cancel (or DELETE) ends it early, the generation aborted (`run_in_background`).
As vLLM's: `request_id` is the response's id; `max_tool_calls` is echoed, with no effect; the
sampling fields echoed are the sampling done (the model's defaults for those not given).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tandem.sampling import GREEDY_BELOW, SamplingParams
from tandem.server.protocol import ChatCompletionRequest, OpenAIError, Text, validated
from tandem.server.response_output import (
    StreamEvents,
    assistant_message,
    finished,
    new_id,
    output_items,
    usage,
)
from tandem.server.serving import OpenAIServing, sampling_params

MAX_STORED = 1000  # responses kept for previous_response_id, the oldest dropped first
LOGPROBS = "message.output_text.logprobs"  # the one `include` value served
RUNNING = ("queued", "in_progress")  # a background response's states before it ends
LABELS = ("user", "safety_identifier", "prompt_cache_key", "service_tier")  # echoed, no effect
# fields of vLLM's chat request a response request may add (its sampling and template
# options): the chat request takes them as they are; any other field is a 400
CHAT_FIELDS = {
    "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids",
    "bad_words", "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens",
    "cache_salt", "priority", "structured_outputs", "repetition_detection",
    "thinking_token_budget", "vllm_xargs", "chat_template", "chat_template_kwargs",
    "include_reasoning",
}  # fmt: skip
# the chat request's fields that an error names, by the names of the fields they came from
RENAMED = {
    "response_format.json_schema": "text.format",  # a json_schema format's fields are its own
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


class ResponsesRequest(BaseModel):
    """OpenAI's response-create body (its hosted tools, files and images aside), and the chat
    request's sampling and template options (CHAT_FIELDS), which go to it as they are."""

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
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["disabled"] | None = None
    user: Text | None = None  # LABELS: echoed in the response
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Text | None = None
    max_tool_calls: int | None = None  # echoed, no effect (as vLLM's)
    request_id: Text | None = None  # the response's id, as it is (vLLM's)


class ResponseStore:
    """The latest MAX_STORED responses (least recently used dropped first), each with its turn
    of the conversation in chat messages: its input and its output, not the instructions, which
    a next request gives anew. A conversation is its responses' turns, followed back through
    their previous_response_id. `tag`, in every id it makes, names the store (one engine
    replica's: `owner`)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        # id -> (the response, its turn)
        self.responses: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = (
            OrderedDict()
        )
        self.running: dict[str, asyncio.Task] = {}  # background responses still generating

    def new_id(self) -> str:
        return f"resp_{self.tag}_{uuid.uuid4().hex}" if self.tag else new_id("resp")

    def put(self, response: dict[str, Any], turn: list[dict[str, Any]]) -> None:
        self.responses[response["id"]] = (response, turn)
        while len(self.responses) > MAX_STORED:
            self.responses.popitem(last=False)

    def put_answered(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        """A response that ended, its turn its input messages and its output as the answer."""
        answer = assistant_message(response["output"])
        self.put(response, [*inputs, answer] if answer else inputs)

    def get(self, response_id: str, param: str = "response_id") -> dict[str, Any]:
        """The stored response; a 404 naming `param` (the field that gave the id) if none."""
        if response_id not in self.responses:
            raise OpenAIError(
                f"no response {response_id!r} here: it was not stored (store=false), was deleted, "
                f"or was used longest ago of more than this server's {MAX_STORED}",
                404,
                param=param,
                code="not_found",
            )
        self.responses.move_to_end(response_id)  # recently used: kept longest
        return self.responses[response_id][0]

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The messages of the conversation that `response_id` ends, every response on the
        way used again; one missing is a 404."""
        turns = []
        while response_id is not None:
            response = self.get(response_id, "previous_response_id")
            if response.get("status") in RUNNING:
                raise OpenAIError(
                    f"response {response_id!r} is still {response['status']}: wait until it "
                    "ends (GET /v1/responses/{id}) or cancel it",
                    param="previous_response_id",
                )
            turns.append(self.responses[response_id][1])
            response_id = response["previous_response_id"]
        return [message for turn in reversed(turns) for message in turn]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.responses[response_id]
        task = self.running.pop(response_id, None)
        if task is not None:  # a background response: its generation ends with it
            task.cancel()

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """POST /v1/responses/{id}/cancel: a background response ended where it is, its
        generation aborted; once cancelled, the same again."""
        response = self.get(response_id)
        if not response.get("background"):
            raise OpenAIError(
                f"response {response_id!r} is not a background response: only those can be "
                "cancelled",
                param="response_id",
            )
        task = self.running.get(response_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        response = self.get(response_id)
        if response["status"] != "cancelled":
            raise OpenAIError(
                f"response {response_id!r} has already ended ({response['status']})",
                param="response_id",
            )
        return response


async def create(
    serving: OpenAIServing, store: ResponseStore, body: ResponsesRequest, http: HttpRequest
) -> Response:
    """POST /v1/responses: the chat request's answer as a Response, or as its events."""
    refuse_unsupported(body)
    response_id = store.new_id() if body.request_id is None else body.request_id
    if body.store is not False and response_id in store.responses:  # its turn would be replaced
        raise OpenAIError(
            f"request_id {response_id!r} is the id of a stored response: give a new one, or "
            "delete that response first",
            param="request_id",
        )
    history = store.conversation(body.previous_response_id) if body.previous_response_id else []
    inputs, items = input_messages(body.input)
    given = instructions(body)
    messages = [*given, *history, *inputs]
    # what each chat message came from, for an error's param
    origins = [
        *["instructions"] * len(given),
        *["previous_response_id"] * len(history),
        *[f"input.{i}" if i is not None else "input" for i in items],
    ]
    try:
        chat = chat_request(body, messages, stream=bool(body.stream or body.background))
        # the sampling the chat will do, the model's defaults filled in, for the response to echo
        params = sampling_params(chat, serving.llm.sampling_defaults, None, None)
        base = response_base(response_id, body, serving.answered_name(body.model), params)
        if body.background:
            run = run_in_background(serving, store, base, inputs, chat, http, origins)
            store.running[base["id"]] = asyncio.ensure_future(run)
            store.put({**base, "status": "queued"}, inputs)
            return JSONResponse(store.get(base["id"]))
        answer = await serving.chat(chat, http)
    except OpenAIError as error:  # the chat request's field, by this request's name
        error.param = renamed(error.param, origins)
        raise
    if isinstance(answer, StreamingResponse):
        events = StreamEvents(base, serving, store if body.store else None, inputs)
        stream = events.run(answer.body_iterator)
        return StreamingResponse(stream, media_type="text/event-stream")
    if answer.status_code != 200:  # an error the chat endpoint answered, or a client gone (499)
        return answer
    completion = json.loads(answer.body)
    [choice] = completion["choices"]
    logprobs = (choice.get("logprobs") or {}).get("content") or []
    response = finished(base, output_items(choice["message"], logprobs), choice["finish_reason"])
    response["usage"] = usage(
        completion["usage"], choice["message"], serving, choice.get("token_ids") or []
    )
    if body.store:
        store.put_answered(response, inputs)
    return JSONResponse(response)


async def run_in_background(
    serving: OpenAIServing,
    store: ResponseStore,
    base: dict[str, Any],
    inputs: list[dict[str, Any]],
    chat: ChatCompletionRequest,
    http: HttpRequest,
    origins: list[str],
) -> None:
    """A background response: the chat stream read to its end (no client reads its events),
    the response stored in progress, then as it ended: completed, incomplete, failed, or
    cancelled (the task cancelled: the stream closed, which aborts the generation)."""
    response_id = base["id"]
    events = StreamEvents({**base, "status": "in_progress"}, serving, None, inputs)
    try:
        store.put(events.base, inputs)
        answer = await serving.chat(chat, http)
        if not isinstance(answer, StreamingResponse):  # an error answered before generating
            error = json.loads(answer.body)["error"]
            error["param"] = renamed(error.get("param"), origins)
            response = {**base, "status": "failed", "error": error}
        else:
            async for _ in events.run(answer.body_iterator):
                pass
            response = events.response
    except OpenAIError as error:
        error.param = renamed(error.param, origins)
        response = {**base, "status": "failed", "error": error.body()["error"]}
    except asyncio.CancelledError:
        if response_id in store.responses:  # cancelled, not deleted
            store.put_answered({**base, "status": "cancelled", "output": events.output}, inputs)
        raise
    finally:
        store.running.pop(response_id, None)
    if response_id in store.responses:
        store.put_answered(response, inputs)


def renamed(param: str | None, origins: list[str]) -> str | None:
    """A chat request's field (e.g. max_completion_tokens) by the name this request gave it;
    messages.N by what the message came from (`origins`: input.i, previous_response_id, ...)."""
    index = re.match(r"messages\.(\d+)", param or "")
    if index and int(index[1]) < len(origins):
        return origins[int(index[1])] + param[index.end() :]
    for chat_name, name in RENAMED.items():  # the longer names first
        if param == chat_name or (param or "").startswith(chat_name + "."):
            return name + param[len(chat_name) :]
    return param


# vLLM's request fields taken at the value that asks for what this server does
NEUTRAL_FIELDS = {"enable_response_messages": False}


def refuse_unsupported(body: ResponsesRequest) -> None:
    for name, value in (body.model_extra or {}).items():
        neutral = name in NEUTRAL_FIELDS and value is NEUTRAL_FIELDS[name]
        if value is not None and name not in CHAT_FIELDS and not neutral:
            raise OpenAIError(
                f"{name} is not a field of a response request (nor one of the chat options it "
                f"takes: {', '.join(sorted(CHAT_FIELDS))})",
                param=name,
            )
    if body.background and body.store is False:
        raise OpenAIError("a background response must be stored: store=false", param="store")
    if body.background and body.stream:
        raise OpenAIError(
            "background responses are not streamed here: create it, then GET it",
            param="stream",
        )
    others = [value for value in body.include or () if value != LOGPROBS]
    if others:
        raise OpenAIError(f"include {others} is not supported (only {LOGPROBS!r})", param="include")
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            raise OpenAIError(
                f"only function tools are supported, got {tool.get('type')!r}",
                param=f"tools.{i}.type",
            )


def instructions(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [] if body.instructions is None else [{"role": "system", "content": body.instructions}]


INPUT_ROLES = ("user", "assistant", "system", "developer")  # OpenAI's input message's
STATUSES = ("in_progress", "completed", "incomplete")  # an input item's status, if it has one


def input_messages(
    items: str | list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The input items as chat messages, and the index of the item each began with (None for a
    text input); consecutive function calls join one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [None]
    messages: list[dict[str, Any]] = []
    starts: list[int | None] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in INPUT_ROLES:
                raise OpenAIError(
                    f"an input message's role must be one of {', '.join(INPUT_ROLES)}, got "
                    f"{item.get('role')!r:.40}",
                    param=f"input.{i}.role",
                )
            messages.append({"role": item.get("role"), "content": message_text(item, i)})
        elif kind == "function_call":
            check_fields(item, i, ("call_id", "name", "arguments"))
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            check_fields(item, i, ("call_id",))
            if item.get("output") is None:
                raise OpenAIError(
                    "a function_call_output item needs its output", param=f"input.{i}.output"
                )
            output = item.get("output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        elif kind == "reasoning":  # checked, then left out
            check_fields(item, i, ())
            if not isinstance(item.get("summary"), list):
                raise OpenAIError(
                    f"a reasoning item needs its summary as a list of summary_text parts ([] for "
                    f"none), got {item.get('summary')!r:.40}",
                    param=f"input.{i}.summary",
                )
        else:
            raise OpenAIError(f"input items of type {kind!r} are not supported", param=f"input.{i}")
        starts += [i] * (len(messages) - len(starts))  # the message it began, if any
    return messages, starts


def check_fields(item: dict[str, Any], index: int, names: tuple[str, ...]) -> None:
    """A 400 naming the first of an input item's required text fields (`names`) it lacks, or
    its id or status where they are not of OpenAI's types."""
    for name in names:
        if not isinstance(item.get(name), str):
            raise OpenAIError(
                f"a {item.get('type')} item needs {name} as a string, got {item.get(name)!r:.40}",
                param=f"input.{index}.{name}",
            )
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise OpenAIError(
            f"an input item's id is a string, got {item['id']!r:.40}", param=f"input.{index}.id"
        )
    if item.get("status") is not None and item["status"] not in STATUSES:
        raise OpenAIError(
            f"an input item's status is one of {', '.join(STATUSES)}, got {item['status']!r:.40}",
            param=f"input.{index}.status",
        )


def message_text(item: dict[str, Any], index: int) -> str | list[dict[str, Any]]:
    """A message item's content as chat takes it: its text, or its text parts' texts. As in
    OpenAI's types, the parts are all input_text, or all output_text in an assistant's output
    message (an item of type "message", its id and status checked)."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(
            f"a message needs its content as a string or a list of parts, got {content!r:.40}",
            param=f"input.{index}.content",
        )
    kinds = [
        part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content
    ]
    output = item.get("type") == "message" and item["role"] == "assistant"
    kind = "output_text" if output and kinds[:1] == ["output_text"] else "input_text"
    if kind == "output_text":
        check_fields(item, index, ())
    parts = []
    for j, part in enumerate(content):
        if kinds[j] not in ("input_text", "output_text"):
            raise OpenAIError(
                f"content parts of type {kinds[j]!r} are not supported (text parts only)",
                param=f"input.{index}.content.{j}",
            )
        if kinds[j] != kind:
            raise OpenAIError(
                f"this message's text parts are {kind}s, got an {kinds[j]}: output_text parts "
                "are an assistant's output message's (type \"message\"), each of its parts",
                param=f"input.{index}.content.{j}.type",
            )
        if not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"a text part needs its text as a string, got {part.get('text')!r:.40}",
                param=f"input.{index}.content.{j}.text",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def chat_request(
    body: ResponsesRequest, messages: list[dict[str, Any]], stream: bool
) -> ChatCompletionRequest:
    """The chat request that answers `body`, its messages given; `stream`: as chunks."""
    extra = body.model_extra or {}
    chat: dict[str, Any] = {k: v for k, v in extra.items() if k not in NEUTRAL_FIELDS}
    # the output's ids count its thinking's tokens (response_output.usage)
    chat |= {"model": body.model, "messages": messages, "stream": stream, "return_token_ids": True}
    if stream:
        chat["stream_options"] = {"include_usage": True}
    if LOGPROBS in (body.include or ()):
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
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
    if text_format is not None and not isinstance(text_format, dict):
        raise OpenAIError(
            f"text.format must be an object with a type, got {text_format!r:.40}",
            param="text.format",
        )
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


def response_base(
    response_id: str, body: ResponsesRequest, model: str, params: SamplingParams
) -> dict[str, Any]:
    """The response object's fields that echo the request, status in progress; its sampling
    fields are `params`', the sampling done (vLLM's: the model's defaults for those not given,
    top_p 1 when greedy)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": bool(body.background),
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
        "temperature": params.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": 1.0 if params.temperature < GREEDY_BELOW else params.top_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "top_logprobs": (body.top_logprobs or 0) if LOGPROBS in (body.include or ()) else None,
        "max_tool_calls": body.max_tool_calls,
        "truncation": "disabled",
        "usage": None,
        "metadata": body.metadata or {},
        **{name: getattr(body, name) for name in LABELS},
    }


def owner(method: str, path: str, body: bytes) -> str | None:
    """The tag of the store that holds the response a request reads: a new response's
    previous_response_id, or the one GET, DELETE or a cancel name; None for any other request."""
    if path.startswith("/v1/responses/") and method in ("GET", "DELETE"):
        response_id = path.removeprefix("/v1/responses/")
    elif path.startswith("/v1/responses/") and path.endswith("/cancel") and method == "POST":
        response_id = path.removeprefix("/v1/responses/").removesuffix("/cancel")
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
