"""vLLM's token-in, token-out endpoint: `POST /inference/v1/generate`, for RL rollouts and
routers that tokenize and detokenize themselves, and its render endpoints.

The prompt is `token_ids`, the sampling fields are SamplingParams' own in a nested
`sampling_params` object (left out, `max_tokens` fills the context as the chat endpoint's
does), and each choice answers with its token ids and, with logprobs, each token's logprob
named "token_id:<id>". No text is made unless stop strings need it (`detokenize` off).

`POST /v1/completions/render` and `/v1/chat/completions/render` take the generation endpoints'
bodies and answer the generate request(s) they make: the prompt as the model reads it (a
chat's template rendered) and every SamplingParams field, run nowhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Annotated, Any

from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import AfterValidator, Field

from tandem.sampling import SamplingParams
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    RequestOption,
    StreamOptions,
    Text,
)
from tandem.server.serving import (
    ChatFormat,
    Choice,
    OpenAIServing,
    chat_prompt,
    chat_template_of,
    check_stream_options,
    check_streamed_prompt_logprobs,
    token_id_keys,
)
from tandem.tokenizer import encodable, marks_generation

PARAMS = {f.name for f in dataclasses.fields(SamplingParams)}
SET_BY_THE_SERVER = ("output_kind",)  # as vLLM's: a stream gets deltas, others the final output


class GenerateRequest(RequestOption):
    """vLLM's GenerateRequest (its multimodal and disaggregation fields aside)."""

    request_id: Text | None = None  # the response's id, after "generate-tokens-"
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1), AfterValidator(encodable)] | None = None
    priority: int = 0  # lower is served first under --scheduling-policy priority; fcfs: 0
    # what a render may add, taken back as it gave them: they change nothing generated
    token_offsets: list[tuple[int, int]] | None = None
    assistant_tokens_mask: list[Annotated[int, Field(ge=0, le=1)]] | None = None

    # what OpenAIServing reads of a request body
    return_token_ids = property(lambda self: True)
    return_tokens_as_token_ids = property(lambda self: True)
    prompt_logprobs = property(lambda self: self.sampling_params.get("prompt_logprobs"))


class TokensFormat(ChatFormat):
    """Choices of token ids, logprobs as chat spells them (by "token_id:<id>")."""

    object = chunk_object = ""

    def envelope(self, chunk: bool) -> dict[str, Any]:
        if chunk:
            return {"request_id": self.generation.id}
        generation = self.generation
        return {
            "request_id": generation.id,
            "model": self.model_name,
            "created": generation.created,
        }

    def add_prompt_token_ids(self, response: dict[str, Any], choices: list[Choice]) -> None:
        """The caller sent them: not echoed back (vLLM's GenerateResponse has none)."""

    def delta_choice(self, index: int, choice: Choice, output) -> dict | None:
        if not (output.token_ids or output.finished):
            return None
        return {
            "index": index,
            "logprobs": self._logprobs(output.token_ids, output.logprobs),
            "finish_reason": output.finish_reason,
            "token_ids": output.token_ids,
        }

    def final_choice(self, index: int, choice: Choice) -> dict:
        return {
            "index": index,
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
            "finish_reason": choice.finish_reason,
            "token_ids": choice.token_ids,
        }


def sampling_params(body: GenerateRequest, max_model_len: int, defaults: dict) -> SamplingParams:
    """The request's SamplingParams; a 400 naming an unknown or bad field."""
    fields = {k: v for k, v in body.sampling_params.items() if k not in SET_BY_THE_SERVER}
    unknown = sorted(set(fields) - PARAMS)
    if unknown:
        raise OpenAIError(
            f"sampling_params has no field {unknown[0]!r}", param=f"sampling_params.{unknown[0]}"
        )
    if fields.get("max_tokens") is None:  # as the chat endpoint: what the context leaves
        room = max(1, max_model_len - len(body.token_ids))
        fields["max_tokens"] = min(room, defaults.get("max_tokens", room))
    fields.setdefault("detokenize", bool(fields.get("stop")))
    if isinstance(fields.get("logit_bias"), dict):  # JSON's keys are strings
        fields["logit_bias"] = token_id_keys(fields["logit_bias"])
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as error:
        raise OpenAIError(f"sampling_params: {error}", param="sampling_params") from error


