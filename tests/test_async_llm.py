"""AsyncLLM: the engine on its own thread, streamed deltas, aborts, failures and shutdown."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM, EngineDeadError, StreamOutput
from tandem.config import EngineConfig
from tandem.engine import Engine

ENGINE_ARGS = {"max_model_len": 256, "block_size": 8}
PROMPTS = ["Our scheduler reads", "The quick brown fox", "Paged attention", "Hello"]


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


def joined(outputs: list[StreamOutput]) -> tuple[str, list[int], str | None]:
    text = "".join(o.text for o in outputs)
    tokens = [t for o in outputs for t in o.token_ids]
    return text, tokens, outputs[-1].finish_reason


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
        assert outputs[-1].num_output_tokens == len(completion.token_ids)


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
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[s, "never seen"]) for s in stops]

    async def main():
        return await asyncio.gather(
            *(collect(llm, PROMPTS[0], p, f"stop-{i}") for i, p in enumerate(params))
        )

    streamed = asyncio.run(main())
    for stop, outputs in zip(stops, streamed, strict=True):
        assert joined(outputs)[0] == text[: text.find(stop)], stop
        assert outputs[-1].finish_reason == "stop"


def test_abort_ends_the_stream_with_abort_and_frees_every_block(llm):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        outputs = []
        async for out in llm.generate(PROMPTS[1], params, "to-abort"):
            outputs.append(out)
            if len(outputs) == 3:
                await llm.abort("to-abort")
        await wait_until_idle(llm)
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert outputs[-1].num_output_tokens < 200


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
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(
                collect(llm, PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), "twice"),
                collect(llm, PROMPTS[0], SamplingParams(), "twice"),
            )
        return await collect(llm, PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), "ok")

    assert asyncio.run(main())[-1].num_output_tokens == 4


@pytest.mark.parametrize("prompt", [[1, 2, 3], None, {"text": PROMPTS[0]}])
def test_a_prompt_of_no_known_form_is_a_value_error_naming_the_forms(llm, prompt):
    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids") as error:
            await collect(llm, prompt, SamplingParams(), "no-form")
        assert "'prompt'" in str(error.value)
        return await collect(llm, PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), "ok")

    assert asyncio.run(main())[-1].num_output_tokens == 4


def test_generate_takes_the_cache_salt_of_a_prompt_dict(llm):
    """Only a request of the same salt finds the blocks a salted prompt left in the cache."""
    ids = list(range(40, 60))  # 20 tokens: 2 full blocks of 8

    async def cached(salt: str | None, request_id: str) -> int:
        prompt = {"prompt_token_ids": ids, "cache_salt": salt}
        outputs = await collect(llm, prompt, SamplingParams(max_tokens=2), request_id)
        return outputs[0].num_cached_tokens

    async def main():
        return [await cached(salt, f"salted-{k}") for k, salt in enumerate(["a", "b", None, "a"])]

    assert asyncio.run(main()) == [0, 0, 0, 16]
    with pytest.raises(ValueError, match="cache_salt"):
        asyncio.run(cached("", "empty-salt"))


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


def test_generate_with_n_above_one_is_a_value_error_not_one_silent_sample(llm):
    async def main():
        with pytest.raises(ValueError, match="n=3"):
            await collect(llm, PROMPTS[0], SamplingParams(n=3), "three")

    asyncio.run(main())


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
    llm.shutdown()  # a dead engine shuts down without hanging


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
