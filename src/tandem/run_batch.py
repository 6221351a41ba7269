"""`tandem run-batch`: answer an OpenAI batch file with one engine, or N on Ray Data.

Each request goes through the same FastAPI app as `tandem serve` (in process, over httpx's ASGI
transport), so a batch line is validated and answered exactly as the HTTP endpoint would:

    requests.jsonl ─read─> BatchRequest ─POST url body─> app ─> AsyncLLM ─> response JSON
    results.jsonl <─append in input order, flush─ output line (custom_id, status, body, error)

Lines are written in the input's order, as vLLM's: one answered before those above it waits for
them. With --data-parallel-size N, `tandem.ray.batch` spreads the requests over N such engines.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import httpx
import prometheus_client
from tqdm import tqdm

from tandem.async_llm import AsyncLLM
from tandem.batch_file import (
    BatchRequest,
    num_completion_tokens,
    pending,
    read_batch_file,
    response_line,
    resume_output,
)
from tandem.server.app import build_app
from tandem.server.options import ServerOptions


class BatchAnswerer:
    """One engine behind the OpenAI app; `answer` turns a request into its output line.
    served_model_name: the names requests may give, answers carrying the first (default: model);
    options: how the app answers (response_role, request logging, ...)."""

    def __init__(
        self,
        model: str,
        served_model_name: str | Sequence[str] | None = None,
        options: ServerOptions | None = None,
        **engine_args: Any,
    ):
        self.llm = AsyncLLM.from_model(model, **engine_args)
        self.max_in_flight = 2 * (engine_args.get("max_num_seqs") or 256)  # None: the default
        self.app = build_app(self.llm, served_model_name or model, options=options)
        transport = httpx.ASGITransport(app=self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None)

    async def answer(self, request: BatchRequest) -> dict[str, Any]:
        # encoded as Python's json does (NaN, escaped surrogates): the app answers what the body
        # holds with a 400, where httpx's own encoder would raise before sending it
        content = json.dumps(request.body)
        headers = {"Content-Type": "application/json"}
        response = await self.client.post(request.url, content=content, headers=headers)
        if not self.llm.is_running:
            raise RuntimeError(
                f"the engine stopped while answering {request.custom_id!r}; the lines written "
                "so far are kept: run the same command again to answer the rest"
            )
        return response_line(request.custom_id, response.status_code, response.json())

    async def answer_all(self, requests: Iterable[BatchRequest]) -> AsyncIterator[dict[str, Any]]:
        """Output lines in the order they finish, at most `max_in_flight` requests at once."""
        slots = asyncio.Semaphore(self.max_in_flight)

        async def bounded(request: BatchRequest) -> dict[str, Any]:
            async with slots:
                return await self.answer(request)

        tasks = [asyncio.ensure_future(bounded(r)) for r in requests]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()

    def shutdown(self) -> None:
        self.llm.shutdown()


@dataclass
class BatchSummary:
    """What one run wrote. The rate counts from its first answered request: engine start-up,
    and that request's own tokens, are left out."""

    num_lines: int = 0
    num_completion_tokens: int = 0
    elapsed_s: float = 0.0
    first_answer_s: float | None = None  # since the start
    tokens_after_first_answer: int = 0

    @property
    def tokens_per_s(self) -> float:
        if self.first_answer_s is None or self.elapsed_s <= self.first_answer_s:
            return 0.0
        return self.tokens_after_first_answer / (self.elapsed_s - self.first_answer_s)

    def __str__(self) -> str:
        tokens = self.num_completion_tokens
        text = f"{self.num_lines} lines, {tokens} completion tokens in {self.elapsed_s:.2f} s"
        if self.tokens_per_s:
            text += f" ({self.tokens_per_s:.0f} tok/s after the first answer)"
        return text


