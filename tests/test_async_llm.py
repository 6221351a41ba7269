"""AsyncLLM: the engine on its own thread, vLLM's RequestOutputs per output kind (n samples in one
stream), aborts, failures and shutdown."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from tandem import LLM, RequestOutput, SamplingParams, async_llm
from tandem.async_llm import AsyncLLM, EngineDeadError
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.outputs import FlatLogprobs
from tandem.sampling import RequestOutputKind
from test_bad_input import transformers_greedy

# a set cache size (the CPU default's 8,192 blocks), so that the module's engines fit side by side
# on a GPU too, where each would otherwise size its cache at 0.9 of the device
ENGINE_ARGS = {"max_model_len": 256, "block_size": 8, "kv_cache_memory_bytes": 32 << 20}
PROMPTS = ["Our scheduler reads", "The quick brown fox", "Paged attention", "Hello"]
KINDS = list(RequestOutputKind)
CUMULATIVE, DELTA, FINAL_ONLY = KINDS


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.fixture(scope="module")
def llm(folder) -> Iterator[AsyncLLM]:
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(folder) -> LLM:
    return LLM(folder, **ENGINE_ARGS)


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    outputs = [out async for out in llm.generate(prompt, params, request_id)]
    return outputs


def joined(outputs: list[RequestOutput]) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish reason) of a one-sample CUMULATIVE stream: its last output's."""
    completion = outputs[-1].outputs[0]
    return completion.text, completion.token_ids, completion.finish_reason


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def wait_until_idle(llm: AsyncLLM, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while llm.stats.num_running or llm.stats.num_free_blocks != llm.stats.num_blocks:
        assert time.monotonic() < deadline, f"engine still busy: {llm.stats}"
        await asyncio.sleep(0.01)


def test_concurrent_streams_match_the_offline_api_token_for_token(llm, offline):
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=8 + i % 7, ignore_eos=i % 2 == 0)
        for i in range(24)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]

    async def main():
        return await asyncio.gather(
            *(
                collect(llm, p, sp, f"concurrent-{i}")
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            )
        )

    streamed = asyncio.run(main())
    expected = offline.generate(prompts, params, use_tqdm=False)
    for outputs, want in zip(streamed, expected, strict=True):
        completion = want.outputs[0]
        assert joined(outputs) == (completion.text, completion.token_ids, completion.finish_reason)
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


def test_vllm_s_async_engine_import_and_engine_args_stream_the_offline_tokens(folder, offline):
    from tandem import AsyncEngineArgs, AsyncLLMEngine

    args = AsyncEngineArgs(model=folder, **ENGINE_ARGS)
    llm = AsyncLLMEngine.from_engine_args(args)
    assert isinstance(llm, AsyncLLM) and llm.engine.config is not args  # the caller's stays theirs
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outputs = asyncio.run(collect(llm, PROMPTS[0], params, "r"))
        [want] = offline.generate(PROMPTS[0], params, use_tqdm=False)
        assert joined(outputs)[1] == want.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_a_stream_without_detokenize_carries_the_offline_tokens_and_no_text(llm, offline):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
    outputs = asyncio.run(collect(llm, PROMPTS[0], params, "ids-only"))
    [expected] = offline.generate(PROMPTS[0], params, use_tqdm=False)
    assert joined(outputs) == ("", expected.outputs[0].token_ids, "length")


def test_streamed_text_never_includes_text_a_stop_string_later_trims(llm, offline):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = offline.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].text
    # stop strings of several lengths, each first seen at a different place in the text
    stops = [
        text[i : i + n]
        for n, i in itertools.product((2, 5, 9), (3, 11, 20))
        if text[i : i + n].strip() and text.find(text[i : i + n]) == i
    ]
    assert len(stops) >= 5
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=[s, "never seen"], output_kind=DELTA)
        for s in stops
    ]

    async def main():
        return await asyncio.gather(
            *(collect(llm, PROMPTS[0], p, f"stop-{i}") for i, p in enumerate(params))
        )

    streamed = asyncio.run(main())
    for stop, outputs in zip(stops, streamed, strict=True):
        assert "".join(o.outputs[0].text for o in outputs) == text[: text.find(stop)], stop
        assert outputs[-1].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("n", [1, 3])
