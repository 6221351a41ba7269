"""A chat answer as the Responses API's output (responses.py): its output items (a reasoning
item, a message of output_text, function calls), its usage, and a chat stream's chunks as the
Responses API's events, each item opened by its first delta and closed before the next opens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tandem.server.responses import ResponseStore
    from tandem.server.serving import OpenAIServing


def finished(base: dict[str, Any], output: list[dict[str, Any]], reason: str | None) -> dict:
    """The final response: completed, or incomplete where max_output_tokens cut it."""
    response = {**base, "output": output, "status": "completed"}
    if reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


def output_items(
    message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its reasoning, its text (with `logprobs`, the
    chat's logprobs.content, where asked for), its tool calls."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed", logprobs))
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


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [thought(text)] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def thought(text: str) -> dict[str, str]:
    """A reasoning item's text part."""
    return {"type": "reasoning_text", "text": text}


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if text is None else [output_text(text, logprobs)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A text part; `logprobs` as the chat gives them (token, logprob, bytes, top_logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The output items as the assistant's chat message, for the turn stored; None where they
    hold no text and no call (cut off while thinking, cancelled early), as vLLM's history."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]  # fmt: skip
    if not (text or calls):
        return None
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def usage(
    chat_usage: dict[str, Any],
    message: dict[str, Any],
    serving: OpenAIServing,
    token_ids: list[int],
) -> dict:
    """The chat's usage in the Responses API's names; reasoning tokens are the output's tokens
    (`token_ids`) inside its thinking, its tags left out, as vLLM counts them from the ids."""
    details = chat_usage.get("prompt_tokens_details") or {}
    think = serving.llm.engine.think_tokens
    thought = 0
    if message.get("reasoning") and think is not None:
        end = token_ids.index(think.end) if think.end in token_ids else len(token_ids)
        thought = sum(1 for token in token_ids[:end] if token != think.start)
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
        inputs: list[dict[str, Any]],
    ):
        self.base, self.serving, self.store, self.inputs = base, serving, store, inputs
        self.number = -1  # the first event's is 0, as OpenAI's and vLLM's
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item deltas go to
        self.open_text = ""  # the open reasoning or message item's text so far
        self.open_logprobs: list[dict[str, Any]] = []  # the open message's text's, where asked
        # logprobs of chunks without text (a character's bytes held back): the next text's
        self.pending_logprobs: list[dict[str, Any]] = []
        self.calls: dict[int, dict[str, Any]] = {}  # a tool call's index -> its item
        self.reason: str | None = None  # the choice's finish reason
        self.reasoning = ""  # the answer's thinking so far
        self.token_ids: list[
            int
        ] = []  # the answer's tokens so far (its thinking counted at the end)
        self.chat_usage: dict[str, Any] | None = None
        self.response: dict[str, Any] | None = None  # the final response, once it ended

    def event(self, kind: str, **fields: Any) -> str:
        self.number += 1
        payload = {"type": kind, "sequence_number": self.number, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def run(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        opening = [
            self.event("response.created", response=self.base),
            self.event("response.in_progress", response=self.base),
        ]
        return chat_stream(chunks, self, opening)

    def read(self, chunk: dict[str, Any]) -> list[str]:
        """One chat chunk's events."""
        events = []
        if chunk.get("usage"):
            self.chat_usage = chunk["usage"]
        for choice in chunk.get("choices", ()):
            self.reasoning += choice["delta"].get("reasoning") or ""
            self.token_ids += choice.get("token_ids") or []
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            events += self.feed(choice["delta"], logprobs)
            self.reason = choice.get("finish_reason") or self.reason
        return events

    def failed(self, error: dict[str, Any]) -> list[str]:
        response = {**self.base, "status": "failed", "output": self.output, "error": error}
        self.response = response
        return [
            *self.close(),
            # OpenAI's error event: its type is "error", the error's own type left out
            self.event("error", **{k: error.get(k) for k in ("code", "message", "param")}),
            self.event("response.failed", response=response),
        ]

    def finish(self) -> list[str]:
        """The last items' done events, then the response's: completed, or incomplete."""
        if self.open is not None and self.open["type"] == "message":  # tokens of no text last
            self.open_logprobs += self.pending_logprobs
        events = self.close()
        response = finished(self.base, self.output, self.reason)
        if self.chat_usage is not None:
            message = {"reasoning": self.reasoning}
            response["usage"] = usage(self.chat_usage, message, self.serving, self.token_ids)
        if self.store is not None:
            self.store.put_answered(response, self.inputs)
        self.response = response
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response)]

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[str]:
        events = []
        if delta.get("reasoning"):  # thinking: its tokens' logprobs go to no event
            self.pending_logprobs = []
            events += self.open_item("reasoning")
            events.append(self.text_delta("response.reasoning_text.delta", delta["reasoning"]))
        elif not delta.get("content"):
            self.pending_logprobs += logprobs
        if delta.get("content"):
            events += self.open_item("message")
            logprobs, self.pending_logprobs = self.pending_logprobs + logprobs, []
            self.open_logprobs += logprobs
            events.append(self.text_delta("response.output_text.delta", delta["content"], logprobs))
        for call in delta.get("tool_calls") or ():
            events += self.call_delta(call)
        return events

    def open_item(self, kind: str) -> list[str]:
        """The item of `kind` open for the next delta: the one open, else a new one."""
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self.close()
        if kind == "reasoning":
            item = reasoning_item(new_id("rs"), "", "in_progress")
        else:
            item = message_item(new_id("msg"), None, "in_progress")
        self.open, self.open_text, self.open_logprobs = item, "", []
        events.append(
            self.event("response.output_item.added", output_index=len(self.output), item=item)
        )
        place = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "message":
            events.append(self.event("response.content_part.added", **place, part=output_text("")))
        else:  # vLLM's, around the thinking's text as OpenAI's content part events around text
            events.append(self.event("response.reasoning_part.added", **place, part=thought("")))
        return events

    def text_delta(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> str:
        self.open_text += text
        place = {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}
        fields = {} if logprobs is None else {"logprobs": logprobs}  # output_text's alone
        return self.event(kind, **place, delta=text, **fields)

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
                self.event("response.reasoning_text.done", **place, content_index=0, text=text),
                self.event(
                    "response.reasoning_part.done", **place, content_index=0, part=thought(text)
                ),
            ]
        elif item["type"] == "message":
            logprobs = self.open_logprobs
            item.update(message_item(item["id"], text, "completed", logprobs))
            events = [
                self.event(
                    "response.output_text.done",
                    **place,
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                ),
                self.event(
                    "response.content_part.done", **place, content_index=0, part=item["content"][0]
                ),
            ]
        else:
            item["status"] = "completed"
            done = {"arguments": item["arguments"], "name": item["name"]}  # name: vLLM's too
            events = [self.event("response.function_call_arguments.done", **place, **done)]
        self.output.append(item)
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


class ChunkReader(Protocol):
    """Another API's events of a chat stream: a chunk's, the stream's error event's (the
    stream ends there), and those after its last chunk."""

    def read(self, chunk: dict[str, Any]) -> list[str]: ...

    def failed(self, error: dict[str, Any]) -> list[str]: ...

    def finish(self) -> list[str]: ...


async def chat_stream(
    chunks: AsyncIterator[str | bytes], reader: ChunkReader, opening: Sequence[str] = ()
) -> AsyncIterator[str]:
    """A chat stream's chunks as `reader`'s events, after the `opening` ones."""
    try:
        for event in opening:
            yield event
        async for raw in chunks:
            for chunk in sse_data(raw):
                if "error" in chunk:  # the chat stream's error event: the answer failed
                    for event in reader.failed(chunk["error"]):
                        yield event
                    return
                for event in reader.read(chunk):
                    yield event
    finally:  # a client gone: the chat stream ends, and its request is aborted
        await chunks.aclose()
    for event in reader.finish():
        yield event


def sse_data(raw: str | bytes) -> list[dict[str, Any]]:
    """The JSON objects of a chat stream's server-sent events (its `[DONE]` left out)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
