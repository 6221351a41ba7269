"""The pooling endpoints over `AsyncLLM.encode` (pooling.py). OpenAI's `POST /v1/embeddings`:
each input's last token's final hidden state, L2-normalized unless vLLM's `use_activation`
(or its older `normalize`) is false, its first `dimensions` values kept first; as floats or,
with `encoding_format: "base64"`, as base64 of little-endian float32 bytes (OpenAI's form).
vLLM's `POST /classify` (a sequence classifier): each input's class probabilities and label;
its `POST /pooling`: either vector, as the request's `task` says.
vLLM's `POST /score` (`text_1` against `text_2`, 1:1, 1:N or N:N) and `POST /rerank` (a query's
documents, most relevant first, the best `top_n`; Jina's and Cohere's form): pair scores as
`LLM.score` makes them (scoring.py); `/v1/score`, `/v1/rerank` and `/v2/rerank` answer the same."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from tandem import scoring
from tandem.pooling import PoolingParams
from tandem.request import without_special_tokens
from tandem.sampling import truncate_prompt
from tandem.server.protocol import MAX_TOKEN_ID, OpenAIError, RequestOption, Text
from tandem.server.serving import OpenAIServing

TokenIds = list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]


class PoolingRequest(RequestOption):
    """What the pooling endpoints share: the inputs and vLLM's options."""

    model: str | None = None
    input: Text | list[Text] | TokenIds | list[TokenIds]
    user: str | None = None  # labels the request only
    use_activation: bool | None = None  # vLLM's: normalize / softmax (None: on)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # vLLM's; -1: all that fit
    # vLLM's: "left" keeps an input's last tokens, "right" its first; None: "right" (pooling's)
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True  # vLLM's: a text input gets the tokenizer's BOS (or others)
    priority: int = 0  # vLLM's (scheduling_policy "priority": lower first)
    request_id: Text | None = None  # vLLM's: the response's id, after its prefix

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


class PoolRequest(EmbeddingRequest):
    """vLLM's /pooling body: an embedding request whose `task` may be classify."""

    task: Literal["embed", "classify"] | None = None  # None: a classifier's classify, else embed


class ScoreRequest(RequestOption):
    """vLLM's ScoreRequest (its multimodal fields aside)."""

    model: str | None = None
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # as PoolingRequest's
    use_activation: bool | None = None  # a cross-encoder's sigmoid (None: on)
    priority: int = 0
    request_id: Text | None = None


class RerankRequest(RequestOption):
    """vLLM's RerankRequest (its multimodal fields aside)."""

    model: str | None = None
    query: Text
    documents: list[Text]
    top_n: Annotated[int, Field(ge=0)] = 0  # the best top_n results; 0: all
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # as PoolingRequest's
    use_activation: bool | None = None
    priority: int = 0
    request_id: Text | None = None


async def pooled(
    serving: OpenAIServing,
    body: PoolingRequest | ScoreRequest | RerankRequest,
    pooling: PoolingParams,
    kind: str,
    prompts: list | None = None,
    param: str = "input",
) -> tuple[str, list]:
    """Every input pooled side by side in the step loop: (the response's id, each input's
    output); one the engine rejects is a 400 and the others are aborted. The inputs: `prompts`,
    else the body's, each under the body's model's adapter and at its priority. The response's
    id is the body's request_id when it gives one; the engine's stay unique."""
    serving.check_model(body.model)
    own_tokens = prompts is None and not body.add_special_tokens
    prompts = body.prompts() if prompts is None else prompts
    limit = serving.options.max_sequences_per_request
    if len(prompts) > limit:
        message = f"this request has {len(prompts)} inputs; at most {limit} are allowed"
        raise OpenAIError(message, param=param)
    # tokenized off the event loop, as the generation routes tokenize
    if own_tokens:
        tokenizer = serving.tokenizer()
        prompts = await asyncio.to_thread(
            lambda: [without_special_tokens(p, tokenizer) for p in prompts]
        )
    if body.truncation_side is not None and body.truncate_prompt_tokens is not None:
        prompts = await asyncio.to_thread(cut_on_side, serving, body, prompts)
    call_id = f"{kind}-{uuid.uuid4().hex}"

    adapter = serving.adapter(body.model)

    async def one(i: int, prompt):
        outputs = serving.llm.encode(
            prompt, pooling, f"{call_id}-{i}", adapter,
            truncate_prompt_tokens=body.truncate_prompt_tokens, priority=body.priority,
        )  # fmt: skip
        async for output in outputs:
            return output
        raise OpenAIError("the request was aborted before its output", 503, "server_error")

    tasks = [asyncio.create_task(one(i, prompt)) for i, prompt in enumerate(prompts)]
    response_id = f"{kind}-{body.request_id}" if body.request_id else call_id
    try:
        return response_id, await asyncio.gather(*tasks)
    except ValueError as error:
        raise OpenAIError(str(error), param=param) from error
    finally:
        for task in tasks:  # the others, when one failed: their streams abort as they end
            task.cancel()


