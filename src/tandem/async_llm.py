"""Streaming API: the engine loop on its own thread, outputs delivered to asyncio streams.

Only the engine thread touches the Engine. The asyncio side talks to it through one queue of
commands (add, abort, stop) that the thread drains between steps, blocking on it when idle;
outputs go back per step with `loop.call_soon_threadsafe`, one call per event loop:

    asyncio: add_request ──put──> commands ──> engine thread: make_request, enqueue, step
    asyncio: RequestStream.outputs <──call_soon_threadsafe── StreamOutput deltas of the step

`generate` queues a request's n samples with one shared outputs queue and folds their deltas
into vLLM's RequestOutputs (outputs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.batch import StepFailed
from tandem.config import EngineConfig, ModelConfig, check_flags
from tandem.engine import Engine, check_pause_mode
from tandem.inputs import Truncation, truncation
from tandem.lora.adapters import AdapterCache
from tandem.lora.request import LoRARequest
from tandem.metrics import EngineStats
from tandem.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputCollector,
    RequestOutput,
    RequestStateStats,
    token_text,
)
from tandem.pooling import PoolingParams, pooling_carrier
from tandem.request import (
    Prompt,
    Request,
    check_request_types,
    prompt_cache_salt,
    prompt_embeds,
    split_prompt,
    without_special_tokens,
)
from tandem.sampling import SamplingParams, seeded
from tandem.structured import REGEX_COMPILE_SECONDS, StructuredOutputsParams
from tandem.tokenizer import Tokenizer
from tandem.weight_transfer import request_field, required_field
from tandem.weights import NamedTensors, check_named_tensors

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it raised, or `shutdown` was called); nothing more is served."""


class EngineGenerateError(Exception):
    """vLLM's: one request of `generate` failed while it ran (its step's sampling raised:
    `__cause__` says how); the engine serves on."""


def generate_error(request_id: str, error: BaseException) -> BaseException:
    """What `generate` raises for an error its request's stream ended with: a bad request's
    ValueError and EngineDeadError as they are, others as EngineGenerateError."""
    if isinstance(error, ValueError | EngineDeadError | asyncio.CancelledError):
        return error
    failed = EngineGenerateError(f"request {request_id!r} failed: {error}")
    failed.__cause__ = error
    return failed


@dataclass(frozen=True)
class StreamOutput:
    """What one request gained in one step: deltas, not the whole output so far."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None  # "stop", "length", "repetition" or "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # all tokens so far
    time: float  # time.perf_counter() when the engine thread produced it
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_cache_creation_tokens: int = 0  # prompt tokens written into it
    # with SamplingParams.prompt_logprobs, in the request's first output: per prompt position
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # beside prompt_logprobs: each token's rank
    stop_reason: int | str | None = None  # once finished: the stop string or stop token id
    prompt_token_ids: list[int] | None = None  # in the request's first output
    sampled_ranks: list[int] | None = None  # with logprobs: each new token's rank
    pooled: list[float] | None = None  # a pooling request's output (pooling.py)
    scheduled_time: float | None = None  # time.perf_counter() at its first admission


class RequestStream:
    """The asyncio end of one request: iterate it for StreamOutputs until one is finished."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
        outputs: asyncio.Queue[StreamOutput | BaseException] | None = None,  # or its own
    ):
        self.request_id = request_id
        self.loop = loop
        self.outputs = asyncio.Queue() if outputs is None else outputs
        self.finished = False  # its last output (or error) has been read
        self._abort = abort

    def abort(self) -> None:
        """Stop the request unless its last output was read; returns at once."""
        if not self.finished:
            self._abort(self.request_id)

    def __aiter__(self) -> AsyncIterator[StreamOutput]:
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    request_id: str
    params: SamplingParams
    prompt: str | None
    prompt_token_ids: list[int] | None
    cache_salt: str | None
    stream: RequestStream
    accepted: asyncio.Future[None]
    pooling: PoolingParams | None = None  # an embedding request
    priority: int = 0
    lora_request: LoRARequest | None = None  # its LoRA adapter
    prompt_embeds: Any = None  # a prompt given as embeddings (prompt_embeds.py)


@dataclass
class _Abort:
    request_ids: list[str]  # aborted between the same two steps, their outputs posted together


class _Stop:
    pass


@dataclass
class _Call:
    """Run `function(engine)` between two steps; its result (or error) resolves `done`."""

    function: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Any]


Command = _Add | _Abort | _Stop | _Call


