"""Offline inference on Ray Data: one engine per actor, rows in, generations out.

`generate(ds, model, concurrency=N)` maps `LLMPredictor` over the dataset with a pool of N
actors, each holding one `AsyncLLM` on `tensor_parallel_size` GPUs. An actor takes several
batches at once (its `__call__` is async), so all of them share one engine's continuous batch
and a batch finishing leaves no gap.

Input columns: `prompt` (text) or `prompt_token_ids`, and optionally `sampling_params`, a dict
of SamplingParams fields per row (unset fields take `generate`'s `sampling_params`).
Output columns, beside the input ones: `generated_text`, `generated_token_ids`,
`finish_reason`, `num_prompt_tokens`, `logprobs` (per token {"token_ids", "logprobs"}, ranked,
when the row asked for logprobs) and `error`: None, or why the engine refused the row. A row
is never dropped: a refused row carries its error, and Ray restarts an actor that dies and
retries its batches (`max_restarts`, `max_task_retries`).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import ray
import ray.data

from tandem.async_llm import AsyncLLM
from tandem.sampling import SamplingParams

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
INT_FIELDS = {"n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs"}
OUTPUT_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "finish_reason",
    "num_prompt_tokens",
    "logprobs",
    "error",
)
BATCHES_PER_ACTOR = 4  # batches one engine works on at once


def generate(
    dataset: ray.data.Dataset,
    model: str,
    *,
    concurrency: int = 1,
    batch_size: int = 64,
    sampling_params: dict[str, Any] | None = None,
    **engine_args: Any,
) -> ray.data.Dataset:
    """The dataset with generation columns added, by `concurrency` engine replicas.

    Each engine works on BATCHES_PER_ACTOR batches at once: `batch_size` times that is the
    number of requests it can run together (keep it at or above `max_num_seqs`).
    """
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    return dataset.map_batches(
        LLMPredictor,
        fn_constructor_kwargs={"model": model, "sampling_params": sampling_params, **engine_args},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(
            size=concurrency,
            max_tasks_in_flight_per_actor=BATCHES_PER_ACTOR,
            max_concurrent_calls_per_actor=BATCHES_PER_ACTOR,
        ),
        **actor_resources(engine_args),
    )


def actor_resources(engine_args: dict[str, Any]) -> dict[str, float]:
    """What one engine replica reserves: its tensor-parallel GPUs, or one CPU without GPUs."""
    on_cpu = engine_args.get("device") == "cpu" or (
        engine_args.get("device") is None and not ray.cluster_resources().get("GPU")
    )
    if on_cpu:
        return {"num_cpus": 1, "num_gpus": 0}
    return {"num_cpus": 1, "num_gpus": engine_args.get("tensor_parallel_size", 1)}


@dataclass
class RowOutput:
    generated_text: str | None = None
    generated_token_ids: list[int] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int | None = None
    logprobs: list[dict[str, list]] | None = None
    error: str | None = None


class LLMPredictor:
    """A callable class for `Dataset.map_batches`: one engine per actor, a batch of rows at a call."""

    def __init__(self, model: str, sampling_params: dict[str, Any] | None = None, **engine_args):
        # the caller's own dict: a None in it is that field's value (max_tokens=None: to the
        # context's end), not a cell left unset
        self.defaults = check_sampling_fields(sampling_params or {}, cells=False)
        self.llm = AsyncLLM.from_model(model, **engine_args)

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        rows = rows_of(batch)
        outputs = await asyncio.gather(*(self._generate(row) for row in rows))
        columns = {name: [getattr(o, name) for o in outputs] for name in OUTPUT_COLUMNS}
        # the input columns as Python lists too: a numpy object column mixing arrays and None
        # (ids on one row, a text prompt on the next) is one Arrow cannot type, and writing
        # it out (write_json) failed in every retry
        given = {name: [row[name] for row in rows] for name in batch}
        return {**given, **columns}

    async def _generate(self, row: dict[str, Any]) -> RowOutput:
        try:
            params = self._params(row.get("sampling_params"))
            text, ids = row_prompt(row)
            stream = await self.llm.add_request(uuid.uuid4().hex, params, text, ids)
        except (ValueError, TypeError) as error:  # the row's fault: report it on the row
            return RowOutput(error=str(error))
        out = RowOutput(generated_text="", generated_token_ids=[])
        entries: list[dict[int, float]] = []
        try:
            async for delta in stream:
                out.generated_text += delta.text
                out.generated_token_ids += delta.token_ids
                entries += delta.logprobs or []
                out.finish_reason = delta.finish_reason
                out.num_prompt_tokens = delta.num_prompt_tokens
        finally:
            stream.abort()  # the batch was cancelled: free the request's blocks
        if params.logprobs is not None:
            out.logprobs = [{"token_ids": list(e), "logprobs": list(e.values())} for e in entries]
        return out

    def _params(self, given: Any) -> SamplingParams:
        row = check_sampling_fields({} if missing(given) else given)
        params = SamplingParams(**{**self.defaults, **row})
        if params.n != 1:
            raise ValueError(f"n must be 1 here (one row, one sample), got {params.n}")
        return params


def check_sampling_fields(params: Any, cells: bool = True) -> dict[str, Any]:
    """The fields set. With `cells` (a row's dict), an unset cell, which a row gets for another
    row's field, is left out, and so is a logit_bias entry that another row's bias gave it."""
    if not isinstance(params, dict):
        raise TypeError(f"sampling_params must be a dict, got {type(params).__name__}")
    if cells:
        params = {k: v for k, v in params.items() if not missing(v)}
    unknown = sorted(set(params) - SAMPLING_FIELDS)
    if unknown:
        raise ValueError(
            f"sampling_params: unknown field(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}"
        )
    checked = {k: as_int(plain(v)) if k in INT_FIELDS else plain(v) for k, v in params.items()}
    if isinstance(checked.get("logit_bias"), dict):
        checked["logit_bias"] = token_keys(checked["logit_bias"], cells)
    return checked


def token_keys(bias: dict[Any, Any], cells: bool) -> dict[Any, Any]:
    """A logit_bias with its token ids as ints: a JSON row's keys are text ("5"), as OpenAI's
    logit_bias gives them."""
    return {
        int(token) if isinstance(token, str) and token.isdigit() else token: value
        for token, value in bias.items()
        if not (cells and missing(value))
    }


def missing(value: Any) -> bool:
    """An unset cell: None, or the NaN that Arrow writes for it in a float column."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def as_int(value: Any) -> Any:
    """20.0 -> 20: rows whose dicts lack a field turn that field's ints into floats in Arrow."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def row_prompt(row: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """The row's (prompt text, prompt token ids); one of them is given."""
    text, ids = row.get("prompt"), row.get("prompt_token_ids")
    if ids is not None:
        return (text if isinstance(text, str) else None), plain(ids)
    if isinstance(text, str):
        return text, None
    raise ValueError("prompt: each row needs a 'prompt' string or 'prompt_token_ids'")


def rows_of(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    num_rows = len(next(iter(batch.values()))) if batch else 0
    return [{name: plain(column[i]) for name, column in batch.items()} for i in range(num_rows)]


def plain(value: Any) -> Any:
    """Numpy arrays and scalars (how Ray Data hands over list and number cells) as Python values."""
    if isinstance(value, np.ndarray):
        return value.tolist() if value.dtype != object else [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value
