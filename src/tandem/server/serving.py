"""The generation endpoints: an OpenAI request -> engine requests -> one JSON body or SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2
import torch
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem import __version__
from tandem.async_llm import AsyncLLM, EngineDeadError, RequestStream, StreamOutput
from tandem.lora.request import LoRARequest
from tandem.outputs import prompt_logprobs as logprob_objects
from tandem.outputs import token_text
from tandem.prompt_embeds import decode as decode_embeds
from tandem.reasoning import PARSERS as REASONING_PARSERS
from tandem.reasoning import ReasoningSplitter, split
from tandem.sampling import PromptRows, SamplingParams, seeded, truncate_prompt
from tandem.server import beam_search
from tandem.server.constraints import ToolMode, constraint_field, output_constraint, tool_mode
from tandem.server.metrics import LatencyTracker, ServerMetrics
from tandem.server.options import ServerOptions
from tandem.server.protocol import (
    GUIDED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    SamplingRequest,
    StreamOptions,
    TokenizeRequest,
)
from tandem.server.tool_calls import NamedToolOutput, OutputReader, PlainOutput, collect
from tandem.structured import BACKEND as GRAMMAR_BACKEND
from tandem.structured import StructuredOutputsParams
from tandem.tokenizer import Tokenizer, content_format, developer_as_system, encodable

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
logger = logging.getLogger("uvicorn.error")  # the logger `tandem serve` prints


class ServerShuttingDown(RuntimeError):
    """The server stopped while this request was open (SIGTERM, past the drain timeout)."""


@dataclass
class Choice:
    """One engine request behind a choice, and what it has produced so far."""

    stream: RequestStream
    tracker: LatencyTracker
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # once finished: the stop string or stop token id
    started: bool = False  # a chunk was sent (chat sends the role first)
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache
    num_cache_creation_tokens: int = 0  # of its prompt, written into the prefix cache
    # with echo: the prompt's text and ids, and its logprobs from the first output
    echo: tuple[str, list[int]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's, beside prompt_logprobs
    prompt_token_ids: list[int] | None = None  # from the first output
    reader: OutputReader | None = None  # chat: its streamed text read into content and tool calls
    splitter: ReasoningSplitter | None = None  # chat with a reasoning parser: its thinking apart
    # --enable-log-outputs: a line once it finishes, its text and ids cut to max_log_len
    log_output: bool = False
    log_cut: int | None = None
    log_deltas: bool = False  # a stream's, with --enable-log-deltas: a line per output too

    def add(self, output: StreamOutput) -> None:
        self.tracker.observe(output)
        self.num_cached_tokens = output.num_cached_tokens
        self.num_cache_creation_tokens = output.num_cache_creation_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = output.prompt_logprobs, output.prompt_ranks
        if output.prompt_token_ids is not None:
            self.prompt_token_ids = output.prompt_token_ids
        self.text += output.text
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs or []
        self.finish_reason = output.finish_reason
        self.stop_reason = output.stop_reason
        if self.log_deltas and output.token_ids:
            cut = self.log_cut
            logger.info(
                "generated response %s (streaming delta): output %r, output_token_ids %s",
                self.stream.request_id, output.text[:cut], output.token_ids[:cut],
            )  # fmt: skip
        if output.finished and self.log_output:
            cut = self.log_cut
            logger.info(
                "generated response %s: output %r, output_token_ids %s, finish_reason %s",
                self.stream.request_id, self.text[:cut], self.token_ids[:cut], self.finish_reason,
            )  # fmt: skip


@dataclass(eq=False)  # by identity: OpenAIServing.open holds them
class Generation:
    """The engine requests of one API call; choice index i * n + k is prompt i's k-th sample."""

    id: str
    created: int
    choices: list[Choice]
    prompt_lengths: list[int]  # [num_prompts]
    num_top_logprobs: int | None
    return_token_ids: bool
    tokens_as_ids: bool = False  # logprobs name each token "token_id:<id>", not by its text
    n: int = 1  # choices per prompt
    num_prompt_logprobs: int | None = None  # the request's prompt_logprobs: shown in the response
    reader: Callable[[], OutputReader] = PlainOutput  # chat: how a choice's text is read
    # chat with a reasoning parser: how a choice's thinking is told from its content
    reasoning: Callable[[], ReasoningSplitter] | None = None
    include_reasoning: bool = True
    echoed: str = ""  # chat with echo: the text before each answer
    prompt_text: str | None = None  # chat with return_prompt_text: the rendered prompt, shown
    role: str = "assistant"  # chat: the answer's

    @property
    def hides_metadata(self) -> bool:
        """vLLM's: a chat answer whose reasoning is left out (include_reasoning false) shows no
        logprobs or token ids either, which would tell the thinking."""
        return self.reasoning is not None and not self.include_reasoning

    def usage(self) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        # prompt tokens count each prompt once, and so do its cached ones: its first sample's
        firsts = self.choices[:: self.n]
        cached = sum(c.num_cached_tokens for c in firsts)
        created = sum(c.num_cache_creation_tokens for c in firsts)
        return usage(sum(self.prompt_lengths), completion_tokens, cached, created)

    def choice_usage(self, index: int) -> dict:
        """What one choice has used so far: its prompt and its own tokens (vLLM's usage of a
        chunk with continuous_usage_stats)."""
        choice = self.choices[index]
        prompt_tokens = self.prompt_lengths[index // self.n]
        cached, created = choice.num_cached_tokens, choice.num_cache_creation_tokens
        return usage(prompt_tokens, len(choice.token_ids), cached, created)

    def abort_unfinished(self) -> None:
        for choice in self.choices:
            choice.stream.abort()


class OpenAIServing:
    def __init__(
        self,
        llm: AsyncLLM,
        model_names: list[str],
        metrics: ServerMetrics,
        options: ServerOptions,
        lora_modules: Sequence[LoRARequest] = (),
    ):
        self.llm = llm
        self.model_names = model_names  # any of them names the model in a request
        self.model_name = model_names[0]  # the one answers carry
        # LoRA adapters served under their names (vLLM's --lora-modules, and those loaded at
        # run time: server/adapters.py, which numbers them on from next_lora_id)
        self.adapters = {lora.lora_name: lora for lora in lora_modules}
        self.next_lora_id = 1 + max((lora.lora_int_id for lora in lora_modules), default=0)
        self.metrics = metrics
        self.options = options
        self.open: set[Generation] = set()  # the calls being answered, for `end_all`
        # OpenAI's system_fingerprint of the answers (--fingerprint-mode; None: none)
        self.system_fingerprint = system_fingerprint(llm, options)

    def adapter(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model names, None for the base model."""
        return self.adapters.get(model) if model else None

    def answered_name(self, model: str | None) -> str:
        """The model name an answer carries: the adapter's, or the first served name."""
        return model if self.adapter(model) else self.model_name

    def check_model(self, model: str | None) -> None:
        # as vLLM's, null or "" asks for the first
        if model and model not in self.model_names and model not in self.adapters:
            served = " or ".join(map(repr, [*self.model_names, *self.adapters]))
            raise OpenAIError(
                f"model {model!r} is not served here; use {served}",
                404,
                param="model",
                code="model_not_found",
            )

    def end_all(self, reason: str) -> None:
        """Fail every open call now: streams end with an error event, other calls with a 503."""
        for generation in list(self.open):
            for choice in generation.choices:
                choice.stream.abort()
                choice.stream.outputs.put_nowait(ServerShuttingDown(reason))

    def abort(self, call_ids: set[str]) -> list[str]:
        """End the open calls of these ids (their answers' ids) now: each answers with what it
        has, finish_reason "abort". The ids it found; others (finished, unknown) are left."""
        found = [generation for generation in list(self.open) if generation.id in call_ids]
        for generation in found:
            generation.abort_unfinished()
        return [generation.id for generation in found]

    def tokenizer(self) -> Tokenizer:
        if self.llm.tokenizer is None:
            raise OpenAIError("this model has no tokenizer.json; send token ids as the prompt")
        return self.llm.tokenizer

    async def completions(self, body: CompletionRequest, http: HttpRequest) -> Response:
        prompts, params, max_tokens, embeds = await self.completion_inputs(body)
        if body.use_beam_search:
            return await self._beam_search(body, [ids for _, ids in prompts], max_tokens)
        generation = await self._start("cmpl", prompts, params, body, http, embeds)
        if body.echo:
            for i, choice in enumerate(generation.choices):
                text, ids = prompts[i // params.n]
                choice.echo = (self._prompt_text(text, ids), ids)
        return await self._respond(generation, CompletionFormat, body, http)

    async def completion_inputs(
        self, body: CompletionRequest
    ) -> tuple[list[tuple[str | None, list[int]]], SamplingParams, int, list[torch.Tensor] | None]:
        """A checked completion request's prompts as the model reads them (text, ids), their
        SamplingParams and max_tokens; with prompt_embeds, the embeddings of each prompt
        (whose ids are then placeholders, one per embedding)."""
        self.check_model(body.model)
        self.check_request(body)
        embeds = None
        if (body.prompt is None) == (body.prompt_embeds is None):
            raise OpenAIError("give prompt or prompt_embeds (one of them)", param="prompt")
        if body.prompt == "":  # vLLM's: no text at all, not a prompt of the BOS alone
            raise OpenAIError("prompt must not be empty", param="prompt")
        if body.prompt_embeds is not None:
            embeds = await asyncio.to_thread(completion_embeds, body)
            prompts = [(None, [0] * len(e)) for e in embeds]
        else:  # tokenizing a long prompt takes seconds: off the event loop
            prompts = await asyncio.to_thread(
                self._completion_prompts, body.prompt, body.add_special_tokens
            )
        defaults = self.llm.sampling_defaults
        # as vLLM's: left out or null, max_tokens is 16 (the generation config's at most), and
        # the context must hold them
        asked = max_tokens = body.max_tokens
        if asked is None:
            asked = DEFAULT_COMPLETION_MAX_TOKENS
            max_tokens = min(asked, defaults.get("max_tokens", asked))
        if max_tokens == 0 and not body.echo:
            raise OpenAIError("max_tokens must be >= 1 unless echo is true", param="max_tokens")
        if max_tokens == 0 and body.logprob_token_ids:
            message = "logprob_token_ids needs generated tokens; max_tokens is 0"
            raise OpenAIError(message, param="logprob_token_ids")
        # echo with logprobs scores the prompt too; echo with max_tokens=0 only scores it
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo and (body.logprobs is not None or max_tokens == 0):
            prompt_logprobs = body.logprobs or 0
        logprobs = None if body.logprob_token_ids else body.logprobs  # then: their count
        params = sampling_params(
            body, defaults, max_tokens, logprobs, prompt_logprobs, output_constraint(body)
        )
        if embeds is not None:  # their placeholder ids follow them
            embeds = [self._cut(e, body, asked) for e in embeds]
            prompts = [(None, [0] * len(e)) for e in embeds]
        else:
            prompts = await asyncio.to_thread(  # a cut text is tokenized again
                lambda: [self._kept(text, ids, body, asked) for text, ids in prompts]
            )
        self.check_room([ids for _, ids in prompts], asked, "max_tokens")
        return prompts, params, max_tokens, embeds

    def _kept(
        self, text: str | None, ids: list[int], body: SamplingRequest, max_tokens: int | None
    ) -> tuple[str | None, list[int]]:
        """The prompt the model reads: its ids `_cut` (their text left to decoding where that
        cut them), else the prompt as given. A text cut on no named side is cut by the
        tokenizer with its special tokens kept (a BOS stays first), as vLLM's. The engine's own
        cut then keeps them all."""
        kept = self._cut(ids, body, max_tokens)
        if len(kept) == len(ids):
            return text, ids
        if text is not None and body.truncation_side is None:
            add = bool(body.add_special_tokens)
            kept = self.tokenizer().encode(text, add, max_length=len(kept), side="left")
        return None, kept

    def _cut(self, prompt: PromptRows, body: SamplingRequest, max_tokens: int | None) -> PromptRows:
        """A prompt's ids or embeddings cut to the body's truncate_prompt_tokens: the last ones
        unless truncation_side is "right". As in vLLM, -1 leaves room for the `max_tokens`
        asked for."""
        keep = body.truncate_prompt_tokens
        if keep == -1 and max_tokens and max_tokens < self.llm.max_model_len:
            keep = self.llm.max_model_len - max_tokens
        side = body.truncation_side or "left"
        return truncate_prompt(prompt, keep, self.llm.max_model_len - 1, side)

    def check_room(self, prompts: list[list[int]], max_tokens: int | None, field: str) -> None:
        """A 400, as vLLM's, for a `max_tokens` the context cannot hold after a prompt (one too
        long to start is the engine's 400)."""
        limit = self.llm.max_model_len
        longest = max(len(ids) for ids in prompts)
        if max_tokens is None or longest >= limit or longest + max_tokens <= limit:
            return
        message = (
            f"{field} is {max_tokens} but the prompt has {longest} tokens and max_model_len is "
            f"{limit}; ask for at most {limit - longest} tokens or shorten the prompt"
        )
        raise OpenAIError(message, param=field)

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        if self.llm.tokenizer is None:
            return ""
        return self.llm.tokenizer.decode(ids, skip_special_tokens=False)

    async def chat(self, body: ChatCompletionRequest, http: HttpRequest) -> Response:
        text, ids, params, mode = await self.chat_inputs(body)
        if body.use_beam_search:
            return await self._beam_search(body, [ids], params.max_tokens)
        generation = await self._start("chatcmpl", [(text, ids)], params, body, http)
        role = self.options.response_role
        generation.reader, generation.echoed = mode.reader, body.echoed(role)
        generation.role = body.answer_role(role)
        if body.return_prompt_text:
            generation.prompt_text = self._prompt_text(text, ids)
        name, think = self.llm.engine.config.reasoning_parser, self.llm.engine.think_tokens
        if name is not None:  # the answer thinks first unless its prompt closed the thinking
            thinking = not think.ended(ids)
            kwargs = self.options.chat_template_kwargs(body.template_kwargs())  # as rendered
            generation.reasoning = lambda: REASONING_PARSERS[name].splitter(thinking, kwargs)
            generation.include_reasoning = body.include_reasoning
            generation.return_token_ids &= not generation.hides_metadata
        return await self._respond(generation, ChatFormat, body, http)

    async def chat_inputs(
        self, body: ChatCompletionRequest
    ) -> tuple[str, list[int], SamplingParams, ToolMode]:
        """A checked chat request's rendered prompt (text, ids), its SamplingParams and how
        its answer is read (tools)."""
        self.check_model(body.model)
        self.check_request(body)
        if body.top_logprobs and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        mode = tool_mode(body, self.options.tool_call_parser)
        constraint = output_constraint(body, mode.constraint)
        text, ids = await asyncio.to_thread(chat_ids, self.tokenizer(), body, self.options)
        field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        asked = getattr(body, field)
        if asked is not None and asked < 1:  # a chat cannot score its prompt alone
            raise OpenAIError(f"{field} must be >= 1, got {asked}", param=field)
        text, ids = await asyncio.to_thread(self._kept, text, ids, body, asked)
        self.check_room([ids], asked, field)
        defaults = self.llm.sampling_defaults
        room = max(1, self.llm.max_model_len - len(ids))
        max_tokens = min(room, defaults.get("max_tokens", room)) if asked is None else asked
        logprobs = (
            (body.top_logprobs or 0) if body.logprobs and not body.logprob_token_ids else None
        )
        params = sampling_params(
            body, defaults, max_tokens, logprobs, body.prompt_logprobs, constraint
        )
        if not mode.skip_special_tokens:
            params = replace(params, skip_special_tokens=False)
        return text, ids, params, mode

    async def _beam_search(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        starts: list[list[int]],
        max_tokens: int,
    ) -> Response:
        """`use_beam_search`: the n best beams of each prompt, answered whole."""
        beam_search.check(body)
        params = beam_search.params_of(body, max_tokens, self.llm.sampling_defaults)
        num_sequences = len(starts) * params.beam_width
        if num_sequences > self.options.max_sequences_per_request:
            message = (
                f"this request asks for {num_sequences} beams; at most "
                f"{self.options.max_sequences_per_request} are allowed in one request"
            )
            raise OpenAIError(message, param="n")
        adapter = self.adapter(body.model)
        outputs = await beam_search.search(self.llm, starts, params, body.priority, adapter)
        answer = beam_search.response(
            body, self.model_name, starts, outputs, self.llm.tokenizer, self.options.response_role
        )
        if not body.stream:
            return JSONResponse(answer)
        options = body.stream_options
        usage = bool(options and options.include_usage) or self.options.enable_force_include_usage
        chunks = [sse(event) for event in beam_search.events(answer, usage)]
        return StreamingResponse(
            iter([*chunks, "data: [DONE]\n\n"]), media_type="text/event-stream"
        )

    def check_request(self, body: SamplingRequest) -> None:
        """400 for what this server does not implement, or what passes its limits."""
        check_supported(body)
        try:
            self.llm.engine.admission.check_priority(body.priority)
        except ValueError as error:  # a priority under fcfs
            raise OpenAIError(str(error), param="priority") from error
        check_stream_options(body.stream_options, body.stream)
        check_streamed_prompt_logprobs(body.prompt_logprobs, body.stream, "prompt_logprobs")
        if body.logprob_token_ids and body.use_beam_search:
            message = "logprob_token_ids is not supported with use_beam_search"
            raise OpenAIError(message, param="logprob_token_ids")
        if body.logprob_token_ids and (body.logprobs is None or body.logprobs is False):
            message = "logprob_token_ids needs logprobs set"
            raise OpenAIError(message, param="logprob_token_ids")
        stop, limits = body.stop_strings(), self.options
        if len(stop) > limits.max_stop_strings:
            message = f"stop has {len(stop)} strings; at most {limits.max_stop_strings} are allowed"
            raise OpenAIError(message, param="stop")
        if any(len(s) > limits.max_stop_string_length for s in stop):
            message = f"a stop string is longer than {limits.max_stop_string_length} characters"
            raise OpenAIError(message, param="stop")

    def _completion_prompts(
        self, prompt: Any, add_special_tokens: bool
    ) -> list[tuple[str | None, list[int]]]:
        """A prompt or a batch of them, as (text, token ids) pairs."""
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            prompt = [prompt]  # one prompt, as text or as token ids
        if all(isinstance(p, list) for p in prompt):
            return [(None, p) for p in prompt]
        tokenizer = self.tokenizer()
        return [(p, tokenizer.encode(p, add_special_tokens)) for p in prompt]

    async def _start(
        self,
        kind: str,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        body: SamplingRequest,
        http: HttpRequest,
        embeds: list[torch.Tensor] | None = None,
    ) -> Generation:
        """Queue n engine requests per prompt (with `embeds`, each prompt given as those
        embeddings), all validated by the engine, or none. The
        response's id is the client's (X-Request-Id, else request_id) when it gives one; the
        engine's stay unique, so calls that share an id run side by side."""
        arrival, call_id = time.perf_counter(), uuid.uuid4().hex
        num_sequences, limit = len(prompts) * params.n, self.options.max_sequences_per_request
        if num_sequences > limit:
            message = (
                f"this request asks for {len(prompts)} prompts x n={params.n} = {num_sequences} "
                f"sequences; at most {limit} are allowed in one request"
            )
            raise OpenAIError(message, param="n")
        salt, priority = body.cache_salt, body.priority
        given = embeds or [None] * len(prompts)  # a prompt of embeddings: no text or ids
        inputs = [(None, None) if e is not None else p for p, e in zip(prompts, given, strict=True)]
        requests = [
            (f"{kind}-{call_id}-{i}-{k}", seeded(params, k), text, ids, salt, priority, given[i])
            for i, (text, ids) in enumerate(inputs)
            for k in range(params.n)
        ]
        if self.options.enable_log_requests:
            self._log_requests(kind, call_id, prompts, params, body)
        try:
            streams = await self.llm.add_requests(requests, lora_request=self.adapter(body.model))
        except ValueError as error:
            raise invalid_request(error, body) from error
        self.metrics.n.observe(params.n)
        logged = {
            "log_output": self.options.enable_log_outputs,
            "log_cut": self.options.max_log_len,
            "log_deltas": self.options.enable_log_outputs
            and self.options.enable_log_deltas
            and bool(getattr(body, "stream", False)),
        }
        choices = [
            Choice(s, LatencyTracker(self.metrics, arrival, params.max_tokens), **logged)
            for s in streams
        ]
        client_id = http.headers.get("X-Request-Id", body.request_id)
        return Generation(
            id=f"{kind}-{client_id or call_id}",
            created=int(time.time()),
            choices=choices,
            prompt_lengths=[len(ids) for _, ids in prompts],
            num_top_logprobs=params.logprobs,
            return_token_ids=bool(body.return_token_ids),
            tokens_as_ids=bool(body.return_tokens_as_token_ids)
            or self.options.return_tokens_as_token_ids,
            n=params.n,
            num_prompt_logprobs=body.prompt_logprobs,
        )

    def _log_requests(
        self,
        kind: str,
        call_id: str,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        body: SamplingRequest,
    ) -> None:
        """--enable-log-requests: a line per prompt, cut to --max-log-len characters and ids."""
        cut = self.options.max_log_len
        adapter = self.adapter(body.model)
        for i, (text, ids) in enumerate(prompts):
            logger.info(
                "received request %s-%s-%d: prompt %r, prompt_token_ids %s, params %s, "
                "lora_request %s",
                kind, call_id, i, text if text is None else text[:cut], ids[:cut], params,
                adapter and adapter.lora_name,
            )  # fmt: skip

    async def _respond(
        self,
        generation: Generation,
        format_type: type[Format],
        body: SamplingRequest,
        http: HttpRequest,
    ) -> Response:
        fmt = format_type(self.answered_name(body.model), self.llm.tokenizer, generation)
        self.open.add(generation)
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            include_usage = include_usage or self.options.enable_force_include_usage
            continuous = include_usage and bool(options and options.continuous_usage_stats)
            events = self._events(generation, fmt, include_usage, continuous)
            return StreamingResponse(events, media_type="text/event-stream")
        collect = asyncio.ensure_future(self._collect(generation, fmt))
        disconnect = asyncio.ensure_future(until_disconnected(http))
        try:
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not collect.done():
                collect.cancel()  # the client left, or this handler was cancelled
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
        if collect.cancelled():
            log_disconnect(generation)
            return Response(status_code=499)
        return JSONResponse(collect.result())

    async def _collect(self, generation: Generation, fmt: Format) -> dict[str, Any]:
        try:
            async for index, output in merge([c.stream for c in generation.choices]):
                generation.choices[index].add(output)
        finally:
            generation.abort_unfinished()
            self.open.discard(generation)
        response = {
            **fmt.envelope(chunk=False),
            "choices": [fmt.final_choice(i, c) for i, c in enumerate(generation.choices)],
            "usage": generation.usage(),
        }
        if generation.num_prompt_logprobs is not None:
            fmt.add_prompt_logprobs(response)
        if generation.return_token_ids:
            fmt.add_prompt_token_ids(response, generation.choices)
        if generation.prompt_text is not None:
            response["prompt_text"] = generation.prompt_text
        if fmt.object:  # OpenAI's answers (not the token-in, token-out endpoint's)
            response["system_fingerprint"] = self.system_fingerprint
            if timing := self.timing(generation):
                response["metrics"] = timing
        return response

    def timing(self, generation: Generation) -> dict[str, float | None] | None:
        """--enable-per-request-metrics: the answer's timings (LatencyTracker.timing), where it
        is one choice (as vLLM's: several choices' times are no one request's)."""
        if not self.options.enable_per_request_metrics or len(generation.choices) != 1:
            return None
        return generation.choices[0].tracker.timing()

    async def _events(
        self, generation: Generation, fmt: Format, include_usage: bool, continuous: bool = False
    ) -> AsyncIterator[str]:
        """The stream's chunks; with `include_usage` a last chunk of usage (before it each chunk
        says "usage": null, or with `continuous` its choice's usage so far)."""
        chunk_envelope = fmt.envelope(chunk=True)
        usage_field = {"usage": None} if include_usage else {}
        # as vLLM's: the fingerprint on each choice's last chunk, or on the usage chunk after them
        stamp = bool(fmt.object) and self.system_fingerprint is not None
        ended = False  # the stream reached its end, or an error event; else the client left
        try:
            async for index, output in merge([c.stream for c in generation.choices]):
                choice = generation.choices[index]
                choice.add(output)
                delta = fmt.delta_choice(index, choice, output)
                if delta is not None:
                    if continuous:
                        usage_field = {"usage": generation.choice_usage(index)}
                    chunk = {**chunk_envelope, "choices": [delta], **usage_field}
                    if generation.return_token_ids and not choice.started:  # its first chunk
                        fmt.add_prompt_token_ids(chunk, [choice])
                    if generation.prompt_text is not None and not choice.started:
                        chunk["prompt_text"] = generation.prompt_text
                    if stamp and not include_usage and delta.get("finish_reason") is not None:
                        chunk["system_fingerprint"] = self.system_fingerprint  # a last chunk
                    choice.started = True
                    yield sse(chunk)
            if include_usage:
                last = {**chunk_envelope, "choices": [], "usage": generation.usage()}
                if stamp:
                    last["system_fingerprint"] = self.system_fingerprint
                if fmt.object and (timing := self.timing(generation)):
                    last["metrics"] = timing  # a stream's: on its usage chunk
                yield sse(last)
            ended = True
        except EngineDeadError as error:
            ended = True
            yield sse(OpenAIError(str(error), 500, "server_error").body())
        except ServerShuttingDown as error:
            ended = True
            yield sse(OpenAIError(str(error), 503, "server_error").body())
        except Exception as error:  # a fault of ours: the stream still ends, as a 500 would
            ended = True
            logger.exception("%s: the stream failed", generation.id)
            yield sse(OpenAIError(f"internal error: {error!r}", 500, "server_error").body())
        finally:
            generation.abort_unfinished()  # e.g. the client disconnected: free the KV blocks
            self.open.discard(generation)
            if not ended:
                log_disconnect(generation)
        yield "data: [DONE]\n\n"


class Format:
    """How one endpoint spells its envelope, its choices and its logprobs."""

    object: str
    chunk_object: str

    def __init__(self, model_name: str, tokenizer: Tokenizer | None, generation: Generation):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.generation = generation

    def envelope(self, chunk: bool) -> dict[str, Any]:
        return {
            "id": self.generation.id,
            "object": self.chunk_object if chunk else self.object,
            "created": self.generation.created,
            "model": self.model_name,
        }

    def delta_choice(self, index: int, choice: Choice, output: StreamOutput) -> dict | None:
        """The chunk choice for one output, or None when it has nothing to show."""
        raise NotImplementedError

    def final_choice(self, index: int, choice: Choice) -> dict:
        raise NotImplementedError

    def add_prompt_token_ids(self, response: dict[str, Any], choices: list[Choice]) -> None:
        """vLLM's `prompt_token_ids` (with return_token_ids): in each choice of `response`, the
        whole answer or a stream's first chunk of each choice."""
        for shown, choice in zip(response["choices"], choices, strict=True):
            shown["prompt_token_ids"] = choice.prompt_token_ids

    def add_prompt_logprobs(self, response: dict[str, Any]) -> None:
        """The request's prompt_logprobs, as vLLM's: in each choice."""
        for index, choice in enumerate(response["choices"]):
            choice["prompt_logprobs"] = self.prompt_logprobs(index)

    def prompt_logprobs(self, index: int) -> list[dict[str, dict[str, Any]] | None]:
        """Choice `index`'s prompt logprobs as vLLM serializes its Logprobs: per prompt position
        (None for the first) {"token id": {"logprob", "rank", "decoded_token"}}, -inf as -9999."""
        choice = self.generation.choices[index]  # each sample of a prompt scores it too
        entries, ids = choice.prompt_logprobs or [], choice.prompt_token_ids or []
        ranks = choice.prompt_ranks or []
        text = token_text(self.tokenizer)
        num_top = self.generation.num_prompt_logprobs or 0
        return [
            None
            if entry is None
            else {
                str(t): {
                    "logprob": json_logprob(p),
                    "rank": p.rank,
                    "decoded_token": p.decoded_token,
                }
                for t, p in entry.items()
            }
            for entry in logprob_objects(entries, ids, ranks, num_top, text)
        ]

    def piece(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def label(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or its id (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.generation.tokens_as_ids else self.piece(token_id)

    def token_ids(self, token_ids: list[int]) -> dict[str, list[int]]:
        return {"token_ids": token_ids} if self.generation.return_token_ids else {}

    def shows(self, output: StreamOutput) -> bool:
        """Whether the output's chunk has something beside its text: its end, its logprobs or
        its token ids where the request returns them."""
        wants_ids = self.generation.return_token_ids and output.token_ids
        logprobs = output.logprobs and not self.generation.hides_metadata
        return bool(output.finished or logprobs or wants_ids)


class CompletionFormat(Format):
    object = chunk_object = "text_completion"

    def delta_choice(self, index: int, choice: Choice, output: StreamOutput) -> dict | None:
        echo = choice.echo if not choice.started else None  # the prompt leads the first chunk
        if echo is None and not (output.text or self.shows(output)):
            return None
        echoed = len(choice.echo[0]) if choice.echo is not None else 0
        text_offset = echoed + len(choice.text) - len(output.text)
        return self._choice(
            index, output.text, output.token_ids, output.logprobs, output.finish_reason,
            output.stop_reason, text_offset, echo, choice.prompt_logprobs,
        )  # fmt: skip

    def final_choice(self, index: int, choice: Choice) -> dict:
        return self._choice(
            index, choice.text, choice.token_ids, choice.logprobs, choice.finish_reason,
            choice.stop_reason, 0, choice.echo, choice.prompt_logprobs,
        )  # fmt: skip

    def _choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        text_offset: int,
        echo: tuple[str, list[int]] | None = None,
        prompt_logprobs: list[dict[int, float] | None] | None = None,
    ) -> dict[str, Any]:
        shown_ids, entries = token_ids, logprobs or []
        if echo is not None:
            prompt_text, prompt_ids = echo
            text_offset = 0  # the prompt starts the text
            text, shown_ids = prompt_text + text, prompt_ids + token_ids
            entries = (prompt_logprobs or [None] * len(prompt_ids)) + entries
        wants_logprobs = self.generation.num_top_logprobs is not None and shown_ids
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(text, shown_ids, entries, text_offset)
            if wants_logprobs
            else None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            **self.token_ids(token_ids),
        }

    def _logprobs(
        self,
        text: str,
        token_ids: list[int],
        entries: list[dict[int, float] | None],
        text_offset: int,
    ) -> dict[str, list]:
        """OpenAI's legacy logprobs object; the first prompt token of an echo has none."""
        tokens = [self.piece(t) for t in token_ids]
        return {
            "tokens": [self.label(t) for t in token_ids]
            if self.generation.tokens_as_ids
            else tokens,
            "token_logprobs": [
                None if e is None else json_logprob(e[t])
                for t, e in zip(token_ids, entries, strict=True)
            ],
            "top_logprobs": [None if e is None else self._by_text(e) for e in entries],
            "text_offset": self._text_offsets(text, token_ids, tokens, text_offset),
        }

    def _by_text(self, entry: dict[int, float]) -> dict[str, float]:
        """An entry keyed by each id's text. Ids can share one (lone bytes of a character all
        decode to "\ufffd"): the text keeps the larger logprob, so the most likely token is never
        hidden by a less likely one written after it (lm-eval's is_greedy reads the max)."""
        by_text: dict[str, float] = {}
        for token_id, logprob in entry.items():
            text = self.label(token_id)
            by_text[text] = json_logprob(max(logprob, by_text.get(text, logprob)))
        return by_text

    def _text_offsets(
        self, text: str, token_ids: list[int], tokens: list[str], start: int
    ) -> list[int]:
        """Where each token starts, for `text` that starts at `start`. A special token that the
        text leaves out (e.g. the BOS before an echoed text prompt) takes no characters."""
        offsets, cursor = [], 0
        for token_id, token in zip(token_ids, tokens, strict=True):
            offsets.append(start + cursor)
            if text.startswith(token, cursor) or not self.is_skipped(token_id):
                cursor += len(token)
        return offsets

    def is_skipped(self, token_id: int) -> bool:
        """A special token, which text decoded with skip_special_tokens leaves out."""
        if self.tokenizer is None:
            return False
        return self.tokenizer.decode([token_id], skip_special_tokens=True) == ""


class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def add_prompt_logprobs(self, response: dict[str, Any]) -> None:
        """vLLM's chat response holds them once, beside its choices (one prompt)."""
        response["prompt_logprobs"] = self.prompt_logprobs(0)

    def add_prompt_token_ids(self, response: dict[str, Any], choices: list[Choice]) -> None:
        """vLLM's chat holds them once, beside its choices (one prompt)."""
        response["prompt_token_ids"] = choices[0].prompt_token_ids

    def delta_choice(self, index: int, choice: Choice, output: StreamOutput) -> dict | None:
        if choice.reader is None:
            choice.reader = self.generation.reader()
            choice.splitter = self.generation.reasoning and self.generation.reasoning()
        reasoning, text = "", output.text
        if choice.splitter is not None:
            reasoning, text = choice.splitter.feed(text, final=output.finished)
        read = choice.reader.feed(text, final=output.finished)
        delta: dict[str, Any] = {} if choice.started else {"role": self.generation.role}
        if reasoning and self.generation.include_reasoning:
            delta["reasoning"] = reasoning
        content = read.content if choice.started else self.generation.echoed + read.content
        if content or (not choice.started and isinstance(choice.reader, PlainOutput)):
            delta["content"] = content  # plain chat starts with content, "" if none yet
        if read.calls:
            delta["tool_calls"] = [call.as_openai() for call in read.calls]
        if not (delta or self.shows(output)):  # text a tool parser holds back shows nothing
            return None
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(output.token_ids, output.logprobs),
            "finish_reason": finish_reason(output.finish_reason, choice.reader),
            "stop_reason": output.stop_reason,
            **self.token_ids(output.token_ids),
        }

    def final_choice(self, index: int, choice: Choice) -> dict:
        reader = self.generation.reader()
        text, reasoning = choice.text, None
        if self.generation.reasoning is not None:
            reasoning, text = split(self.generation.reasoning(), choice.text)
        message: dict[str, Any] = {"role": self.generation.role, "content": text}
        if self.generation.reasoning is not None:
            message["content"] = text or None  # vLLM's: null when the answer only thought
            message["reasoning"] = reasoning if self.generation.include_reasoning else None
        if not isinstance(reader, PlainOutput):
            message["content"], tool_calls = collect(reader, text)
            if tool_calls:
                message["tool_calls"] = tool_calls
        if self.generation.echoed:
            message["content"] = self.generation.echoed + (message["content"] or "")
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
            "finish_reason": finish_reason(choice.finish_reason, reader),
            "stop_reason": choice.stop_reason,
            **self.token_ids(choice.token_ids),
        }

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]] | None
    ) -> dict[str, list] | None:
        if not entries or self.generation.hides_metadata:
            return None
        # an entry holds the top ids in rank order, then the sampled id if it ranked lower
        num_top = self.generation.num_top_logprobs or 0
        content = [
            {
                **self._token(t, e[t]),
                "top_logprobs": [self._token(i, lp) for i, lp in list(e.items())[:num_top]],
            }
            for t, e in zip(token_ids, entries, strict=True)
        ]
        return {"content": content}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        label = self.label(token_id)
        return {"token": label, "logprob": json_logprob(logprob), "bytes": list(label.encode())}