def cut_on_side(
    serving: OpenAIServing, body: PoolingRequest | ScoreRequest | RerankRequest, prompts: list
) -> list[dict[str, list[int]]]:
    """Each prompt's token ids (a text's all of them) cut here to the body's
    truncate_prompt_tokens on its truncation_side, as vLLM's; the engine's cut, to that many on
    pooling's side, then keeps them all."""
    keep, most, side = body.truncate_prompt_tokens, serving.llm.max_model_len, body.truncation_side
    cut = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = serving.tokenizer().encode(prompt)
        else:
            ids = prompt["prompt_token_ids"]
        cut.append({"prompt_token_ids": truncate_prompt(ids, keep, most, side)})
    return cut


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
    data = [
        {"index": i, "object": "embedding", "embedding": encoded(o.outputs.embedding, body)}
        for i, o in enumerate(outputs)
    ]
    return answer(serving, body, call_id, data, outputs)


def encoded(vector: list[float], body: EmbeddingRequest) -> list[float] | str:
    """The vector as floats or, with encoding_format "base64", as base64 of little-endian
    float32 bytes."""
    if body.encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def pool(serving: OpenAIServing, body: PoolRequest) -> dict[str, Any]:
    """vLLM's /pooling: each input's embedding or class probabilities, as `task` says."""
    classifier = serving.llm.engine.model_config.num_labels > 0
    task = body.task or ("classify" if classifier else "embed")
    activation = body.use_activation if body.use_activation is not None else body.normalize
    pooling = PoolingParams(use_activation=activation, dimensions=body.dimensions, task=task)
    call_id, outputs = await pooled(serving, body, pooling, "pool")
    data = [
        {"index": i, "object": "pooling", "data": encoded(pooled_vector(o), body)}
        for i, o in enumerate(outputs)
    ]
    return answer(serving, body, call_id, data, outputs)


def pooled_vector(output: Any) -> list[float]:
    """An `AsyncLLM.encode` output's vector: an embedding, or class probabilities."""
    return output.outputs.probs if hasattr(output.outputs, "probs") else output.outputs.embedding


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


async def scored(
    serving: OpenAIServing,
    body: ScoreRequest | RerankRequest,
    firsts: list[str],
    seconds: list[str],
) -> tuple[str, list[float], int]:
    """`LLM.score`'s pair scores over the step loop: (the call's id, each pair's score, the
    prompt tokens read)."""
    engine = serving.llm.engine
    param = "text_2" if isinstance(body, ScoreRequest) else "documents"
    try:
        cross_encoded = scoring.cross_encodes(engine.model_config.num_labels)
        if cross_encoded:
            tokenizer, separate = engine.tokenizer, engine.separates_pairs
            keep = body.truncate_prompt_tokens
            keep = engine.max_model_len if keep == -1 else keep
            if body.truncation_side is not None:  # the whole pair's ids, cut on it (pooled)
                keep = None
            prompts = scoring.pair_prompts(tokenizer, firsts, seconds, separate, keep)
        else:  # one adapter serves the whole call
            prompts = scoring.embedded_once(firsts, seconds, same_adapter=True)
    except ValueError as error:
        raise OpenAIError(str(error), param="model") from error
    task = "score" if cross_encoded else "embed"
    pooling = PoolingParams(use_activation=body.use_activation, task=task)
    call_id, outputs = await pooled(serving, body, pooling, "score", prompts, param=param)
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)  # each prompt once
    if not cross_encoded:
        outputs = scoring.spread(outputs, len(seconds))
    vectors = [
        output.outputs.probs if cross_encoded else output.outputs.embedding for output in outputs
    ]
    return call_id, scoring.scores(cross_encoded, vectors), num_tokens


async def score(serving: OpenAIServing, body: ScoreRequest) -> dict[str, Any]:
    """vLLM's /score: each pair's score, in pair order."""
    try:
        firsts, seconds = scoring.pairs(body.text_1, body.text_2)
    except ValueError as error:
        raise OpenAIError(str(error), param="text_2") from error
    call_id, scores, num_tokens = await scored(serving, body, firsts, seconds)
    return {
        "id": call_id,
        "object": "list",
        "created": int(time.time()),
        "model": serving.answered_name(body.model),
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


async def rerank(serving: OpenAIServing, body: RerankRequest) -> dict[str, Any]:
    """vLLM's /rerank: the documents by their score against the query, best first (ties in
    document order), the best `top_n` of them (0: all)."""
    if not body.documents:
        raise OpenAIError("documents must hold at least one text", param="documents")
    firsts, seconds = scoring.pairs(body.query, body.documents)
    call_id, scores, num_tokens = await scored(serving, body, firsts, seconds)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    results = [
        {"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]}
        for i in order[: body.top_n or None]
    ]
    return {
        "id": call_id,
        "model": serving.answered_name(body.model),
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},  # vLLM's RerankUsage
        "results": results,
    }
