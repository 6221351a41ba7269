"""The OpenAI batch file format: request lines in, response lines out, and resuming a run.

An input line is {"custom_id", "method": "POST", "url", "body"}, `url` being one of
`BATCH_URLS` (vLLM's: completions, chat, embeddings, score and rerank). An output line is
{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error"}:
`error` is null for a 200 and {"code", "message"} otherwise. A line that cannot be read as a
request (not JSON, no string custom_id) is answered with "custom_id": null and no response.
Lines end at "\n" and each is decoded on its own, so one that is not UTF-8 is one bad line.

Output lines are appended in the input's order. Re-running with the same output file answers
only what it lacks: the lines of finished custom_ids stay, one torn by an interruption is
dropped, and so are server errors (5xx), which are asked again.
"""

from __future__ import annotations

import codecs
import json
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

BATCH_URLS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
)
LINE_ERROR_CODE = "invalid_batch_line"
STREAM_FLAG = TypeAdapter(bool | None)  # how the server's request models read `stream`


class BatchLineError(ValueError):
    """A line that is not a batch request; `custom_id` is its id where it had a usable one."""

    def __init__(self, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchFile:
    """An input file read whole, in its order: each line a request, or the error line that
    answers it where it is none."""

    entries: list[BatchRequest | dict[str, Any]]

    @property
    def requests(self) -> list[BatchRequest]:
        return [e for e in self.entries if isinstance(e, BatchRequest)]

    @property
    def bad_lines(self) -> list[dict[str, Any]]:
        return [e for e in self.entries if not isinstance(e, BatchRequest)]


def parse_line(text: str, line_number: int) -> BatchRequest:
    where = f"line {line_number}"
    try:
        line = json.loads(text)
    except json.JSONDecodeError as error:
        raise BatchLineError(f"{where} is not valid JSON: {error}") from error
    except RecursionError:
        raise BatchLineError(f"{where} is nested too deep to read") from None
    if not isinstance(line, dict):
        raise BatchLineError(f"{where} must be a JSON object, got {type(line).__name__}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str):
        raise BatchLineError(f"{where}: custom_id must be a string, got {custom_id!r:.40}")
    if line.get("method") != "POST":
        message = f"{where}: method must be 'POST', got {line.get('method')!r:.40}"
        raise BatchLineError(message, custom_id)
    url = line.get("url")
    if url not in BATCH_URLS:
        raise BatchLineError(
            f"{where}: url must be one of {BATCH_URLS}, got {url!r:.80}", custom_id
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise BatchLineError(f"{where}: body must be a JSON object", custom_id)
    if streams(body.get("stream")):
        message = f"{where}: body.stream must be false or unset; a batch answers each request whole"
        raise BatchLineError(message, custom_id)
    return BatchRequest(custom_id, url, body)


def streams(value: Any) -> bool:
    """Whether a body's `stream` asks for a stream, read as the server reads it (pydantic's
    bool: "false", "0", "no" and 0 are false). A value that is no bool at all is left to the
    request's own validation, which answers that line with a 400."""
    try:
        return bool(STREAM_FLAG.validate_python(value))
    except ValidationError:
        return False


def read_batch_file(path: str | Path) -> BatchFile:
    """Every non-blank line as a request or an error line; duplicate custom_ids reject the file."""
    entries: list[BatchRequest | dict[str, Any]] = []
    # lines end at "\n" alone (a "\r" inside one is JSON whitespace), each decoded on its own,
    # after the UTF-8 byte order mark that Windows tools start a file with
    data = Path(path).read_bytes().removeprefix(codecs.BOM_UTF8)
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            entries.append(parse_line(decode_line(raw, number), number))
        except BatchLineError as error:
            entries.append(error_line(error.custom_id, LINE_ERROR_CODE, str(error)))
    ids = Counter(custom_id(e) for e in entries)
    repeated = sorted(i for i, count in ids.items() if i is not None and count > 1)
    if repeated:
        raise ValueError(f"{path}: custom_id must be unique; repeated: {repeated[:5]}")
    return BatchFile(entries)


def custom_id(entry: BatchRequest | dict[str, Any]) -> str | None:
    return entry.custom_id if isinstance(entry, BatchRequest) else entry["custom_id"]


def decode_line(raw: bytes, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BatchLineError(f"line {line_number} is not UTF-8 text: {error}") from None


def response_line(custom_id: str, status_code: int, body: Any) -> dict[str, Any]:
    """The output line for an HTTP answer: `body` is the response JSON (OpenAI's error JSON if not 200)."""
    error = None
    if status_code != 200:
        detail = body.get("error", {}) if isinstance(body, dict) else {}
        code = detail.get("code") or detail.get("type") or f"http_{status_code}"
        error = {"code": code, "message": detail.get("message", str(body))}
    request_id = body.get("id") if status_code == 200 and isinstance(body, dict) else None
    response = {
        "status_code": status_code,
        "request_id": request_id or f"req_{uuid.uuid4().hex}",
        "body": body,
    }
    return {"id": batch_line_id(), "custom_id": custom_id, "response": response, "error": error}


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    return {"id": batch_line_id(), "custom_id": custom_id, "response": None, "error": error}


def batch_line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def num_completion_tokens(line: dict[str, Any]) -> int:
    response = line.get("response") or {}
    body = response.get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    return usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0


@dataclass
class Finished:
    """What an output file already answers: custom_ids, and how many id-less error lines."""

    custom_ids: set[str]
    num_id_less: int = 0


def resume_output(path: str | Path) -> Finished:
    """Read what `path` answers, rewriting it without a torn last line or 5xx lines if it has them."""
    target = Path(path)
    if not target.is_file():  # none yet, or a pipe such as /dev/stdout: nothing to resume
        return Finished(set())
    kept, dropped = [], False
    with open(target, encoding="utf-8") as f:
        for text in f:
            line = _finished_line(text)
            if line is None:
                dropped = True
            else:
                kept.append(line)
    if dropped:
        temporary = target.with_name(target.name + ".resume")
        with open(temporary, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in kept)
        os.replace(temporary, target)
    ids = {line["custom_id"] for line in kept if line.get("custom_id") is not None}
    return Finished(ids, sum(line.get("custom_id") is None for line in kept))


def _finished_line(text: str) -> dict[str, Any] | None:
    """The line's JSON if it is a whole output line that needs no retry, else None."""
    if not text.endswith("\n"):
        return None  # the run stopped while writing it
    try:
        line = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(line, dict) or not {"custom_id", "response", "error"} <= set(line):
        return None  # not an output line (an input line has no response or error)
    status = (line.get("response") or {}).get("status_code", 200)
    return None if status >= 500 else line


def pending(batch: BatchFile, finished: Finished) -> BatchFile:
    """The requests and error lines that `finished` does not answer yet, in the file's order:
    its first `num_id_less` id-less error lines are answered."""
    todo, id_less_seen = [], 0
    for entry in batch.entries:
        if custom_id(entry) is None:
            id_less_seen += 1
            if id_less_seen > finished.num_id_less:
                todo.append(entry)
        elif custom_id(entry) not in finished.custom_ids:
            todo.append(entry)
    return BatchFile(todo)
