"""OpenAI's embeddings endpoint, `POST /v1/embeddings`, over `AsyncLLM.encode` (pooling.py):
each input's last token's final hidden state, L2-normalized unless `normalize` is false
(vLLM's `use_activation`, or its older `normalize`), its first `dimensions` values kept first; as floats or, with
`encoding_format: "base64"`, as base64 of little-endian float32 bytes (OpenAI's form)."""

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


class EmbeddingRequest(RequestOption):
    model: str | None = None
    input: Text | list[Text] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # labels the request only
    use_activation: bool | None = None  # vLLM's: the L2 normalization (None: on)
    normalize: bool | None = None  # vLLM's older name for it
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


async def embeddings(serving: OpenAIServing, body: EmbeddingRequest) -> dict[str, Any]:
    """Every input embedded side by side in the step loop; one the engine rejects is a 400 and
    the others are aborted."""
    serving.check_model(body.model)
    prompts = body.prompts()
    limit = serving.options.max_sequences_per_request
    if len(prompts) > limit:
        message = f"this request has {len(prompts)} inputs; at most {limit} are allowed"
        raise OpenAIError(message, param="input")
    activation = body.use_activation if body.use_activation is not None else body.normalize
    pooling = PoolingParams(use_activation=activation, dimensions=body.dimensions)
    call_id = uuid.uuid4().hex

    async def one(i: int, prompt):
        outputs = serving.llm.encode(
            prompt, pooling, f"embd-{call_id}-{i}",
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )  # fmt: skip
        async for output in outputs:
            return output
        raise OpenAIError("the request was aborted before its embedding", 503, "server_error")

    tasks = [asyncio.create_task(one(i, prompt)) for i, prompt in enumerate(prompts)]
    try:
        results = await asyncio.gather(*tasks)
    except ValueError as error:
        raise OpenAIError(str(error), param="input") from error
    finally:
        for task in tasks:  # the others, when one failed: their streams abort as they end
            task.cancel()
    data = []
    for index, output in enumerate(results):
        vector = output.outputs.embedding
        if body.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        data.append({"index": index, "object": "embedding", "embedding": vector})
    num_tokens = sum(len(output.prompt_token_ids) for output in results)
    return {
        "id": f"embd-{call_id}",
        "object": "list",
        "created": int(time.time()),
        "model": serving.model_name,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
