"""`tandem run-batch --data-parallel-size N`: the batch's requests over N engines on Ray Data.

Each actor holds one `BatchAnswerer` (an engine behind the OpenAI app) and works on several
batches of requests at once, so they share one continuous batch. It yields its output lines in
groups as they finish, not when its batch ends, and the driver appends them to the results
file as they arrive.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import ray
import ray.data

from tandem.batch_file import BatchRequest
from tandem.ray.data import actor_resources
from tandem.run_batch import BatchAnswerer

BATCHES_PER_ACTOR = 8
YIELD_EVERY_S = 0.5  # how long finished lines may wait in an actor before going to the driver


class BatchFileWorker:
    """A callable class for `map_batches`: rows {custom_id, url, body (JSON)} -> {line (JSON)}."""

    def __init__(self, model: str, served_model_name: str | None, **engine_args: Any):
        self.answerer = BatchAnswerer(model, served_model_name, **engine_args)

    async def __call__(self, batch: dict[str, np.ndarray]) -> AsyncIterator[dict[str, list[str]]]:
        requests = [
            BatchRequest(str(custom_id), str(url), json.loads(body))
            for custom_id, url, body in zip(
                batch["custom_id"], batch["url"], batch["body"], strict=True
            )
        ]
        done: list[str] = []
        last_yield = time.monotonic()
        async for line in self.answerer.answer_all(requests):
            done.append(json.dumps(line))
            if time.monotonic() - last_yield >= YIELD_EVERY_S:
                yield {"line": done}
                done, last_yield = [], time.monotonic()
        if done:
            yield {"line": done}


def answer_on_ray(
    requests: list[BatchRequest],
    model: str,
    engine_args: dict[str, Any],
    data_parallel_size: int,
    served_model_name: str | None,
    write: Callable[[dict[str, Any]], None],
) -> None:
    """Answer `requests` on `data_parallel_size` engine actors, writing lines as they come back."""
    started = not ray.is_initialized()
    if started:
        ray.init()  # joins the cluster of RAY_ADDRESS, or of `ray start` on this machine
    ray.data.DataContext.get_current().enable_progress_bars = False  # run-batch shows its own
    rows = [{"custom_id": r.custom_id, "url": r.url, "body": json.dumps(r.body)} for r in requests]
    in_flight = 2 * (engine_args.get("max_num_seqs") or 256)  # requests per engine
    batch_size = max(1, math.ceil(in_flight / BATCHES_PER_ACTOR))
    num_blocks = max(1, math.ceil(len(rows) / batch_size))
    dataset = ray.data.from_items(rows, override_num_blocks=num_blocks).map_batches(
        BatchFileWorker,
        fn_constructor_kwargs={
            "model": model,
            "served_model_name": served_model_name,
            **engine_args,
        },
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(
            size=data_parallel_size,
            max_tasks_in_flight_per_actor=BATCHES_PER_ACTOR,
            max_concurrent_calls_per_actor=BATCHES_PER_ACTOR,
        ),
        **actor_resources(engine_args),
    )
    try:
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            for line in batch["line"]:
                write(json.loads(line))
    finally:
        if started:
            ray.shutdown()