async def generate(serving: OpenAIServing, body: GenerateRequest, http: HttpRequest) -> Response:
    serving.check_model(body.model)
    check_stream_options(body.stream_options, body.stream)
    params = sampling_params(body, serving.llm.max_model_len, serving.llm.sampling_defaults)
    check_streamed_prompt_logprobs(params.prompt_logprobs, body.stream, "sampling_params")
    serving.check_room([body.token_ids], params.max_tokens, "sampling_params.max_tokens")
    prompts = [(None, body.token_ids)]
    generation = await serving._start("generate-tokens", prompts, params, body, http)
    return await serving._respond(generation, TokensFormat, body, http)


async def render_completion(serving: OpenAIServing, body: CompletionRequest) -> list[dict]:
    """The generate request of each prompt of a completion request (with return_token_offsets,
    a text prompt's token offsets)."""
    prompts, params, _, embeds = await serving.completion_inputs(body)
    if embeds is not None:
        raise OpenAIError("prompt_embeds have no token ids to render", param="prompt_embeds")
    if body.use_beam_search:
        raise OpenAIError("the render endpoints take no use_beam_search", param="use_beam_search")
    call_id = uuid.uuid4().hex
    add, wants_offsets = body.add_special_tokens, body.return_token_offsets
    return [
        rendered(
            f"cmpl-{call_id}-{i}",
            ids,
            params,
            body,
            token_offsets=offsets(serving, text, ids, add) if wants_offsets else None,
        )
        for i, (text, ids) in enumerate(prompts)
    ]


async def render_chat(serving: OpenAIServing, body: ChatCompletionRequest) -> dict:
    """The generate request of a chat request: its template rendered, its fields as params;
    vLLM's token offsets in the rendered text and assistant tokens mask where asked."""
    text, ids, params, _ = await serving.chat_inputs(body)
    if body.use_beam_search:
        raise OpenAIError("the render endpoints take no use_beam_search", param="use_beam_search")
    add = body.add_special_tokens
    found = {"token_offsets": None, "assistant_tokens_mask": None}
    if body.return_token_offsets:
        found["token_offsets"] = offsets(serving, text, ids, add)
    if body.return_assistant_tokens_mask:
        found["assistant_tokens_mask"] = await asyncio.to_thread(assistant_mask, serving, body, ids)
    return rendered(f"chatcmpl-{uuid.uuid4().hex}", ids, params, body, **found)


def rendered(
    request_id: str,
    ids: list[int],
    params: SamplingParams,
    body: CompletionRequest | ChatCompletionRequest,
    token_offsets: list[tuple[int, int]] | None = None,
    assistant_tokens_mask: list[int] | None = None,
) -> dict:
    stream = bool(body.stream)
    options = body.stream_options.model_dump() if stream and body.stream_options else None
    return {
        "request_id": request_id,
        "token_ids": ids,
        "assistant_tokens_mask": assistant_tokens_mask,
        "token_offsets": token_offsets,
        "sampling_params": as_fields(params),
        "model": body.model,
        "stream": stream,
        "stream_options": options,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
    }


def offsets(
    serving: OpenAIServing, text: str | None, ids: list[int], add_special_tokens: bool
) -> list[tuple[int, int]] | None:
    """vLLM's token_offsets: each of a text prompt's tokens' (start, end) characters in it;
    None for a prompt of ids, or one cut to fewer tokens (its text is no longer theirs)."""
    if text is None:
        return None
    encoding = serving.tokenizer()(text, add_special_tokens, return_offsets_mapping=True)
    return encoding["offset_mapping"] if encoding.input_ids == ids else None


def assistant_mask(
    serving: OpenAIServing, body: ChatCompletionRequest, ids: list[int]
) -> list[int] | None:
    """vLLM's assistant_tokens_mask: 1 for the rendered prompt's tokens the template puts in
    `{% generation %}` tags (Tokenizer.apply_chat_template's assistant_masks), 0 for the special
    tokens add_special_tokens put before them; None for a template without the tags, or a
    prompt cut to fewer tokens."""
    tokenizer = serving.tokenizer()
    if not marks_generation(chat_template_of(tokenizer, body, serving.options)):
        return None
    encoding = chat_prompt(
        tokenizer, body, serving.options, tokenize=True, return_assistant_tokens_mask=True
    )
    added = len(ids) - len(encoding.input_ids)
    if added < 0 or ids[added:] != encoding.input_ids:
        return None
    return [0] * added + encoding.assistant_masks


def as_fields(params: SamplingParams) -> dict[str, Any]:
    """Every SamplingParams field as JSON takes it (nested parameters as objects), those the
    server sets left out: what `sampling_params` makes the same SamplingParams of."""
    fields = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name in SET_BY_THE_SERVER:
            continue
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        fields[f.name] = value
    return fields