class InInputOrder:
    """Hands lines to `write` in the input's order: `entries` are the pending requests and the
    error lines of unreadable ones, as the file had them; a request's line answered before those
    above it waits for them."""

    def __init__(
        self, entries: list[BatchRequest | dict[str, Any]], write: Callable[[dict[str, Any]], None]
    ):
        self.write = write
        self.position = {
            e.custom_id: i for i, e in enumerate(entries) if isinstance(e, BatchRequest)
        }
        # position -> its line, once answered; error lines are answered from the start
        self.waiting = {i: e for i, e in enumerate(entries) if not isinstance(e, BatchRequest)}
        self.next_position = 0
        self.flush()

    def add(self, line: dict[str, Any]) -> None:
        self.waiting[self.position[line["custom_id"]]] = line
        self.flush()

    def flush(self) -> None:
        while self.next_position in self.waiting:
            self.write(self.waiting.pop(self.next_position))
            self.next_position += 1


class OutputWriter:
    """Appends output lines, flushed one by one, and shows requests/s and tokens/s."""

    def __init__(self, out: IO[str], total: int, quiet: bool):
        self.out = out
        self.bar = tqdm(total=total, desc="run-batch", unit="req", disable=quiet)
        self.start = time.perf_counter()
        self.summary = BatchSummary()

    def write(self, line: dict[str, Any]) -> None:
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()  # a line written survives the process being killed
        summary, num_tokens = self.summary, num_completion_tokens(line)
        summary.elapsed_s = time.perf_counter() - self.start
        summary.num_lines += 1
        summary.num_completion_tokens += num_tokens
        if summary.first_answer_s is None and line["response"] is not None:
            summary.first_answer_s = summary.elapsed_s
        elif summary.first_answer_s is not None:
            summary.tokens_after_first_answer += num_tokens
        self.bar.set_postfix_str(f"{summary.tokens_per_s:.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_batch(
    input_path: str,
    output_path: str,
    model: str,
    engine_args: dict[str, Any],
    data_parallel_size: int = 1,
    served_model_name: str | Sequence[str] | None = None,
    quiet: bool = False,
    options: ServerOptions | None = None,
    metrics_address: tuple[str, int] | None = None,
) -> BatchSummary:
    """Answer what `output_path` lacks of `input_path`; returns what this run wrote.
    metrics_address: (host, port) to serve the engine's Prometheus metrics on while it runs
    (vLLM's --enable-metrics; one engine only)."""
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size!r}")
    if metrics_address is not None and data_parallel_size > 1:
        raise ValueError("--enable-metrics serves one engine's metrics (--data-parallel-size 1)")
    todo = pending(read_batch_file(input_path), resume_output(output_path))
    with open(output_path, "a", encoding="utf-8") as out:
        writer = OutputWriter(out, len(todo.entries), quiet)
        try:
            in_order = InInputOrder(todo.entries, writer.write)
            if todo.requests and data_parallel_size == 1:
                answerer = BatchAnswerer(model, served_model_name, options, **engine_args)
                answer_locally(answerer, todo.requests, in_order.add, metrics_address)
            elif todo.requests:
                from tandem.ray.batch import answer_on_ray

                answer_on_ray(
                    todo.requests,
                    model,
                    # each actor's BatchAnswerer takes the options with the engine's arguments
                    {**engine_args, "options": options},
                    data_parallel_size,
                    served_model_name,
                    in_order.add,
                )
        finally:
            writer.close()
    return writer.summary


def answer_locally(
    answerer: BatchAnswerer,
    requests: list[BatchRequest],
    write: Callable[[dict[str, Any]], None],
    metrics_address: tuple[str, int] | None = None,
) -> None:
    """Answer `requests`, writing lines as they finish; the engine is shut down after."""
    metrics_server = None

    async def run() -> None:
        async for line in answerer.answer_all(requests):
            write(line)

    try:
        if metrics_address is not None:  # vLLM's run-batch --enable-metrics --url --port
            host, port = metrics_address
            registry = answerer.app.state.serving.metrics.registry
            metrics_server, _ = prometheus_client.start_http_server(port, host, registry)
        asyncio.run(run())
    finally:
        answerer.shutdown()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