def test_abort_ends_every_sample_of_the_stream_with_abort_and_frees_every_block(llm, n):
    """`abort(request_id)` of a stream of n samples stops each of them."""
    params = SamplingParams(n=n, temperature=1.0, seed=2, max_tokens=200, ignore_eos=True)

    async def main():
        outputs = []
        async for out in llm.generate(PROMPTS[1], params, f"to-abort-{n}"):
            outputs.append(out)
            if len(outputs) == 2:
                await llm.abort(f"to-abort-{n}")
        await wait_until_idle(llm)
        return outputs

    outputs = asyncio.run(main())
    whole = whole_samples(outputs, CUMULATIVE)
    assert outputs[-1].finished
    assert [whole[k].finish_reason for k in range(n)] == ["abort"] * n
    assert all(len(whole[k].token_ids) < 200 for k in range(n))


@pytest.mark.parametrize("yields", [1, 2, 3])  # 0: no generate has begun, no id is known
def test_an_abort_just_after_generate_starts_ends_every_sample(llm, yields):
    """Before its samples reach the engine (n > 1: ids of their own), as vLLM's: the abort
    is not lost, and a list of ids is taken too."""
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=200, ignore_eos=True)

    async def main():
        async def run(rid: str) -> list[RequestOutput]:
            return [out async for out in llm.generate(PROMPTS[1], params, rid)]

        tasks = [asyncio.create_task(run(f"early-{yields}-{i}")) for i in range(2)]
        for _ in range(yields):
            await asyncio.sleep(0)
        await llm.abort([f"early-{yields}-0", f"early-{yields}-1"])
        outputs = await asyncio.gather(*tasks)
        await wait_until_idle(llm)
        return outputs

    for outputs in asyncio.run(main()):
        whole = whole_samples(outputs, CUMULATIVE)
        assert [whole[k].finish_reason for k in range(2)] == ["abort", "abort"]


def test_a_logprobs_request_aborted_before_its_first_token_ends_with_abort(folder):
    """Waiting behind another (max_num_seqs=1), it has no token and no logprob yet: its stream
    ends with "abort" and an empty logprobs list, and the other request runs on."""
    llm = AsyncLLM.from_model(folder, **(ENGINE_ARGS | {"max_num_seqs": 1}))
    busy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    waiting = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)

    async def main():
        first = asyncio.create_task(collect(llm, PROMPTS[0], busy, "busy"))
        second = asyncio.create_task(collect(llm, PROMPTS[1], waiting, "waiting"))
        await until(lambda: llm.stats.num_running == 1 and llm.stats.num_waiting == 1)
        await llm.abort("waiting")
        return await asyncio.gather(first, second)

    try:
        busy_out, waiting_out = asyncio.run(main())
    finally:
        llm.shutdown()
    completion = waiting_out[-1].outputs[0]
    assert (completion.finish_reason, completion.token_ids, completion.logprobs) == (
        "abort",
        [],
        [],
    )
    assert joined(busy_out)[2] == "length" and len(joined(busy_out)[1]) == 40


def test_one_request_id_may_be_open_twice_and_abort_ends_both_as_vllms(llm, offline):
    """vLLM's engine ids carry a random tag: a request id open in generate (or left early and
    given again at once) runs again beside it, each with its own tokens; abort ends both."""
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        first = llm.generate(PROMPTS[1], params, "taken")
        await anext(first)
        second = llm.generate(PROMPTS[1], replace(params, n=2), "taken")
        await anext(second)
        await llm.abort("taken")
        ends = [[out async for out in first][-1], [out async for out in second][-1]]
        again = await collect(llm, PROMPTS[0], greedy, "taken")  # then the id runs anew
        await wait_until_idle(llm)
        return ends, again

    ends, again = asyncio.run(main())
    assert [o.finish_reason for end in ends for o in end.outputs] == ["abort"] * 3
    assert [end.request_id for end in ends] == ["taken", "taken"]
    [expected] = offline.generate(PROMPTS[0], greedy, use_tqdm=False)
    assert joined(again)[1] == expected.outputs[0].token_ids


