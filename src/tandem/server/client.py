"""vLLM's `chat` and `complete` commands: a conversation, or completions of prompts, in the
terminal with a running OpenAI-compatible server (`tandem serve`, or any other), each answer
printed as it streams in.

    connect(url, model_name, api_key) -> Client (the first served model unless one is named)
    chat(client, lines, ...)      a user message per line; the conversation grows with the replies
    complete(client, lines, ...)  a prompt per line, each completed on its own

`--stats` prints each answer's time to first token and its tokens per second (the server's
count of the completion's tokens, from the stream's usage).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

DEFAULT_URL = "http://localhost:8000/v1"


@dataclass
class Client:
    http: httpx.Client
    model: str


def connect(url: str, model_name: str | None, api_key: str | None, out: TextIO) -> Client:
    """A client of the server at `url` (its /v1 root), with `api_key`, else OPENAI_API_KEY's;
    OSError if it cannot be reached or refuses the key."""
    key = api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")
    http = httpx.Client(
        base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {key}"}, timeout=None
    )
    model = model_name or _checked(_request(http, "GET", "/models"), "/models")["data"][0]["id"]
    print(f"Using model: {model}", file=out)
    return Client(http, model)


def chat(
    client: Client,
    lines: Iterable[str],
    out: TextIO,
    system_prompt: str | None = None,
    quick: str | None = None,
    stats: bool = False,
) -> list[dict[str, str]]:
    """Answer `quick` alone, or each line of `lines` (a user message) until they end; returns
    the conversation."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    asked = _prompts(lines, out, "a message for the chat model")
    for message in [quick] if quick is not None else asked:
        messages.append({"role": "user", "content": message})
        body = {"model": client.model, "messages": messages, **_stream_fields(stats)}
        chunks = _stream(client.http, "/chat/completions", body)
        try:
            reply = _print_stream(chunks, lambda c: c["delta"].get("content"), stats, out)
        except Refused as error:  # e.g. past max_model_len: the conversation so far stays
            if quick is not None:
                raise
            messages.pop()
            print(f"{error}; that message was dropped", file=sys.stderr, flush=True)
            continue
        messages.append({"role": "assistant", "content": reply})
    return messages


def complete(
    client: Client,
    lines: Iterable[str],
    out: TextIO,
    max_tokens: int | None = None,
    quick: str | None = None,
    stats: bool = False,
) -> list[str]:
    """Complete `quick` alone, or each line of `lines` until they end; returns the completions."""
    texts = []
    for prompt in [quick] if quick is not None else _prompts(lines, out, "a prompt to complete"):
        body = {"model": client.model, "prompt": prompt, **_stream_fields(stats)}
        if max_tokens:
            body["max_tokens"] = max_tokens
        chunks = _stream(client.http, "/completions", body)
        texts.append(_print_stream(chunks, lambda choice: choice.get("text"), stats, out))
    return texts


class Refused(OSError):
    """The server refused a request as malformed (400): the next one may do."""


def _prompts(lines: Iterable[str], out: TextIO, what: str) -> Iterator[str]:
    print(f"Please enter {what}:", file=out)
    print("> ", end="", file=out, flush=True)
    for line in lines:
        yield line.rstrip("\n")
        print("> ", end="", file=out, flush=True)
    print(file=out)


def _stream_fields(stats: bool) -> dict[str, Any]:
    return {"stream": True, **({"stream_options": {"include_usage": True}} if stats else {})}


def _stream(http: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The server-sent chunks of a streamed request, up to its [DONE]."""
    try:
        with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                _checked(response, path)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:  # an error mid-stream, in the chunk's place
                    raise OSError(f"{path}: {chunk['error'].get('message', chunk['error'])}")
                yield chunk
    except httpx.HTTPError as error:
        raise OSError(f"{str(http.base_url).rstrip('/')}{path}: {error}") from error


def _request(http: httpx.Client, method: str, path: str) -> httpx.Response:
    try:
        return http.request(method, path)
    except httpx.HTTPError as error:
        raise OSError(f"{str(http.base_url).rstrip('/')}{path}: {error}") from error


def _checked(response: httpx.Response, path: str) -> Any:
    """The response's JSON; OSError with the server's message for an error status."""
    if response.status_code == 200:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    error = Refused if response.status_code == 400 else OSError
    raise error(f"{path}: {response.status_code} {message}")


def _print_stream(
    chunks: Iterable[dict[str, Any]],
    piece_of: Callable[[dict[str, Any]], str | None],
    stats: bool,
    out: TextIO,
) -> str:
    """Print each chunk's text as it comes; with `stats`, the time to the first and the tokens
    per second after the answer. Returns the whole text."""
    start, first, completion_tokens, pieces = time.perf_counter(), None, 0, []
    for chunk in chunks:
        if chunk.get("usage"):
            completion_tokens = chunk["usage"]["completion_tokens"]
        if not chunk.get("choices"):
            continue
        if piece := piece_of(chunk["choices"][0]):
            first = time.perf_counter() - start if first is None else first
            pieces.append(piece)
            print(piece, end="", file=out, flush=True)
    print(file=out)
    total = time.perf_counter() - start
    if stats and first is not None and total > 0:
        print(f"TTFT: {first * 1000:.2f} ms", file=out)
        print(
            f"TPS:  {completion_tokens / total:.2f} tokens/s "
            f"({completion_tokens} tokens in {total:.2f}s)",
            file=out,
        )
    return "".join(pieces)
