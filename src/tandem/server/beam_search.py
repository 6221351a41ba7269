"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: each prompt's `n` best
beams (beam_search.py's search, its rounds run through AsyncLLM), answered whole (with
`stream`, as vLLM's, in the events of the whole answer; no logprobs, echo or constraints)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

from tandem.async_llm import AsyncLLM
from tandem.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tandem.lora.request import LoRARequest
from tandem.sampling import RequestOutputKind
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    SamplingRequest,
)


def check(body: SamplingRequest) -> None:
    """A 400 naming what beam search here does not take."""
    refused = {
        "logprobs": body.logprobs,
        "echo": getattr(body, "echo", None),
        # a "text" format constrains nothing
        "response_format": body.response_format and body.response_format.type != "text",
        "structured_outputs": body.structured_outputs,
        "tools": getattr(body, "tools", None),
        "prompt_logprobs": body.prompt_logprobs,
    }
    for name, value in refused.items():
        if value:
            raise OpenAIError(f"use_beam_search does not take {name}", param=name)


BODY_FIELDS = {"beam_width": "n"}  # BeamSearchParams' fields the body names otherwise


def params_of(body: SamplingRequest, max_tokens: int, defaults: dict[str, Any]) -> BeamSearchParams:
    temperature = (
        body.temperature if body.temperature is not None else defaults.get("temperature", 1.0)
    )
    params = BeamSearchParams(
        beam_width=body.n or 1,
        max_tokens=max_tokens,
        ignore_eos=bool(body.ignore_eos),
        temperature=temperature,
        length_penalty=body.length_penalty,
    )
    try:
        params.validate()
    except ValueError as error:  # its message starts with the field's name: the body's is param
        field = str(error).split(" ", 1)[0]
        param = BODY_FIELDS.get(field, field)
        raise OpenAIError(str(error), param=param) from error
    return params


async def search(
    llm: AsyncLLM,
    starts: list[list[int]],
    params: BeamSearchParams,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
) -> list[BeamSearchOutput]:
    """Each prompt's best beams, a round's one-token requests run side by side (each at
    `priority`, under `lora_request`'s adapter)."""
    try:
        beams = BeamSearch(starts, params, llm.engine)
    except ValueError as error:  # the width max_logprobs allows (n), or a prompt's length
        param = BODY_FIELDS.get(str(error).split(" ", 1)[0], "prompt")
        raise OpenAIError(str(error), param=param) from error
    round_params = replace(beams.round_params, output_kind=RequestOutputKind.FINAL_ONLY)
    call = uuid.uuid4().hex
    for index in range(params.max_tokens):
        tokens = beams.next_round()
        if not tokens:
            break
        answers = await asyncio.gather(
            *(
                last(
                    llm.generate(
                        {"prompt_token_ids": t},
                        round_params,
                        f"beam-{call}-{index}-{i}",
                        lora_request,
                        priority,
                    )
                )
                for i, t in enumerate(tokens)
            )
        )
        beams.advance([answer.outputs[0].logprobs[0] for answer in answers])
    return beams.best(llm.tokenizer)


async def last(stream):
    outputs = [output async for output in stream]
    return outputs[-1]


def response(
    body: CompletionRequest | ChatCompletionRequest,
    model: str,
    starts: list[list[int]],
    outputs: list[BeamSearchOutput],
    tokenizer: Any,
    response_role: str = "assistant",
) -> dict[str, Any]:
    """The OpenAI response: choice i * n + k is prompt i's k-th best beam."""
    chat = isinstance(body, ChatCompletionRequest)
    choices, generated = [], 0
    for prompt, output in zip(starts, outputs, strict=True):
        for beam in output.sequences:
            tokens = beam.tokens[len(prompt) :]
            generated += len(tokens)
            text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer else ""
            choice: dict[str, Any] = {"index": len(choices)}
            if chat:
                choice["message"] = {"role": body.answer_role(response_role), "content": text}
            else:
                choice |= {"text": text, "logprobs": None}
            choices.append(choice | {"finish_reason": beam.finish_reason, "stop_reason": None})
    prompt_tokens = sum(len(prompt) for prompt in starts)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        },
    }


def events(answer: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A streamed request's answer as vLLM streams beam search's: a completion's whole response
    as its one event; a chat's as chunks, each choice's role, then its text and finish reason,
    then the usage where asked for."""
    if answer["object"] == "text_completion":
        return [answer]
    head = {key: answer[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"

    def chunk(index: int, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return head | {"choices": [choice | ({"stop_reason": None} if finish else {})]}

    choices = answer["choices"]
    out = [chunk(c["index"], {"role": c["message"]["role"], "content": ""}, None) for c in choices]
    out += [
        chunk(c["index"], {"content": c["message"]["content"]}, c["finish_reason"]) for c in choices
    ]
    if include_usage:
        out.append(head | {"choices": [], "usage": answer["usage"]})
    return out