def test_aborting_n_samples_ends_the_stream_in_one_output_holding_every_sample(llm):
    """As vLLM's: the samples' aborts go to the engine together and their outputs are posted
    together, so a CUMULATIVE stream's finished output holds all n aborted samples."""
    params = SamplingParams(n=3, max_tokens=200, ignore_eos=True, seed=1)

    submitted = []

    async def main():
        stream = llm.generate(PROMPTS[2], params, "three")
        await anext(stream)
        submit = llm._submit
        llm._submit = lambda command: (submitted.append(command), submit(command))[1]
        try:
            await llm.abort("three")
        finally:
            del llm._submit
        rest = [out async for out in stream]
        await wait_until_idle(llm)
        return rest

    finished = [out for out in asyncio.run(main()) if out.finished]
    assert len(finished) == 1
    assert [o.finish_reason for o in finished[0].outputs] == ["abort"] * 3
    # one command for the three (each sample's abort was a command, its output posted alone)
    assert [len(getattr(c, "request_ids", [None])) for c in submitted] == [3]


def test_vllms_generate_keywords_are_taken(llm, offline):
    """tokenization_kwargs (its truncate_prompt_tokens), trace_headers (no tracing), rank 0 of
    data_parallel_rank, prompt_text (the outputs' prompt for token ids); another rank is a
    ValueError."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = list(range(10, 30))
    keywords = {
        "tokenization_kwargs": {"truncate_prompt_tokens": 5},
        "trace_headers": {"traceparent": "00-x"},
        "data_parallel_rank": 0,
        "prompt_text": "the text",
    }

    async def main():
        outputs = [
            o async for o in llm.generate({"prompt_token_ids": ids}, greedy, "kw", **keywords)
        ]
        with pytest.raises(ValueError, match="data_parallel_rank=1"):
            await anext(llm.generate("Hi", greedy, "rank", data_parallel_rank=1))
        return outputs

    outputs = asyncio.run(main())
    [expected] = offline.generate({"prompt_token_ids": ids[-5:]}, greedy, use_tqdm=False)
    assert joined(outputs)[1] == expected.outputs[0].token_ids
    assert outputs[-1].prompt == "the text" and outputs[-1].prompt_token_ids == ids[-5:]


def test_the_samples_of_n_take_no_id_another_request_may_use(llm):
    """A request named "job-1" beside "job" with n=2, in either order: both run to the end,
    as in vLLM, whose samples have internal ids of their own."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main(first: str, second: str):
        return await asyncio.gather(
            collect(llm, PROMPTS[1], replace(params, n=2 if first == "job" else 1), first),
            collect(llm, PROMPTS[1], replace(params, n=2 if second == "job" else 1), second),
        )

    for order in (("job", "job-1"), ("job-1", "job")):
        outputs = dict(zip(order, asyncio.run(main(*order)), strict=True))
        assert [len(o.token_ids) for o in outputs["job"][-1].outputs] == [6, 6]
        assert [len(o.token_ids) for o in outputs["job-1"][-1].outputs] == [6]


def test_leaving_generate_early_aborts_the_request(llm):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def close_after_two_outputs():
        generator = llm.generate(PROMPTS[2], params, "closed-early")
        await anext(generator)
        await anext(generator)
        await generator.aclose()
        await wait_until_idle(llm)

    async def cancel_the_consumer():
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate(PROMPTS[2], params, "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(llm)

    asyncio.run(close_after_two_outputs())
    asyncio.run(cancel_the_consumer())


def test_an_invalid_request_raises_value_error_and_others_still_run(llm):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(llm, {"prompt_token_ids": [1] * 300}, SamplingParams(), "too-long")
        with pytest.raises(ValueError, match="temperature"):
            await collect(llm, PROMPTS[0], SamplingParams(temperature=-1.0), "negative")
        return await collect(llm, PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), "ok")

    assert len(joined(asyncio.run(main()))[1]) == 4


