"""collective_rpc and apply_model (vLLM's): a call on every tensor-parallel rank's engine, one
rank and two (gloo), offline and async; failures, timeouts and bad calls."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from tandem import LLM
from tandem.async_llm import AsyncLLM
from test_weight_update import ENGINE_ARGS, tokens_and_logprobs


def rank_and_shapes(engine) -> tuple[int, dict[str, tuple[int, ...]]]:
    return engine.tp.rank, {name: tuple(p.shape) for name, p in engine.model.named_parameters()}


def fail_on_rank_1(engine) -> int:
    if engine.tp.rank == 1:
        raise ValueError("rank one says no")
    return engine.tp.rank


def slow_on_rank_1(engine, seconds: float) -> int:
    if engine.tp.rank == 1:
        time.sleep(seconds)
    return engine.tp.rank


def hidden_size(model: torch.nn.Module) -> int:
    return model.embed_tokens.weight.shape[1]


def test_one_rank_runs_a_lambda_a_method_and_apply_model(checkpoints):
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    config = json.loads((Path(a) / "config.json").read_text())
    assert llm.apply_model(lambda model: model.embed_tokens.weight.shape[1]) == [
        config["hidden_size"]
    ]
    assert llm.collective_rpc(lambda engine, x, y=0: (engine.tp.rank, x + y), args=(2,), kwargs={"y": 3}) == [
        (0, 5)
    ]  # fmt: skip
    assert llm.collective_rpc("update_weights_from_path", args=(b,)) == [None]
    assert tokens_and_logprobs(llm)[0][0] == tokens_and_logprobs(LLM(b, **ENGINE_ARGS))[0][0]


def test_two_ranks_each_answer_with_their_own_shards(checkpoints):
    """Every rank's result, rank 0's first; each holds its slices (some dimension halved)."""
    a, b = checkpoints
    whole = rank_and_shapes(LLM(a, **ENGINE_ARGS).engine)[1]
    llm = LLM(a, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        results = llm.collective_rpc(rank_and_shapes)
        sizes = llm.apply_model(hidden_size)
        with pytest.raises(RuntimeError, match=r"rank 1:(.|\n)*rank one says no"):
            llm.collective_rpc(fail_on_rank_1)
        with pytest.raises(TimeoutError, match="rank 1"):
            llm.collective_rpc(slow_on_rank_1, timeout=0.3, args=(2.0,))
        after_timeout = llm.collective_rpc(slow_on_rank_1, args=(0.0,))  # the late answer dropped
        # each rank loads its own slices (rank 0 does not drive the others a second time)
        llm.collective_rpc("update_weights_from_path", args=(b,))
        updated = tokens_and_logprobs(llm)
    finally:
        llm.shutdown()
    assert sizes == [hidden_size(LLM(a, **ENGINE_ARGS).engine.model)] * 2
    assert after_timeout == [0, 1]
    assert [rank for rank, _ in results] == [0, 1]
    assert results[0][1] == results[1][1]
    halved = 0
    for name, shape in results[0][1].items():
        diff = [i for i, (x, y) in enumerate(zip(shape, whole[name], strict=True)) if x != y]
        assert len(diff) <= 1 and all(2 * shape[i] == whole[name][i] for i in diff), name
        halved += len(diff)
    assert halved > 0
    assert [t for t, _ in updated] == [t for t, _ in tokens_and_logprobs(LLM(b, **ENGINE_ARGS))]


@pytest.mark.parametrize(
    ("method", "error", "match"),
    [
        ("no_such_method", ValueError, "no public method"),
        ("_process", ValueError, "no public method"),
        ("num_blocks", ValueError, "no public method"),  # an attribute, not a method
        (42, TypeError, "a callable"),
    ],
)
def test_bad_calls_are_typed_errors(checkpoints, method, error, match):
    llm = LLM(checkpoints[0], **ENGINE_ARGS)
    with pytest.raises(error, match=match):
        llm.collective_rpc(method)
    assert llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False)[0].outputs[0].token_ids


def test_a_call_that_does_not_pickle_cannot_reach_other_ranks(checkpoints):
    llm = LLM(checkpoints[0], tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        with pytest.raises(TypeError, match="must pickle"):
            llm.apply_model(lambda model: 1)
        sizes = llm.apply_model(hidden_size)  # the next call still reaches both ranks
    finally:
        llm.shutdown()
    assert len(sizes) == 2 and sizes[0] == sizes[1]


def test_async_llm_runs_the_call_between_steps_of_a_running_request(checkpoints):
    from tandem import SamplingParams

    async def scenario() -> tuple[list, list, int, object]:
        llm = AsyncLLM.from_model(checkpoints[0], **ENGINE_ARGS)
        try:
            params = SamplingParams(max_tokens=40, ignore_eos=True)
            stream = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, "r")
            first = await anext(stream)  # the request is running
            blocks = await llm.collective_rpc(lambda engine: engine.num_blocks)
            steps = await llm.collective_rpc(lambda engine: engine.num_steps)
            rest = [output async for output in stream]
            return blocks, steps, len(first.outputs[0].token_ids), rest[-1]
        finally:
            llm.shutdown()

    blocks, steps, num_first, last = asyncio.run(scenario())
    assert blocks == [LLM(checkpoints[0], **ENGINE_ARGS).engine.num_blocks]
    assert num_first <= steps[0] < 40 + 1  # mid-generation, between two steps
    assert len(last.outputs[0].token_ids) == 40  # and the request went on to its end