def json_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (a token the filters or a grammar removed, under a
    processed logprobs mode) as -9999.0, OpenAI's and vLLM's stand-in."""
    return max(logprob, -9999.0)


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, created_cache_tokens: int
) -> dict[str, Any]:
    details = {"cached_tokens": cached_tokens, "created_cache_tokens": created_cache_tokens}
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


def finish_reason(reason: str | None, reader: OutputReader) -> str | None:
    """A chat output that ended by itself after making tool calls finishes with "tool_calls",
    except under a named tool_choice, where OpenAI (and vLLM) answer "stop"."""
    named = isinstance(reader, NamedToolOutput)
    return "tool_calls" if reason == "stop" and reader.num_calls and not named else reason


def log_disconnect(generation: Generation) -> None:
    """One line for a client that left: its requests were aborted, which is no error."""
    logger.info("%s: the client disconnected; its requests were aborted", generation.id)


def check_stream_options(options: StreamOptions | None, stream: bool) -> None:
    """vLLM's rule: stream_options that set something need stream true (an empty {} is taken)."""
    if options is not None and options.model_fields_set and not stream:
        raise OpenAIError("stream_options needs stream set to true", param="stream_options")


def check_streamed_prompt_logprobs(prompt_logprobs: int | None, stream: bool, param: str) -> None:
    """vLLM's rule: a stream shows no prompt logprobs, so one may ask for none beyond each
    prompt token's own (prompt_logprobs 0, shown nowhere), not for more."""
    if prompt_logprobs and stream:
        message = "prompt_logprobs are not available when stream is true"
        raise OpenAIError(message, param=param)