@pytest.mark.parametrize("prompt", [["a", "b"], None, {"text": PROMPTS[0]}])
def test_a_prompt_of_no_known_form_is_a_value_error_naming_the_forms(llm, prompt):
    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids") as error:
            await collect(llm, prompt, SamplingParams(), "no-form")
        assert "'prompt'" in str(error.value)
        return await collect(llm, PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), "ok")

    assert len(joined(asyncio.run(main()))[1]) == 4


BAD_ARGS = {  # (sampling_params, request_id, the message's start); before: AttributeErrors
    "params_dict": ({"max_tokens": 3}, "dict", "sampling_params must be a SamplingParams"),
    "params_none": (None, "none", "sampling_params must be a SamplingParams"),
    "id_int": (SamplingParams(max_tokens=3), 5, "request_id must be a string"),  # was taken
    "id_int_n2": (SamplingParams(max_tokens=3, n=2), 6, "request_id must be a string"),
}


@pytest.mark.parametrize(("params", "request_id", "message"), BAD_ARGS.values(), ids=BAD_ARGS)
def test_params_or_request_id_of_a_wrong_type_is_a_type_error_and_others_still_run(
    llm, params, request_id, message
):
    async def main():
        with pytest.raises(TypeError, match=message):
            await collect(llm, PROMPTS[0], params, request_id)
        with pytest.raises(TypeError, match=message):  # add_request too, before any grammar
            await llm.add_request(request_id, params, PROMPTS[0])
        return await collect(llm, PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), "ok")

    assert len(joined(asyncio.run(main()))[1]) == 4
    assert llm.engine.requests == {}


def test_generate_takes_the_cache_salt_of_a_prompt_dict(llm):
    """Only a request of the same salt finds the blocks a salted prompt left in the cache;
    each other writes them (vLLM's num_cache_creation_tokens)."""
    ids = list(range(40, 60))  # 20 tokens: 2 full blocks of 8

    async def cached(salt: str | None, request_id: str) -> tuple[int, int]:
        prompt = {"prompt_token_ids": ids, "cache_salt": salt}
        outputs = await collect(llm, prompt, SamplingParams(max_tokens=2), request_id)
        return outputs[0].num_cached_tokens, outputs[0].num_cache_creation_tokens

    async def main():
        return [await cached(salt, f"salted-{k}") for k, salt in enumerate(["a", "b", None, "a"])]

    assert asyncio.run(main()) == [(0, 16), (0, 16), (0, 16), (16, 0)]
    with pytest.raises(ValueError, match="cache_salt"):
        asyncio.run(cached("", "empty-salt"))


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=10, logprobs=2, prompt_logprobs=1)


def whole_samples(outputs: list[RequestOutput], kind: RequestOutputKind) -> dict:
    """Each sample's whole completion: the last of its index, or (DELTA) its deltas joined."""
    whole = {}
    for output in outputs:
        for c in output.outputs:
            if kind is DELTA and c.index in whole:
                w = whole[c.index]
                w.text, w.token_ids = w.text + c.text, w.token_ids + c.token_ids
                w.logprobs = None if c.logprobs is None else w.logprobs + c.logprobs
                w.cumulative_logprob = c.cumulative_logprob
                w.finish_reason, w.stop_reason = c.finish_reason, c.stop_reason
            else:
                whole[c.index] = replace(c)
    return whole


def described(entries) -> list | None:
    """Logprob entries as plain values, so that rank and decoded_token are compared too."""
    if entries is None:
        return None
    return [
        None if e is None else [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()]
        for e in entries
    ]


def samples(outputs: list[RequestOutput], kind: RequestOutputKind) -> list[tuple]:
    whole = whole_samples(outputs, kind)
    return [whole_sample(whole[k]) for k in sorted(whole)]