def _engine_thread(llm: weakref.ref[AsyncLLM], commands: queue.SimpleQueue, engine: Engine) -> None:
    """The engine thread: the AsyncLLM works (`_work`) until nothing is due, then the thread
    waits for a command holding no reference to it, so that dropping the last one ends the
    thread (its finalizer's _Stop wakes the wait) and frees the engine."""
    command = None
    try:
        while (served := llm()) is not None and served._work(command):
            del served, command  # neither held while it waits (a command's stream holds `llm`)
            command = commands.get()
    finally:
        engine.shutdown()  # tensor-parallel workers, if any; the device memory


@dataclass
class _Sent:
    """How much of a request the engine thread has already put into StreamOutputs."""

    stream: RequestStream
    num_tokens: int = 0
    num_chars: int = 0
    prompt_sent: bool = False  # the first output, which carries the prompt logprobs, went out


class AsyncLLM:
    """`async for out in llm.generate(prompt, params, request_id)` over an engine thread."""

    def __init__(self, engine: Engine):
        self.engine = engine  # the engine thread's from here on; read only what never changes
        self.model = engine.config.model  # the folder or preset it was built from
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults  # the model's (generation_config.py)
        self.log_requests = engine.config.enable_log_requests  # vLLM's lines: added, aborted
        self._token_text = token_text(self.tokenizer)  # decoded on the asyncio side, cached
        # the open generate and encode calls of each request id (vLLM takes one id twice: its
        # engine ids carry a random tag): tag -> the engine ids of its samples
        self._samples: dict[str, dict[str, list[str]]] = {}
        self._aborted: set[str] = set()  # the tags of those aborted (maybe before queued)
        self.stats = EngineStats(num_blocks=engine.num_blocks, num_free_blocks=engine.num_blocks)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against the thread's death
        self._dead: EngineDeadError | None = None
        self.failure: BaseException | None = None  # what stopped the engine thread, if it raised
        # progress, written by the engine thread only: when it last finished a step or took up
        # work, and whether it is waiting for work (then no progress is due)
        self._progress_at = time.monotonic()
        self._idle = True
        self._sent: dict[str, _Sent] = {}  # engine thread only
        # pause_generation("wait") callers, answered once the engine paused (engine thread only)
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # constraints compile here, half the CPUs as vLLM's (xgrammar's own threads beside)
        self._grammars = ThreadPoolExecutor((os.cpu_count() or 2) // 2 or 1, "tandem-grammar")
        self._thread = threading.Thread(
            target=_engine_thread,
            args=(weakref.ref(self), self._commands, engine),
            name="tandem-engine",
            daemon=True,
        )
        # `del llm` (its last reference) stops the thread, which gives the engine's device memory
        # back, as vLLM's AsyncLLM shuts down when it is collected
        weakref.finalize(self, self._commands.put, _Stop()).atexit = False
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, **engine_args: Any) -> AsyncLLM:
        """`AsyncLLM.from_model(folder_or_preset, **engine_args)`; see EngineConfig."""
        return cls(Engine(EngineConfig(model=model, **engine_args)))

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineConfig,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: list | None = None,
    ) -> AsyncLLM:
        """vLLM's: an AsyncLLM of these settings (`tandem.AsyncEngineArgs`, that is EngineConfig),
        its engine thread started either way (vLLM 0.26 reads `start_engine_loop` no more);
        `usage_context` is vLLM's telemetry label (none here), and custom `stat_loggers` are
        refused (the "tandem.metrics" logger and /metrics report)."""
        del usage_context
        check_flags(start_engine_loop=start_engine_loop)
        if stat_loggers:
            raise ValueError(
                "custom stat_loggers are not supported: disable_log_stats=False logs a line "
                "every 10 s, and the server's /metrics serves the counters"
            )
        return cls(Engine(replace(engine_args)))

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def errored(self) -> bool:
        """vLLM's: the engine thread stopped (it raised, or was shut down)."""
        return self._dead is not None

    is_stopped = errored

    @property
    def dead_error(self) -> EngineDeadError:
        """vLLM's: the error that open and later requests get."""
        return self._dead or EngineDeadError("the engine thread stopped")

    async def check_health(self) -> None:
        """vLLM's: raises the engine's EngineDeadError once its thread stopped."""
        if self._dead is not None:
            raise self._dead

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's: the model's config, with the `model` it was built from, the `max_model_len`
        it serves, its `dtype` and `hf_config`."""
        return self.engine.model_config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what this engine serves; any model generates and embeds its last token, and a
        checkpoint with a score head classifies and scores too."""
        classifies = ("classify", "score") if self.engine.model_config.num_labels else ()
        return ("generate", "embed", *classifies)

    async def is_tracing_enabled(self) -> bool:
        return False  # vLLM's OpenTelemetry tracing: tandem has none

    async def do_log_stats(self) -> None:
        """vLLM's: the stats line now (disable_log_stats=False)."""

        def log(engine: Engine) -> None:
            if engine.stat_logger is not None:
                engine.stat_logger.log(engine.stats, time.monotonic())

        await self._call(log)

    async def reset_mm_cache(self) -> None:
        """vLLM's: tandem serves text models alone, so there is no multi-modal cache."""

    async def reset_encoder_cache(self) -> None:
        """vLLM's: nor an encoder cache (a multi-modal model's encoder outputs)."""

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: read an adapter into the engine's adapter cache (enable_lora=True) before any
        request names it; ValueError for a bad one."""
        cache = self._adapter_cache()
        await asyncio.get_running_loop().run_in_executor(None, cache.get, lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: forget an adapter; False where it is not held or a request still runs it."""
        return self._adapter_cache().remove(lora_id)

    async def list_loras(self) -> set[int]:
        """vLLM's: the ids of the adapters the engine holds."""
        return set(self._adapter_cache().adapters)

    async def pin_lora(self, lora_id: int) -> bool:
        """vLLM's: keep a held adapter however long unused; False where it is not held."""
        return self._adapter_cache().pin(lora_id)

    def _adapter_cache(self) -> AdapterCache:
        if self.engine.adapter_cache is None:
            raise ValueError("this engine runs no LoRA adapters: start it with enable_lora=True")
        return self.engine.adapter_cache

    def get_tokenizer(self) -> Tokenizer | None:
        """vLLM's: the model's tokenizer, called as transformers' is (None for a model without
        one)."""
        return self.engine.tokenizer

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: return once the engine holds no unfinished request; TimeoutError after
        `drain_timeout` seconds (a paused engine's requests wait, as vLLM's)."""
        deadline = time.monotonic() + drain_timeout
        while await self._call(lambda engine: engine.has_unfinished()):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"Timeout reached after {drain_timeout} seconds waiting for requests to drain"
                )
            await asyncio.sleep(0.05)

    def seconds_without_progress(self) -> float:
        """How long the engine thread has had work but finished no step (0 while it waits)."""
        if self._idle:
            return 0.0
        return time.monotonic() - self._progress_at

    # ---- asyncio side ---------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request once the engine thread has validated it (ValueError if invalid);
        `cache_salt` shares cached blocks only with requests of the same salt; `priority` as
        `generate` takes it."""
        check_request_types(request_id, params)  # before its grammar is read (the engine validates)
        return await self._add_request(
            request_id, params, prompt, prompt_token_ids, cache_salt, priority
        )

    async def _tokenized(self, prompt: Prompt, cut: Truncation) -> Prompt:
        """The prompt, its text as ids without special tokens where `tokenization_kwargs` said
        add_special_tokens=False (vLLM's), tokenized off the event loop."""
        if cut.add_special_tokens is not False:
            return prompt
        return await asyncio.to_thread(without_special_tokens, prompt, self.tokenizer)

    async def _add_request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        cache_salt: str | None,
        priority: int = 0,
        prompt_embeds: Any = None,
        *,
        outputs: asyncio.Queue[StreamOutput | BaseException] | None = None,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        loop = asyncio.get_running_loop()
        if params.structured_outputs is not None:
            # compiled in a worker thread first: a grammar new to the backend's cache takes up
            # to a second to compile, which the engine thread would spend between two steps,
            # with the GPU idle; there it is then a cache hit
            await self._compiled(params.structured_outputs)
        if lora_request is not None and self.engine.adapter_cache is not None:
            # likewise an adapter's folder, read in a worker thread first (a bad one is
            # refused by the engine's own check, which raises its error to the caller)
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                await loop.run_in_executor(None, self.engine.adapter_cache.get, lora_request)
        stream = RequestStream(request_id, loop, self._abort_soon, outputs)
        accepted = loop.create_future()
        add = _Add(request_id, params, prompt, prompt_token_ids, cache_salt, stream, accepted)
        add.pooling, add.priority, add.lora_request = pooling, priority, lora_request
        add.prompt_embeds = prompt_embeds
        self._submit(add)
        try:
            await accepted
        except asyncio.CancelledError:
            self._abort_soon(request_id)  # it may have been queued already
            raise
        if self.log_requests:
            logger.info("Added request %s.", request_id)
        return stream

    async def _compiled(self, constraint: StructuredOutputsParams) -> None:
        """`constraint` compiled off the event loop, in grammar threads of its own that slow
        grammars never take from the prompts' tokenization (asyncio's default threads). A regex,
        as vLLM's, compiles on a thread of its own within vLLM's time limit (its compile ends
        unwatched past it: no regex waits behind another)."""
        if self._dead is not None:  # no thread takes work once the engine stopped
            raise self._dead
        loop = asyncio.get_running_loop()
        if constraint.regex is None:
            await loop.run_in_executor(self._grammars, self._compile, constraint)
            return
        compiled = loop.create_future()

        def compile_regex() -> None:
            try:
                self._compile(constraint)
                outcome = (compiled.set_result, None)
            except BaseException as error:  # handed to the waiting request
                outcome = (compiled.set_exception, error)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(lambda: compiled.done() or outcome[0](outcome[1]))

        threading.Thread(target=compile_regex, name="tandem-regex", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(compiled), REGEX_COMPILE_SECONDS)
        except TimeoutError:
            raise ValueError(
                f"the regex took more than {REGEX_COMPILE_SECONDS:g} s to compile (as vLLM, "
                "refused: nested quantifiers such as (a+)+ explode the automaton); simplify it"
            ) from None

    def _compile(self, constraint: StructuredOutputsParams) -> None:
        self.engine.admission.grammars().compile(constraint)  # the backend built here too

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        data_parallel_rank: int | None = None,
        prompt_text: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request as vLLM's RequestOutputs, as `sampling_params.output_kind` says;
        its n samples (seed + k for sample k) share the stream, and leaving the loop early
        aborts them all.

        `prompt` is text, {"prompt": text}, {"prompt_token_ids": [...]} or {"prompt_embeds":
        tensor} (enable_prompt_embeds), a dict with an optional "cache_salt"; `lora_request` runs it under a LoRA adapter (enable_lora=True);
        `priority` is vLLM's: under scheduling_policy "priority" lower is served first; under
        "fcfs", 0 alone. Raises ValueError if the engine rejects it. vLLM's keywords:
        `tokenization_kwargs` (its truncate_prompt_tokens), `trace_headers` (unused: no
        tracing, as vLLM's without it), `data_parallel_rank` (0 or None: one engine),
        `prompt_text` (the outputs' prompt, for a prompt of token ids). One request id may be
        open in several calls: `abort` stops them all.
        """
        check_request_types(request_id, sampling_params)  # before the n samples' ids are made
        del trace_headers
        check_rank(data_parallel_rank)
        cut = truncation(tokenization_kwargs)
        if cut != Truncation():
            sampling_params = sampling_params.with_truncation(cut)
        sampling_params.validate()  # n=0 would otherwise queue nothing to validate
        prompt = await self._tokenized(prompt, cut)
        text, ids = split_prompt(prompt)
        salt = prompt_cache_salt(prompt)
        n = sampling_params.n
        # the samples' engine ids carry a random tag, as vLLM's internal ids, so that no other
        # request's id (a user's "job-1" beside "job", or "job" again) can collide with them
        tag = uuid.uuid4().hex[:8]
        sample_ids = (
            [f"{request_id}-{tag}"] if n == 1 else [f"{request_id}-{k}-{tag}" for k in range(n)]
        )
        index = {sample_id: k for k, sample_id in enumerate(sample_ids)}
        outputs: asyncio.Queue[StreamOutput | BaseException] = asyncio.Queue()
        shown = text if prompt_text is None else prompt_text
        stats = RequestStateStats(arrival_time=time.time(), queued_ts=time.perf_counter())
        collector = OutputCollector(
            request_id, shown, sampling_params, self._token_text, lora_request, stats
        )
        embeds = prompt_embeds(prompt)
        samples = [
            (sample_id, seeded(sampling_params, k), text, ids, salt, priority, embeds)
            for k, sample_id in enumerate(sample_ids)
        ]
        self._open(request_id, tag, sample_ids)  # before they are queued: an abort finds them
        try:
            streams = await self.add_requests(samples, outputs, lora_request)
        except BaseException:
            self._close(request_id, tag)
            raise
        if tag in self._aborted:  # before its samples reached the engine: abort them now
            self._abort_all_soon(sample_ids)
        try:
            while not collector.finished:
                # what came while the consumer was away goes into one output, as in vLLM
                for item in await _take_all(outputs):
                    if isinstance(item, BaseException):
                        raise generate_error(request_id, item)
                    k = index[item.request_id]
                    streams[k].finished = item.finished  # read here, not through the stream
                    collector.add(k, item)
                if (output := collector.take()) is not None:
                    yield output
        finally:
            self._close(request_id, tag)
            for stream in streams:
                stream.abort()

    def _open(self, request_id: str, tag: str, engine_ids: list[str]) -> None:
        self._samples.setdefault(request_id, {})[tag] = engine_ids

    def _close(self, request_id: str, tag: str) -> None:
        calls = self._samples.get(request_id, {})
        calls.pop(tag, None)
        if not calls:
            self._samples.pop(request_id, None)
        self._aborted.discard(tag)

    async def encode(
        self,
        prompt: Prompt,
        pooling_params: PoolingParams | None,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> AsyncIterator[EmbeddingRequestOutput | ClassificationRequestOutput]:
        """vLLM's: one prompt's embedding (pooling.py; `LLM.embed`), or its class probabilities
        with `PoolingParams(task="classify")` (`LLM.classify`), yielded once computed; leaving
        the loop early aborts it. `priority` as generate's (scheduling_policy "priority"),
        `trace_headers` and `tokenization_kwargs` too. Raises ValueError if the engine
        rejects it."""
        del trace_headers
        cut = truncation(tokenization_kwargs, truncate_prompt_tokens)
        prompt = await self._tokenized(prompt, cut)
        text, ids = split_prompt(prompt)
        prompt_ids = ids
        pooling = pooling_params or PoolingParams()
        if not isinstance(pooling, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(pooling).__name__}")
        pooling = pooling.for_task(pooling.task or "embed")
        carrier = pooling_carrier(pooling.truncation(cut.keep), cut.side)
        tag = uuid.uuid4().hex[:8]
        engine_id = f"{request_id}-{tag}"  # as generate's: one id may be open twice
        self._open(request_id, tag, [engine_id])
        try:
            stream = await self._add_request(
                engine_id, carrier, text, ids, prompt_cache_salt(prompt), priority,
                pooling=pooling, lora_request=lora_request,
            )  # fmt: skip
        except BaseException:
            self._close(request_id, tag)
            raise
        if tag in self._aborted:
            stream.abort()
        try:
            async for output in stream:
                if output.prompt_token_ids is not None:  # in the first output
                    prompt_ids = output.prompt_token_ids
                if output.pooled is not None:  # an aborted request ends without one
                    classify = pooling.task in ("classify", "score")
                    kind = ClassificationRequestOutput if classify else EmbeddingRequestOutput
                    pooled = (ClassificationOutput if classify else EmbeddingOutput)(output.pooled)
                    cached = output.num_cached_tokens
                    yield kind(request_id, pooled, prompt_ids, num_cached_tokens=cached)
        finally:
            self._close(request_id, tag)
            stream.abort()

    async def add_requests(
        self,
        requests: list[tuple],
        outputs: asyncio.Queue[StreamOutput | BaseException] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Queue every (request_id, params, prompt, prompt_token_ids, cache_salt, priority[,
        prompt_embeds]) or none: one the engine rejects aborts the others, and its error is
        raised. They reach the engine thread together, between the same two steps; `outputs`:
        one queue for all; `lora_request`: the LoRA adapter of all of them."""
        results = await asyncio.gather(
            *(
                self._add_request(*request, outputs=outputs, lora_request=lora_request)
                for request in requests
            ),
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        if len(streams) < len(results):
            for stream in streams:
                stream.abort()
            raise next(r for r in results if not isinstance(r, RequestStream))
        return streams

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Stop a request, or each of several (as vLLM's: an id or an iterable of them; all
        samples of every open `generate` or `encode` of that id, from the moment it is called);
        its stream ends with finish_reason "abort". Unknown ids are ignored. `internal`
        (vLLM's): the ids are the engine's own (a sample's, as its outputs' engine ids)."""
        engine_ids = []
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            calls = None if internal else self._samples.get(one)
            if calls is None:  # add_request's own id, or an engine id
                engine_ids.append(one)
                continue
            for tag, ids in calls.items():
                self._aborted.add(tag)
                engine_ids += ids
        if self.log_requests:
            logger.info("Aborted request(s) %s.", ",".join(engine_ids))
        self._abort_all_soon(engine_ids)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread; streams still open get EngineDeadError. `timeout` (vLLM's):
        wait at most that many seconds for the thread (it ends after its current step)."""
        with contextlib.suppress(EngineDeadError):  # already dead: nothing to stop
            self._submit(_Stop())
        self._thread.join(timeout)
        self._grammars.shutdown(wait=False, cancel_futures=True)

    # ---- RL hooks: run on the engine thread between two steps -----------------------------

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list:
        """vLLM's: `method` on every rank's engine between two steps (see LLM.collective_rpc)."""
        return await self._call(lambda engine: engine.collective_rpc(method, timeout, args, kwargs))

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: every rank's profiler on (see LLM.start_profile)."""
        await self.collective_rpc("start_profile", args=(profile_prefix,))

    async def stop_profile(self) -> list[str | None]:
        """vLLM's: every rank's profiler off; each rank's trace file (see LLM.stop_profile)."""
        return await self.collective_rpc("stop_profile")

    async def update_weights(self, request: NamedTensors | dict | Any) -> None:
        """Copy (Hugging Face name, tensor) pairs into the weights in place (see Engine), or
        receive the tensors a trainer broadcasts (vLLM's `{"update_info": {...}}`; see
        LLM.update_weights)."""
        update_info = request_field(request, "update_info")
        if update_info is not None:
            await self._call(lambda engine: engine.receive_weights(update_info))
            return
        pairs = check_named_tensors(request)  # a generator is drained on this thread
        await self._call(lambda engine: engine.update_weights(pairs))

    async def init_weight_transfer_engine(self, request: dict | Any) -> None:
        """Join the trainer's process group (see LLM.init_weight_transfer_engine)."""
        init_info = required_field(request, "init_info")
        await self._call(lambda engine: engine.init_weight_transfer_engine(init_info))

    async def start_weight_update(self) -> None:
        """No step runs from now until `finish_weight_update`."""
        await self._call(lambda engine: self._publish(engine.start_weight_update()))

    async def finish_weight_update(self) -> None:
        await self._call(lambda engine: engine.finish_weight_update())

    async def update_weights_from_path(self, path: str | Path) -> None:
        await self._call(lambda engine: engine.update_weights_from_path(path))

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached prompt block, between two steps (see LLM.reset_prefix_cache)."""
        check_flags(reset_running_requests=reset_running_requests, reset_connector=reset_connector)
        await self._call(
            lambda engine: self._publish(engine.reset_prefix_cache(reset_running_requests))
        )
        return True

    async def pause_generation(
        self,
        mode: str = "abort",
        *,
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool = True,
    ) -> None:
        """vLLM's: stop stepping once the steps in flight are read back. "abort" ends each
        stream with finish_reason "abort", "keep" holds every request, "wait" admits nothing
        new and returns once the admitted requests have finished (or on `resume_generation`;
        `wait_for_inflight_requests=True` is its older spelling). With `clear_cache`, once
        paused the prefix cache is emptied and kept requests recompute their KV on resuming,
        so weights changed meanwhile by any means (`collective_rpc` too) are the ones used."""
        if wait_for_inflight_requests:
            mode = "wait"
        check_pause_mode(mode)
        if mode != "wait":
            await self._call(
                lambda engine: self._publish(engine.pause_generation(mode, clear_cache))
            )
            return
        loop = asyncio.get_running_loop()
        drained = loop.create_future()

        def hold(engine: Engine) -> None:
            engine.pause_generation(mode, clear_cache)
            self._pause_waiters.append((loop, drained))

        await self._call(hold)
        await drained

    async def resume_generation(self, recompute_kv: bool = False) -> None:
        await self._call(lambda engine: self._publish(engine.resume_generation(recompute_kv)))

    async def sleep(self, level: int = 1, mode: str = "abort") -> int:
        """Free the KV cache and the weights' device memory (see Engine.sleep; level 0 only
        holds the steps); bytes freed. The requests in flight end now ("abort", vLLM's
        default), go on after `wake_up` ("keep"), or finish first ("wait": new ones wait until
        the engine is awake again, as in vLLM)."""
        check_pause_mode(mode)
        if mode == "wait":  # the cache goes with the memory (level 0 keeps both)
            await self.pause_generation("wait", clear_cache=level >= 1)

        def sleep(engine: Engine) -> int:
            self._publish(engine.drain())
            if mode == "abort":
                self._publish(self._aborted_now(list(engine.requests)))
            freed = engine.sleep(level)
            engine.resume_on_wake = mode == "wait"  # the pause was the sleep's
            return freed

        return await self._call(sleep)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of the parts named ("weights", "kv_cache"; None: both, and the
        steps a level 0 sleep held: vLLM's "scheduling")."""
        await self._call(lambda engine: engine.wake_up(tags))

    async def is_paused(self) -> bool:
        return await self._call(lambda engine: engine.is_paused)

    async def is_sleeping(self) -> bool:
        return await self._call(lambda engine: engine.is_sleeping)

    async def _call(self, function: Callable[[Engine], Any]) -> Any:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(_Call(function, loop, done))
        return await done

    def _abort_soon(self, request_id: str) -> None:
        self._abort_all_soon([request_id])

    def _abort_all_soon(self, request_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to abort
            self._submit(_Abort(request_ids))

    def _submit(self, command: _Add | _Abort | _Stop | _Call) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._commands.put(command)

    # ---- engine thread --------------------------------------------------------------------

    def _work(self, first: Command | None) -> bool:
        """Apply `first` (the command the thread waited for) and every queued one, stepping while
        steps are due; True once nothing is (the thread then waits for a command), False once
        stopped or failed."""
        try:
            while self._apply_commands(first):
                first = None
                if self._can_step():
                    self._publish(self._step())
                self._settle_pause_waiters()
                self._progress_at = time.monotonic()
                self.stats = self.engine.stats()
                if not self._can_step():
                    self._idle = True
                    return True
            self._die(EngineDeadError("the engine was shut down"))
        except BaseException as error:
            logger.exception("the engine thread failed")
            self.failure = error
            dead = EngineDeadError(f"the engine thread failed: {error!r}")
            dead.__cause__ = error
            self._die(dead)
        return False

    def _step(self) -> list[Request]:
        """One engine step's updated requests; where its sampling failed (StepFailed), the
        failed requests' streams get the error and the engine serves on."""
        try:
            return self.engine.step()
        except StepFailed as failed:
            logger.exception("a step's sampling failed; its requests get the error")
            sents = [self._sent.pop(request.request_id, None) for request in failed.failed]
            _deliver_each([(sent.stream, failed) for sent in sents if sent is not None])
            return failed.updated

    def _apply_commands(self, first: Command | None) -> bool:
        """Apply `first` and every queued command; False once told to stop."""
        if self._idle:  # woken by a command: the wait for work does not count as a stall
            self._progress_at = time.monotonic()
            self._idle = False
        command = first
        if command is None:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        aborted: list[Request] = []  # their outputs posted together, once the commands are done
        while True:
            if isinstance(command, _Stop):
                self._publish(aborted)
                return False
            if isinstance(command, _Abort):
                aborted += self._aborted_now(command.request_ids)
            else:
                self._publish(aborted)  # before a later add or call: those streams end first
                aborted = []
                if isinstance(command, _Add):
                    self._add(command)
                else:
                    self._run_call(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._publish(aborted)
                return True

    def _settle_pause_waiters(self) -> None:
        """pause_generation("wait") returns once the engine paused (or was resumed first)."""
        if self._pause_waiters and (self.engine.paused or not self.engine.is_paused):
            waiters, self._pause_waiters = self._pause_waiters, []
            for loop, drained in waiters:
                _post(loop, _settle, [(drained, None, None)])

    def _can_step(self) -> bool:
        return self.engine.has_unfinished() and self.engine.can_step

    def _run_call(self, call: _Call) -> None:
        try:
            result = call.function(self.engine)
        except Exception as error:  # a bad update or argument must not stop the engine
            _post(call.loop, _settle, [(call.done, None, error)])
            return
        _post(call.loop, _settle, [(call.done, result, None)])

    def _add(self, add: _Add) -> None:
        try:
            if add.request_id in self._sent:  # its stream has not ended (it may have finished)
                raise ValueError(f"request_id {add.request_id!r} is already in use")
            request = self.engine.make_request(
                add.request_id,
                add.params,
                add.prompt,
                add.prompt_token_ids,
                stream_text=True,
                cache_salt=add.cache_salt,
                pooling=add.pooling,
                lora_request=add.lora_request,
                priority=add.priority,
                prompt_embeds=add.prompt_embeds,
            )
        except Exception as error:  # a request the engine rejects must not stop the engine
            _post(add.stream.loop, _resolve, [(add.accepted, error)])
            return
        self.engine.enqueue(request)
        self._sent[request.request_id] = _Sent(add.stream)
        _post(add.stream.loop, _resolve, [(add.accepted, None)])

    def _aborted_now(self, request_ids: list[str]) -> list[Request]:
        """Abort the requests of these ids the engine holds; returns them."""
        requests = [self.engine.requests.get(request_id) for request_id in request_ids]
        for request in filter(None, requests):
            self.engine.abort(request.request_id)
        return list(filter(None, requests))

    def _publish(self, updated: list[Request]) -> None:
        """Turn what each updated request gained into StreamOutputs, one post per event loop."""
        now = time.perf_counter()
        items = []
        interval = self.engine.config.stream_interval
        for request in updated:
            sent = self._sent.get(request.request_id)
            if sent is None:
                continue
            held = len(request.output_token_ids) - sent.num_tokens < interval
            if held and sent.num_tokens and not request.finished:
                continue  # sent with the tokens after it (stream_interval; the first goes at once)
            output = self._delta(request, sent, now)
            if request.finished:
                del self._sent[request.request_id]
            items.append((sent.stream, output))
        _deliver_each(items)

    def _delta(self, request: Request, sent: _Sent, now: float) -> StreamOutput:
        tokens = request.output_token_ids
        text_end = len(request.output_text) if request.finished else streamable_text_end(request)
        assert text_end >= sent.num_chars, "text already streamed was trimmed"
        logprobs = request.logprobs[sent.num_tokens :] if request.logprobs is not None else None
        ranks = request.sampled_ranks[sent.num_tokens :] if logprobs is not None else None
        first = not sent.prompt_sent
        sent.prompt_sent = True
        output = StreamOutput(
            request_id=request.request_id,
            text=request.output_text[sent.num_chars : text_end],
            token_ids=tokens[sent.num_tokens :],
            logprobs=logprobs,
            finished=request.finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(tokens),
            time=now,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_cache_creation_tokens=request.num_cache_creation_tokens or 0,
            prompt_logprobs=request.prompt_logprobs if first else None,
            prompt_ranks=request.prompt_ranks if first else None,
            stop_reason=request.stop_reason,
            prompt_token_ids=request.given_prompt_ids if first else None,
            sampled_ranks=ranks,
            pooled=request.pooled,
            scheduled_time=request.scheduled_time,
        )
        sent.num_tokens, sent.num_chars = len(tokens), text_end
        return output

    def _die(self, error: EngineDeadError) -> None:
        """Fail every open stream and every command still queued; later submissions raise."""
        with self._lock:
            self._dead = error
        items = [(sent.stream, error) for sent in self._sent.values()]
        self._sent.clear()
        for loop, drained in self._pause_waiters:
            _post(loop, _settle, [(drained, None, error)])
        self._pause_waiters.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                _post(command.stream.loop, _resolve, [(command.accepted, error)])
            elif isinstance(command, _Call):
                _post(command.loop, _settle, [(command.done, None, error)])
        _deliver_each(items)


def check_rank(data_parallel_rank: int | None) -> None:
    """vLLM's data_parallel_rank: one AsyncLLM is one engine, rank 0."""
    if data_parallel_rank not in (None, 0) or isinstance(data_parallel_rank, bool):
        raise ValueError(
            f"data_parallel_rank={data_parallel_rank!r}: one AsyncLLM is one engine (rank 0); "
            "tandem serve --data-parallel-size runs replicas"
        )


def streamable_text_end(request: Request) -> int:
    """How much of an unfinished request's text can be streamed without a later stop-string cut.

    A stop string found later ends in text not yet seen, so it starts at most
    len(longest stop) - 1 characters before the current end: hold those back.
    """
    stop = request.params.stop
    held_back = max(map(len, stop)) - 1 if stop else 0
    return max(0, len(request.output_text) - held_back)


def _post(loop: asyncio.AbstractEventLoop, callback, items: list) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
        loop.call_soon_threadsafe(callback, items)


async def _take_all(outputs: asyncio.Queue) -> list:
    """Everything the queue holds, waiting for a first item if it holds none."""
    items = [await outputs.get()]
    while not outputs.empty():
        items.append(outputs.get_nowait())
    return items


def _deliver_each(items: list[tuple[RequestStream, StreamOutput | BaseException]]) -> None:
    """Hand each stream its item from the engine thread: one post per event loop, in order."""
    per_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for stream, item in items:
        per_loop[stream.loop].append((stream, item))
    for loop, its_items in per_loop.items():
        _post(loop, _deliver, its_items)


def _deliver(items: list[tuple[RequestStream, StreamOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.outputs.put_nowait(item)


def _resolve(items: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for future, error in items:
        if future.done():
            continue  # the caller was cancelled
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _settle(items: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, error in items:
        if future.done():
            continue  # the caller was cancelled
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


AsyncLLMEngine = AsyncLLM  # vLLM's older name, which its `from vllm import AsyncLLMEngine` keeps