def check_supported(body: SamplingRequest) -> None:
    name = body.unsupported_field()
    if name is not None:
        fix = "remove it from the request"
        if name in GUIDED_FIELDS:  # a constraint never fails open: say where it goes now
            fix = f'vLLM 0.12 moved it to structured_outputs: {{"{GUIDED_FIELDS[name]}": ...}}'
        raise OpenAIError(
            f"{name} is not supported by this server; {fix}",
            param=name,
            code="unsupported_parameter",
        )


def chat_ids(
    tokenizer: Tokenizer, body: ChatCompletionRequest | TokenizeRequest, options: ServerOptions
) -> tuple[str, list[int]]:
    """The rendered chat prompt of a request's messages and its token ids."""
    text = chat_prompt(tokenizer, body, options)
    return text, tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def system_fingerprint(llm: AsyncLLM, options: ServerOptions) -> str | None:
    """OpenAI's system_fingerprint as vLLM's --fingerprint-mode makes it: "full"
    tandem-<version>[-tp<N>][-pp<N>]-<hash8> (hash8: of the engine's settings, the model's
    name, dtype and quantization among them), "hash" without the parallel sizes, "custom"
    --fingerprint-value, "none" None."""
    mode = options.fingerprint_mode
    if mode in ("none", "custom"):
        return options.fingerprint_value if mode == "custom" else None
    config = dataclasses.asdict(llm.engine.config)
    config.pop("hf_token", None)  # a secret, and no part of what answers
    settings = json.dumps(config, sort_keys=True, default=lambda v: type(v).__qualname__)
    hash8 = hashlib.blake2b(settings.encode(), digest_size=4).hexdigest()
    sizes = [
        f"{name}{size}"
        for name, size in (("tp", config["tensor_parallel_size"]),
                           ("pp", config["pipeline_parallel_size"]))
        if size > 1 and mode == "full"
    ]  # fmt: skip
    return "-".join([f"tandem-{__version__}", *sizes, hash8])