def whole_sample(c) -> tuple:
    return (c.index, c.text, c.token_ids, c.cumulative_logprob, described(c.logprobs),
            c.finish_reason, c.stop_reason)  # fmt: skip


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize(
    "base",
    [GREEDY, SEEDED, replace(SEEDED, flat_logprobs=True)],
    ids=["greedy", "seeded", "seeded-flat"],
)
def test_every_output_kind_adds_up_to_the_offline_output(llm, offline, kind, base):
    """CUMULATIVE: every output is all so far; DELTA: the outputs join into it; FINAL_ONLY: one
    output. Logprobs with ranks and decoded tokens, and prompt logprobs, as the offline API's."""
    params = replace(base, output_kind=kind)
    request_id = f"kind-{kind.name}-{base.temperature}-{base.flat_logprobs}"
    outputs = asyncio.run(collect(llm, PROMPTS[1], params, request_id))
    [expected] = offline.generate(PROMPTS[1], params, use_tqdm=False)
    assert samples(outputs, kind) == [whole_sample(expected.outputs[0])]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    for output in outputs:
        assert (output.request_id, output.prompt) == (request_id, PROMPTS[1])
        assert output.prompt_token_ids == expected.prompt_token_ids
    assert described(outputs[0].prompt_logprobs) == described(expected.prompt_logprobs)
    form = FlatLogprobs if base.flat_logprobs else list
    assert all(isinstance(c.logprobs, form) for o in outputs for c in o.outputs)
    assert isinstance(outputs[0].prompt_logprobs, form) or base.prompt_logprobs is None
    if kind is FINAL_ONLY:
        assert len(outputs) == 1
    elif kind is DELTA:
        assert all(o.prompt_logprobs is None for o in outputs[1:])  # sent once, as vLLM's
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(
            expected.outputs[0].token_ids
        )
    else:
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert all(b[: len(a)] == a and len(b) > len(a) for a, b in itertools.pairwise(tokens))
        assert 1 < len(outputs) <= params.max_tokens


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_sends_the_first_token_then_every_nth_then_the_rest(
    folder, offline, interval, monkeypatch
):
    """vLLM's stream_interval: the engine thread sends a delta of the first token, then of
    `interval` tokens or more each, then what is left at the end; joined, the offline output.
    The sizes are those sent: a consumer that falls behind gets what came meanwhile as one
    output (as vLLM's), whatever the interval."""
    sent, deliver = [], async_llm._deliver

    def counted(items):
        sent.extend(len(o.token_ids) for _, o in items if not isinstance(o, BaseException))
        deliver(items)

    monkeypatch.setattr(async_llm, "_deliver", counted)
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS, stream_interval=interval)
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=DELTA)
        outputs = asyncio.run(collect(llm, PROMPTS[2], params, "interval"))
    finally:
        llm.shutdown()
    sizes = sent
    assert sizes[0] == 1 and sum(sizes) == 10  # the first token at once
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 10
    assert all(size >= interval for size in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + -(-9 // interval), sizes  # a step's token joins those held
    [want] = offline.generate(PROMPTS[2], replace(params, output_kind=CUMULATIVE), use_tqdm=False)
    assert [t for o in outputs for t in o.outputs[0].token_ids] == want.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in outputs) == want.outputs[0].text


def test_a_cumulative_greedy_stream_ends_with_transformers_greedy_tokens(llm, folder):
    outputs = asyncio.run(collect(llm, PROMPTS[0], GREEDY, "greedy-vs-transformers"))
    prompt_ids = tuple(outputs[-1].prompt_token_ids)
    assert joined(outputs)[1] == transformers_greedy(folder, prompt_ids, GREEDY.max_tokens)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_n_samples_share_one_stream_with_indexes_0_to_n_and_the_offline_samples(llm, offline, kind):
    """As vLLM aggregates a request's n samples: each output carries the samples that changed
    since the last one, in index order; a finished sample is not sent again; FINAL_ONLY sends
    all n once, at the end."""
    params = replace(SEEDED, n=3, output_kind=kind)
    outputs = asyncio.run(collect(llm, PROMPTS[2], params, f"n3-{kind.name}"))
    [expected] = offline.generate(PROMPTS[2], params, use_tqdm=False)
    assert samples(outputs, kind) == [whole_sample(c) for c in expected.outputs]
    assert len({tuple(c.token_ids) for c in expected.outputs}) == 3  # seed + k for sample k
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    finished = set()
    for output in outputs:
        indexes = [c.index for c in output.outputs]
        assert indexes == sorted(set(indexes)) and set(indexes) <= {0, 1, 2} - finished
        finished |= {c.index for c in output.outputs if c.finish_reason is not None}
    assert finished == {0, 1, 2}
    if kind is FINAL_ONLY:
        assert len(outputs) == 1 and [c.index for c in outputs[0].outputs] == [0, 1, 2]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA], ids=lambda k: k.name)
