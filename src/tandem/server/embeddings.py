"""The pooling endpoints over `AsyncLLM.encode` (pooling.py). OpenAI's `POST /v1/embeddings`:
each input's last token's final hidden state, L2-normalized unless vLLM's `use_activation`
(or its older `normalize`) is false, its first `dimensions` values kept first; as floats or,
with `encoding_format: "base64"`, as base64 of little-endian float32 bytes (OpenAI's form).
vLLM's `POST /classify` (a sequence classifier): each input's class probabilities and label."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from tandem.pooling import PoolingParams
from tandem.server.protocol import MAX_TOKEN_ID, OpenAIError, RequestOption, Text
from tandem.server.serving import OpenAIServing

TokenIds = list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]


class PoolingRequest(RequestOption):
    """What the pooling endpoints share: the inputs and vLLM's options."""

    model: str | None = None
    input: Text | list[Text] | TokenIds | list[TokenIds]
    user: str | None = None  # labels the request only
    use_activation: bool | None = None  # vLLM's: normalize / softmax (None: on)
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None  # vLLM's

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """The inputs as prompts: one text, texts, one list of token ids, or lists of them."""
        inputs = self.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs or any(len(item) == 0 for item in inputs):
            raise OpenAIError(
                "input must hold at least one non-empty text or token list", param="input"
            )
        return [item if isinstance(item, str) else {"prompt_token_ids": item} for item in inputs]


class EmbeddingRequest(PoolingRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    normalize: bool | None = None  # vLLM's older name for use_activation


class ClassificationRequest(PoolingRequest):
    pass


async def pooled(
    serving: OpenAIServing, body: PoolingRequest, pooling: PoolingParams, kind: str
) -> tuple[str, list]:
    """Every input pooled side by side in the step loop: (the call's id, each input's output);
    one the engine rejects is a 400 and the others are aborted."""
    serving.check_model(body.model)
    prompts = body.prompts()
    limit = serving.options.max_sequences_per_request
    if len(prompts) > limit:
        message = f"this request has {len(prompts)} inputs; at most {limit} are allowed"
        raise OpenAIError(message, param="input")
    call_id = f"{kind}-{uuid.uuid4().hex}"

    async def one(i: int, prompt):
        outputs = serving.llm.encode(
            prompt, pooling, f"{call_id}-{i}", serving.adapter(body.model),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )  # fmt: skip
        async for output in outputs:
            return output
        raise OpenAIError("the request was aborted before its output", 503, "server_error")

    tasks = [asyncio.create_task(one(i, prompt)) for i, prompt in enumerate(prompts)]
    try:
        return call_id, await asyncio.gather(*tasks)
    except ValueError as error:
        raise OpenAIError(str(error), param="input") from error
    finally:
        for task in tasks:  # the others, when one failed: their streams abort as they end
            task.cancel()


def answer(
    serving: OpenAIServing, body: PoolingRequest, call_id: str, data: list[dict], outputs: list
) -> dict:
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "id": call_id,
        "object": "list",
        "created": int(time.time()),
        "model": serving.answered_name(body.model),
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


async def embeddings(serving: OpenAIServing, body: EmbeddingRequest) -> dict[str, Any]:
    activation = body.use_activation if body.use_activation is not None else body.normalize
    pooling = PoolingParams(use_activation=activation, dimensions=body.dimensions)
    call_id, outputs = await pooled(serving, body, pooling, "embd")
    data = []
    for index, output in enumerate(outputs):
        vector = output.outputs.embedding
        if body.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        data.append({"index": index, "object": "embedding", "embedding": vector})
    return answer(serving, body, call_id, data, outputs)


async def classify(serving: OpenAIServing, body: ClassificationRequest) -> dict[str, Any]:
    """vLLM's /classify: each input's class probabilities and its most likely label."""
    pooling = PoolingParams(use_activation=body.use_activation, task="classify")
    call_id, outputs = await pooled(serving, body, pooling, "classify")
    labels = serving.llm.engine.class_labels
    data = [
        {
            "index": index,
            "label": labels[int(np.argmax(output.outputs.probs))],
            "probs": output.outputs.probs,
            "num_classes": output.outputs.num_classes,
        }
        for index, output in enumerate(outputs)
    ]
    return answer(serving, body, call_id, data, outputs)