def request_tools(
    body: ChatCompletionRequest | TokenizeRequest, options: ServerOptions
) -> list[dict] | None:
    """The tools the chat template is given: the request's, none under tool_choice "none"
    with --exclude-tools-when-tool-choice-none."""
    if options.exclude_tools_when_tool_choice_none and getattr(body, "tool_choice", None) == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def chat_template_of(
    tokenizer: Tokenizer, body: ChatCompletionRequest | TokenizeRequest, options: ServerOptions
) -> str | None:
    """The template a chat request renders with: the request's where the server trusts it, else
    the server's (--chat-template), else the model's for its tools. A 400 where it may not."""
    if body.chat_template is not None and not options.trust_request_chat_template:
        raise OpenAIError(
            "this server renders chats with its own template; a request's chat_template needs "
            "--trust-request-chat-template",
            param="chat_template",
        )
    try:
        return tokenizer.get_chat_template(
            body.chat_template or options.chat_template, request_tools(body, options)
        )
    except ValueError as error:  # named templates and no default
        raise OpenAIError(str(error), param="chat_template") from error


def chat_prompt(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest | TokenizeRequest,
    options: ServerOptions,
    **render: Any,
) -> Any:
    """The request's messages rendered by the chat template with its options (the template
    `chat_template_of` picks; the server's default variables under the request's): the text, or
    what apply_chat_template's `render` options ask for. A 400 if the template or the options
    refuse them."""
    template = chat_template_of(tokenizer, body, options)
    tools = request_tools(body, options)
    try:
        fmt = content_format(template, options.chat_template_content_format)
    except jinja2.TemplateError as error:  # a request's template that does not parse
        message = f"the chat template failed on these messages: {error}"
        raise OpenAIError(message, param="messages") from error
    except ValueError as error:
        raise OpenAIError(str(error), param="chat_template") from error
    try:
        rendered = tokenizer.apply_chat_template(
            developer_as_system([m.as_template_input(fmt) for m in body.messages], template),
            tools,
            chat_template=body.chat_template or options.chat_template,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=options.chat_template_kwargs(body.template_kwargs()),
            **({"tokenize": False} | render),
        )
        # JSON the template renders may unescape a lone surrogate ("\\ud800") into it
        return encodable(rendered) if isinstance(rendered, str) else rendered
    except ValueError as error:  # no template, the template's own error or raise_exception,
        # a surrogate
        raise OpenAIError(str(error), param="messages") from error