def test_a_consumer_that_falls_behind_gets_what_it_missed_in_one_output(llm, offline, kind):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=kind)

    async def main():
        generator = llm.generate(PROMPTS[0], params, f"behind-{kind.name}")
        first = await anext(generator)
        await wait_until_idle(llm)
        await asyncio.sleep(0)  # the last step's outputs, posted before the stats, are delivered
        return [first] + [out async for out in generator]

    outputs = asyncio.run(main())
    [expected] = offline.generate(PROMPTS[0], params, use_tqdm=False)
    assert len(outputs) == 2 and outputs[1].finished
    assert samples(outputs, kind) == [whole_sample(expected.outputs[0])]


def test_cancelling_a_stream_of_n_samples_aborts_each_and_frees_its_blocks(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=200, ignore_eos=True)

    async def main():
        await wait_until_idle(llm)
        free, aborted = llm.stats.num_free_blocks, llm.stats.num_finished.get("abort", 0)
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate(PROMPTS[3], params, "n-cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        await until(lambda: llm.stats.num_running == 4)
        assert llm.stats.num_free_blocks < free
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(llm)
        return free, aborted

    free, aborted = asyncio.run(main())
    assert llm.stats.num_free_blocks == free
    assert llm.stats.num_finished["abort"] == aborted + 4


@pytest.mark.parametrize("kind", ["DELTA", 1, None])
def test_an_output_kind_other_than_a_request_output_kind_is_a_value_error(llm, kind):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=kind)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    params.output_kind = kind

    async def main():
        with pytest.raises(ValueError, match="output_kind"):
            await collect(llm, PROMPTS[0], params, "bad-kind")
        return await collect(llm, PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), "ok")

    assert len(joined(asyncio.run(main()))[1]) == 4


def test_the_offline_generate_returns_whole_outputs_whatever_the_output_kind(offline):
    """As vLLM's LLM.generate, which only ever asks for the final output."""
    outputs = [
        offline.generate(PROMPTS[2], replace(SEEDED, output_kind=kind), use_tqdm=False)[0].outputs
        for kind in KINDS
    ]
    assert outputs[0] == outputs[1] == outputs[2]
    assert [o.finish_reason for o in outputs[2]] == ["length"]


async def drain(stream) -> list:
    return [output async for output in stream]


def test_an_id_whose_stream_is_still_open_is_in_use_even_once_its_request_finished(llm):
    """A request finished as it was queued (scoring a one-token prompt) leaves the engine before
    its stream ends: a second request under its id is refused, and the first stream ends."""

    async def main():
        scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
        first = asyncio.ensure_future(llm.add_request("dup", scoring, prompt_token_ids=[5]))
        second = asyncio.ensure_future(
            llm.add_request("dup", SamplingParams(max_tokens=3), prompt_token_ids=[5, 6])
        )
        stream = await first
        with pytest.raises(ValueError, match="already in use"):
            await second
        return await asyncio.wait_for(drain(stream), 30)

    [output] = asyncio.run(main())
    assert output.finished and output.finish_reason == "length"


def test_the_idle_engine_thread_waits_on_its_queue(folder):
    engine = Engine(EngineConfig(model=folder, **ENGINE_ARGS))
    calls = itertools.count()
    has_unfinished = engine.has_unfinished
    engine.has_unfinished = lambda: next(calls) >= 0 and has_unfinished()
    llm = AsyncLLM(engine)
    try:
        asyncio.run(collect(llm, PROMPTS[0], SamplingParams(max_tokens=4), "before-idle"))
        time.sleep(0.05)
        before = next(calls)
        time.sleep(0.2)
        assert next(calls) - before <= 2
    finally:
        llm.shutdown()


def test_an_engine_failure_reaches_every_pending_request(folder):
    engine = Engine(EngineConfig(model=folder, **ENGINE_ARGS))
    steps = itertools.count()
    step = engine.step

    def failing_step():
        if next(steps) == 5:
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_step
    llm = AsyncLLM(engine)
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def main():
        results = await asyncio.gather(
            *(collect(llm, PROMPTS[i % 4], params, f"doomed-{i}") for i in range(8)),
            return_exceptions=True,
        )
        with pytest.raises(EngineDeadError):
            await collect(llm, PROMPTS[0], params, "after-death")
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert isinstance(results[0].__cause__, RuntimeError)
    assert not llm.is_running
    # vLLM's health surface: errored, is_stopped, dead_error, check_health
    assert llm.errored and llm.is_stopped and llm.dead_error is results[0]
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.check_health())
    llm.shutdown()  # a dead engine shuts down without hanging


def test_a_running_engine_is_healthy(llm):
    assert not llm.errored and not llm.is_stopped
    assert asyncio.run(llm.check_health()) is None


def test_get_tokenizer_is_called_as_vllm_0_26s(llm, folder):
    from transformers import AutoTokenizer

    tokenizer = llm.get_tokenizer()
    assert (
        tokenizer.encode("Hello there")
        == AutoTokenizer.from_pretrained(folder)("Hello there").input_ids
    )


def test_shutdown_fails_open_streams_and_refuses_new_requests(folder):
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        generator = llm.generate(PROMPTS[0], params, "open")
        await anext(generator)
        llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in generator:
                pass
        with pytest.raises(EngineDeadError):
            await collect(llm, PROMPTS[0], params, "late")

    asyncio.run(main())
    assert not llm._thread.is_alive()


def test_a_new_grammar_compiles_off_the_engine_thread(llm, monkeypatch):
    """The engine thread only meets grammars the backend has compiled already (a cache hit),
    so a new schema never stalls the steps; a rejected one is a ValueError before queueing."""
    pytest.importorskip("xgrammar")
    import threading

    from tandem.structured import GrammarBackend, StructuredOutputsParams

    threads = []
    compile_ = GrammarBackend.compile

    def recorded(self, params):
        threads.append(threading.current_thread().name)
        return compile_(self, params)

    monkeypatch.setattr(GrammarBackend, "compile", recorded)
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(max_tokens=30, structured_outputs=constraint)
    outputs = asyncio.run(collect(llm, PROMPTS[0], params, "constrained"))
    assert joined(outputs)[0] in ('{"k": "a"}', '{"k": "b"}')
    assert threads[0] != "tandem-engine" and threads[1:] == ["tandem-engine"]
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(x"))
    with pytest.raises(ValueError, match="xgrammar rejected the regex"):
        asyncio.run(collect(llm, PROMPTS[0], bad, "rejected"))
    assert "tandem-engine" not in threads[2:]


def test_vllms_engine_client_arguments_are_taken(folder):
    """from_engine_args' start_engine_loop, usage_context and stat_loggers (None), abort's
    internal (an engine id), shutdown's timeout; a loop not started is a ValueError."""
    from tandem import AsyncEngineArgs

    args = AsyncEngineArgs(model=folder, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="start_engine_loop"):
        AsyncLLM.from_engine_args(args, start_engine_loop="no")
    llm = AsyncLLM.from_engine_args(args, False, "ENGINE_CONTEXT", None)  # vLLM reads it no more
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        stream = llm.generate(PROMPTS[0], params, "x")
        await anext(stream)
        [engine_ids] = llm._samples["x"].values()
        await llm.abort(engine_ids, internal=True)
        return [out async for out in stream][-1]

    try:
        assert asyncio.run(main()).outputs[0].finish_reason == "abort"
    finally:
        llm.shutdown(timeout=30)
    assert llm.errored


def test_dropping_the_last_reference_stops_the_engine_and_frees_it(folder):
    """`del engine` (vLLM's AsyncLLM shuts down when collected): the engine thread ends and the
    engine gives its memory back, with no gc.collect() and no shutdown() called."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert len(asyncio.run(collect(llm, PROMPTS[0], params, "a"))[-1].outputs[0].token_ids) == 3
    engine, thread = llm.engine, llm._thread
    del llm
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert engine.closed


def test_vllms_engine_client_attributes_and_awaitables(folder):
    """`engine.model_config` (max_model_len, model, dtype, hf_config), `engine.tokenizer`,
    `await engine.get_supported_tasks()`, `await engine.reset_encoder_cache()` and `await
    engine.wait_for_requests_to_drain()`, as vLLM's."""
    from transformers import AutoConfig

    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS, dtype="float32")
    try:
        config = llm.model_config
        assert (config.model, config.max_model_len, config.dtype) == (folder, 256, torch.float32)
        layers = AutoConfig.from_pretrained(folder).num_hidden_layers
        assert config.hf_config.num_hidden_layers == layers

        assert llm.tokenizer is llm.get_tokenizer() is not None
        params = SamplingParams(max_tokens=20, ignore_eos=True)

        async def main():
            await llm.reset_encoder_cache()
            await llm.wait_for_requests_to_drain()  # none: at once
            running = asyncio.ensure_future(collect(llm, PROMPTS[0], params, "draining"))
            await until(lambda: llm.stats.num_running == 1)
            await llm.pause_generation(mode="keep")
            with pytest.raises(TimeoutError, match=r"0\.2 seconds"):
                await llm.wait_for_requests_to_drain(0.2)  # paused: the request waits
            await llm.resume_generation()
            await llm.wait_for_requests_to_drain(30)
            assert running.done() and len(running.result()[-1].outputs[0].token_ids) == 20
            return await llm.get_supported_tasks()

        assert asyncio.run(main()) == ("generate", "embed")
    finally:
        llm.shutdown()