def sampling_params(
    body: SamplingRequest,
    defaults: dict[str, Any],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's sampling fields as SamplingParams; unset fields take the model's `defaults`
    (its generation config's, `Engine.sampling_defaults`), then SamplingParams' own."""
    names = (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "truncation_side",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "repetition_detection",
        "thinking_token_budget",
        "logprob_token_ids",
    )
    given = {name: value for name, value in defaults.items() if name != "max_tokens"}
    given |= {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if getattr(body, "use_beam_search", False):
        given["n"] = 1  # n is the beam width (beam_search.params_of), greedy or not
    if body.logit_bias is not None:
        given["logit_bias"] = token_id_keys(body.logit_bias)
    if body.vllm_xargs is not None:
        given["extra_args"] = body.vllm_xargs
    try:
        return SamplingParams(
            **given,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
        )
    except ValueError as error:
        raise invalid_request(error, body) from error


def token_id_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's {"token id": bias} with int keys; a 400 naming logit_bias for any other key."""
    try:
        return {int(key): bias for key, bias in logit_bias.items()}
    except ValueError as error:
        message = f"logit_bias keys must be token ids, got {list(logit_bias)!r}"
        raise OpenAIError(message, param="logit_bias") from error


def invalid_request(error: ValueError, body: SamplingRequest) -> OpenAIError:
    """A 400 for a ValueError; its message starts with the field it is about."""
    word, fields = str(error).split(" ", 1)[0], type(body).model_fields
    if word in (GRAMMAR_BACKEND, "structured_outputs"):  # the engine's constraint errors
        word = constraint_field(body)
    if word == "logprobs" and "top_logprobs" in fields:  # a chat's count of top ids
        word = "top_logprobs"
    if word.startswith("prompt") and word not in fields:  # prompt_token_ids: the body's field
        word = next(name for name in ("prompt", "messages", "token_ids") if name in fields)
    param = word if word in fields else None
    return OpenAIError(str(error), param=param)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """Outputs of several streams as they arrive, with the index of their stream."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    arrived: asyncio.Queue[tuple[int, StreamOutput | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                arrived.put_nowait((index, output))
        except Exception as error:
            arrived.put_nowait((index, error))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await arrived.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield index, item
    finally:
        for task in pumps:
            task.cancel()


def completion_embeds(body: CompletionRequest) -> list[torch.Tensor]:
    """A completion request's prompt_embeds, each decoded (prompt_embeds.decode); the engine
    checks them against the model."""
    if body.echo:
        raise OpenAIError("echo needs the prompt's text; prompt_embeds have none", param="echo")
    if body.use_beam_search:
        message = "use_beam_search runs on token ids; prompt_embeds have none"
        raise OpenAIError(message, param="use_beam_search")
    texts = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) else body.prompt_embeds
    if not texts:
        raise OpenAIError("prompt_embeds is an empty list", param="prompt_embeds")
    try:
        return [decode_embeds(text) for text in texts]
    except ValueError as error:
        raise OpenAIError(str(error), param="prompt_embeds") from None


async def until_disconnected(http: HttpRequest) -> None:
    """Return once the client has gone (the body has been read, so only a disconnect comes)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict[str, Any]) -> str:
    # ASCII escapes keep the event on one line for clients that also split on U+2028, U+0085 (httpx)
    return f"data: {json.dumps(payload)}\n\n"