def test_enable_log_requests_logs_each_request_added_and_aborted_as_vllm_s(folder, caplog):
    """vLLM's AsyncEngineArgs(enable_log_requests=...): INFO lines naming the request."""
    from tandem import AsyncEngineArgs

    quiet, llm = (
        AsyncLLM.from_engine_args(
            AsyncEngineArgs(model=folder, enable_log_requests=logs, **ENGINE_ARGS)
        )
        for logs in (False, True)
    )
    params = SamplingParams(max_tokens=2)

    async def main(engine: AsyncLLM, request_id: str) -> None:
        [_ async for _ in engine.generate(PROMPTS[0], params, request_id)]
        await engine.abort("gone")

    try:
        with caplog.at_level(logging.INFO, logger="tandem.async_llm"):
            asyncio.run(main(quiet, "q"))
            assert not [r for r in caplog.records if r.name == "tandem.async_llm"]
            asyncio.run(main(llm, "r"))
        lines = [r.getMessage() for r in caplog.records if r.name == "tandem.async_llm"]
        assert lines[0].startswith("Added request r-") and lines[-1] == "Aborted request(s) gone."
        with pytest.raises(ValueError, match="enable_log_requests must be True or False"):
            AsyncEngineArgs(model=folder, enable_log_requests="yes").validate()
    finally:
        quiet.shutdown()
        llm.shutdown()


def test_each_output_carries_the_request_s_timings_as_vllm_s_metrics(llm, folder):
    """vLLM's RequestOutput.metrics (RequestStateStats) of an AsyncLLM request: arrival on the
    wall clock, then queued <= first admitted <= first token <= last token on the engine's,
    the tokens of every sample counted; offline outputs carry none, as vLLM's."""
    params = SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=1)
    wall, start = time.time(), time.perf_counter()
    outputs = asyncio.run(collect(llm, PROMPTS[1], params, "timed"))
    end = time.perf_counter()
    stats = outputs[-1].metrics
    assert all(out.metrics is stats for out in outputs)  # one object, as vLLM's
    assert wall <= stats.arrival_time <= time.time()
    assert start <= stats.queued_ts <= stats.scheduled_ts <= stats.first_token_ts
    assert stats.first_token_ts <= stats.last_token_ts <= end
    assert stats.first_token_latency == stats.first_token_ts - stats.queued_ts > 0
    assert stats.num_generation_tokens == 8 and stats.is_corrupted is False
    [offline] = LLM(folder, **ENGINE_ARGS).generate(PROMPTS[1], params, use_tqdm=False)
    assert offline.metrics is None
