"""Pause/resume and sleep/wake-up: requests survive them, tokens are neither lost nor repeated."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from fastapi.testclient import TestClient

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.engine import Engine
from tandem.sampling import RequestOutputKind
from tandem.server.app import build_app

ENGINE_ARGS = {"max_model_len": 128, "block_size": 8, "dtype": "float32"}
PROMPTS = [{"prompt_token_ids": [3 + i, 17, 30 + 2 * i, 9, 11, 12, 40 + i]} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.fixture(scope="module")
def reference(folder) -> list[list[int]]:
    """Each prompt's greedy tokens from an engine that was never paused."""
    outputs = LLM(folder, **ENGINE_ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


async def stream_tokens(llm: AsyncLLM, index: int, got: list[list[int]], reasons: list) -> None:
    params = replace(GREEDY, output_kind=RequestOutputKind.DELTA)
    async for out in llm.generate(PROMPTS[index], params, f"r{index}"):
        got[index] += out.outputs[0].token_ids
        if out.finished:
            reasons[index] = out.outputs[0].finish_reason


def test_async_pause_keep_loses_no_request_and_repeats_no_token(folder, reference):
    async def main() -> list[list[int]]:
        llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
        got, reasons = [[] for _ in PROMPTS], [None] * len(PROMPTS)
        try:
            tasks = [asyncio.create_task(stream_tokens(llm, i, got, reasons)) for i in range(4)]
            while len(got[0]) < 5:
                await asyncio.sleep(0.001)
            await llm.pause_generation("keep")
            assert await llm.is_paused()
            held = [list(tokens) for tokens in got]
            steps = llm.engine.num_steps
            await asyncio.sleep(0.3)
            assert llm.engine.num_steps == steps and got == held  # nothing ran while paused
            assert all(len(tokens) < GREEDY.max_tokens for tokens in got)
            await llm.resume_generation()
            await asyncio.gather(*tasks)
        finally:
            llm.shutdown()
        assert reasons == ["length"] * 4
        return got

    assert asyncio.run(main()) == reference


def test_async_pause_abort_ends_every_stream_with_finish_reason_abort(folder):
    """vLLM's default mode."""

    async def main() -> None:
        llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
        got, reasons = [[] for _ in PROMPTS], [None] * len(PROMPTS)
        try:
            tasks = [asyncio.create_task(stream_tokens(llm, i, got, reasons)) for i in range(4)]
            while len(got[0]) < 3:
                await asyncio.sleep(0.001)
            await llm.pause_generation()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
            assert reasons == ["abort"] * 4
            assert (
                not llm.engine.requests and llm.engine.allocator.num_free == llm.engine.num_blocks
            )
            await llm.resume_generation()
            again = [[] for _ in PROMPTS]
            await stream_tokens(llm, 0, again, reasons)
            assert len(again[0]) == GREEDY.max_tokens
        finally:
            llm.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("wait", [{"mode": "wait"}, {"wait_for_inflight_requests": True}])
def test_async_pause_wait_lets_the_admitted_requests_finish_and_holds_new_ones(
    folder, reference, wait
):
    """vLLM's mode "wait" (and its older spelling): the requests already running finish (all
    their tokens), then the engine pauses; a request added meanwhile waits, untouched, and runs
    after the resume."""

    async def main() -> None:
        llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
        got, reasons = [[] for _ in PROMPTS], [None] * len(PROMPTS)
        try:
            tasks = [asyncio.create_task(stream_tokens(llm, i, got, reasons)) for i in range(2)]
            while len(got[0]) < 3:
                await asyncio.sleep(0.001)
            pausing = asyncio.create_task(llm.pause_generation(**wait))
            while not await llm.is_paused():
                await asyncio.sleep(0.001)
            held = asyncio.create_task(stream_tokens(llm, 2, got, reasons))
            await asyncio.wait_for(pausing, timeout=30)
            assert llm.engine.paused and reasons[:2] == ["length"] * 2
            assert got[:2] == reference[:2]
            steps = llm.engine.num_steps
            await asyncio.sleep(0.2)
            assert llm.engine.num_steps == steps and got[2] == [] and not held.done()
            await llm.resume_generation()
            await asyncio.wait_for(asyncio.gather(held, *tasks), timeout=30)
            assert got[2] == reference[2] and not await llm.is_paused()
        finally:
            llm.shutdown()

    asyncio.run(main())


def in_place_writer(folder: str) -> tuple[LLM, Callable[[Engine], None]]:
    """An engine on `folder`'s weights, and a collective_rpc function that copies them into
    another engine's parameters in place, as a trainer's write."""
    on_new = LLM(folder, **ENGINE_ARGS)
    new = {name: p.detach().clone() for name, p in on_new.engine.model.named_parameters()}

    def write(engine: Engine) -> None:
        for name, param in engine.model.named_parameters():
            param.data.copy_(new[name])

    return on_new, write


def test_async_pause_clears_the_cache_so_weights_written_in_place_are_the_ones_used(checkpoints):
    """vLLM's clear_cache (on by default): weights a trainer writes in place between pause and
    resume (collective_rpc) are the ones used after it. A kept request goes on as a fresh
    engine on them goes on from its tokens so far (its KV recomputed), and a prompt cached
    before the pause is computed again (no stale prefix)."""
    a, b = checkpoints
    on_b, write_b = in_place_writer(b)

    async def main() -> tuple[list[int], list[int], list[int]]:
        llm = AsyncLLM.from_model(a, **ENGINE_ARGS)
        got, reasons = [[] for _ in PROMPTS], [None] * len(PROMPTS)
        try:
            await stream_tokens(llm, 1, got, reasons)  # PROMPTS[1]'s blocks cached under A
            task = asyncio.create_task(stream_tokens(llm, 0, got, reasons))
            while len(got[0]) < 5:
                await asyncio.sleep(0.001)
            await llm.pause_generation("keep")
            kept = list(got[0])
            await llm.collective_rpc(write_b)
            await llm.resume_generation()
            await asyncio.wait_for(task, timeout=30)
            again = [[] for _ in PROMPTS]
            await stream_tokens(llm, 1, again, reasons)
        finally:
            llm.shutdown()
        return kept, got[0], again[1]

    kept, tokens, repeated = asyncio.run(main())
    assert 5 <= len(kept) < GREEDY.max_tokens
    rest = replace(GREEDY, max_tokens=GREEDY.max_tokens - len(kept))
    go_on = {"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] + kept}
    assert tokens == kept + on_b.generate(go_on, rest, use_tqdm=False)[0].outputs[0].token_ids
    assert repeated == on_b.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_reset_prefix_cache_with_running_requests_recomputes_their_kv(checkpoints):
    """vLLM's reset_running_requests: a request paused with its KV ("keep", no clear_cache)
    recomputes it once the weights changed under it, and goes on as a fresh engine on them."""
    a, b = checkpoints
    on_b, write_b = in_place_writer(b)

    async def main() -> tuple[list[int], list[int]]:
        llm = AsyncLLM.from_model(a, **ENGINE_ARGS)
        got, reasons = [[] for _ in PROMPTS], [None] * len(PROMPTS)
        try:
            task = asyncio.create_task(stream_tokens(llm, 0, got, reasons))
            while len(got[0]) < 5:
                await asyncio.sleep(0.001)
            await llm.pause_generation("keep", clear_cache=False)
            kept = list(got[0])
            await llm.collective_rpc(write_b)
            assert await llm.reset_prefix_cache(reset_running_requests=True)
            await llm.resume_generation()
            await asyncio.wait_for(task, timeout=30)
            with pytest.raises(ValueError, match="reset_connector"):
                await llm.reset_prefix_cache(reset_connector="yes")
        finally:
            llm.shutdown()
        return kept, got[0]

    kept, tokens = asyncio.run(main())
    rest = replace(GREEDY, max_tokens=GREEDY.max_tokens - len(kept))
    go_on = {"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] + kept}
    assert tokens == kept + on_b.generate(go_on, rest, use_tqdm=False)[0].outputs[0].token_ids


def test_a_bad_pause_mode_is_a_value_error_and_the_engine_lives_on(folder):
    async def main() -> None:
        llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
        try:
            with pytest.raises(ValueError, match="mode"):
                await llm.pause_generation("later")
            assert not await llm.is_paused() and llm.is_running
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_offline_generate_waits_while_another_thread_pauses_it(folder, reference):
    # long enough that the generation cannot end before the pause on a loaded machine (at 24
    # tokens it once did, between the poll and the pause)
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    llm = LLM(folder, **ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, long, use_tqdm=False)]
    assert [tokens[:24] for tokens in expected] == reference
    result: list = []
    worker = threading.Thread(
        target=lambda: result.extend(llm.generate(PROMPTS, long, use_tqdm=False))
    )
    worker.start()
    start = llm.engine.num_steps
    while llm.engine.num_steps < start + 4:
        time.sleep(0.001)
    llm.pause_generation("keep")
    steps = llm.engine.num_steps
    time.sleep(0.3)
    assert llm.engine.num_steps == steps and worker.is_alive()
    llm.resume_generation()
    worker.join(timeout=60)
    assert [o.outputs[0].token_ids for o in result] == expected


def test_a_hook_from_another_thread_lands_before_the_next_step_but_one(folder):
    """A hook called while `generate` steps in another thread takes the step lock after the step
    in flight and at most the one the stepping thread may have begun before the hook asked: the
    stepping thread lets waiting hooks go first. One step more is allowed for a loaded machine
    pausing the hook's thread between reading the step count and asking. (With a plain lock, on
    an idle machine, hooks waited up to 36 of 150 steps.)"""
    llm = LLM(folder, **ENGINE_ARGS)
    step = llm.engine.step

    def slow_step() -> list:  # 2 ms a step, the lock held: steps as long as a small model's
        time.sleep(0.002)
        return step()

    llm.engine.step = slow_step
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    waited: list[int] = []

    def hook() -> None:
        time.sleep(0.03)
        asked = llm.engine.num_steps
        llm.reset_prefix_cache()
        waited.append(llm.engine.num_steps - asked)

    for trial in range(10):
        worker = threading.Thread(target=hook)
        worker.start()
        [out] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
        worker.join(timeout=60)
        assert len(out.outputs[0].token_ids) == 100
        assert len(waited) == trial + 1 and waited[-1] <= 3, waited


def test_offline_pause_wait_returns_once_the_admitted_requests_finished(folder):
    """Two rows: `generate` in another thread admits two prompts of four; pause_generation
    ("wait") returns once those two have every token, the other two not begun; after the
    resume the call ends with the tokens of an engine never paused."""
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm = LLM(folder, max_num_seqs=2, **ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, long, use_tqdm=False)]
    result: list = []
    worker = threading.Thread(
        target=lambda: result.extend(llm.generate(PROMPTS, long, use_tqdm=False))
    )
    step, steps = llm.engine.step, []

    def step_then_hold() -> list:  # the hold lands at the fourth step, whatever the timing
        steps.append(step())
        if len(steps) == 4:
            llm.engine.pause_generation("wait")
        return steps[-1]

    llm.engine.step = step_then_hold
    worker.start()
    while len(steps) < 4:
        time.sleep(0.001)
    llm.pause_generation("wait")  # returns once the engine paused
    held = list(llm.engine.requests.values())  # the finished two have left the engine
    assert llm.engine.paused and worker.is_alive()
    assert len(held) == 2 and all(
        not r.output_token_ids and not r.num_computed_tokens for r in held
    )
    llm.resume_generation()
    worker.join(timeout=60)
    assert [o.outputs[0].token_ids for o in result] == expected


# 8 blocks of 8 tokens for four 31-token requests: some are swapped out when they sleep
SWAPPING = {"num_blocks": 8, "max_model_len": 64, "preemption_mode": "swap"}


@pytest.mark.parametrize("extra", [{}, SWAPPING], ids=["roomy", "swapping"])
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_mid_generation_give_the_outputs_of_no_sleep(
    folder, reference, level, extra
):
    """Running requests recompute their KV after `wake_up`; so do swapped-out ones, whose device
    blocks the sleep gave back (and whose copies out may not have run)."""
    llm = LLM(folder, **{**ENGINE_ARGS, **extra})
    engine = llm.engine
    requests = [
        engine.make_request(f"r{i}", GREEDY, prompt_token_ids=p["prompt_token_ids"])
        for i, p in enumerate(PROMPTS)
    ]
    for request in requests:
        engine.enqueue(request)
    for step in range(40):  # 12 steps, then on until a request is out on the host
        if step >= 12 and (not extra or engine.scheduler.swapped):
            break
        engine.step()
    if extra:
        assert engine.scheduler.swapped, "no request was swapped out: the test is void"
    freed = llm.sleep(level)
    assert freed >= sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    assert engine.kv_caches[0].untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    llm.wake_up()
    if level == 2:  # the weights were dropped: the trainer sends them again
        llm.update_weights_from_path(folder)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == reference
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == (
        reference
    )


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda llm: llm.wake_up("weights"), TypeError, "tags must be a list"),  # one per letter
        (lambda llm: llm.wake_up([1]), TypeError, "tags must be a list"),
        (lambda llm: llm.wake_up(["weight"]), ValueError, "unknown tags"),
        (lambda llm: llm.update_weights(None), TypeError, "named_tensors must be a dict"),
        (lambda llm: llm.apply_model(42), TypeError, "func must be callable"),
    ],
    ids=["tags_text", "tags_ints", "tags_unknown", "weights_none", "func_int"],
)
def test_a_bad_admin_argument_is_a_typed_error_and_the_engine_sleeps_and_wakes_on(
    folder, reference, call, error, message
):
    llm = LLM(folder, **ENGINE_ARGS)
    llm.sleep(1)
    with pytest.raises(error, match=message):
        call(llm)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == (
        reference
    )


def test_reset_prefix_cache_forgets_cached_prompts_and_changes_no_token(folder):
    """A prompt seen before hits the cache (its full blocks); after the reset it computes every
    token again, and the greedy tokens stay those of an engine that never cached."""
    llm = LLM(folder, **ENGINE_ARGS)
    prompt = {"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] * 3}  # 21 tokens: 2 full blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 16)
    assert llm.reset_prefix_cache() is True
    cold = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    want = first.outputs[0].token_ids
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids == want
    assert llm.engine.scheduler.cache.num_cached_blocks > 0  # the cold run cached its own


def test_admin_routes_pause_and_resume_behind_the_api_key(folder):
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with TestClient(build_app(llm, "tiny", api_key="secret")) as client:
            assert client.post("/pause_generation", json={"mode": "keep"}).status_code == 401
            auth = {"Authorization": "Bearer secret"}
            assert client.post("/pause_generation", json={"mode": "keep"}, headers=auth).json() == {
                "paused": True
            }
            assert client.get("/is_paused", headers=auth).json() == {"is_paused": True}
            bad = client.post("/pause_generation", json={"mode": "later"}, headers=auth)
            assert bad.status_code == 400 and "mode" in bad.text
            assert client.post("/resume_generation", headers=auth).json() == {"paused": False}
            missing = client.post(
                "/update_weights_from_path", json={"path": "/nowhere"}, headers=auth
            )
            assert missing.status_code == 400 and missing.json()["error"]["param"] == "path"
            for path in ("a" * 300, "\udcff"):  # a name too long for the system; no UTF-8
                content = json.dumps({"path": path})
                headers = {**auth, "content-type": "application/json"}
                answer = client.post("/update_weights_from_path", content=content, headers=headers)
                assert answer.status_code == 400 and answer.json()["error"]["param"] == "path"
            misspelt = client.post("/sleep", json={"levle": 2}, headers=auth)
            assert misspelt.status_code == 400 and misspelt.json()["error"]["param"] == "levle"
            assert not llm.engine.is_sleeping  # nothing was done
            reset = client.post("/reset_prefix_cache", headers=auth)
            assert reset.json() == {"success": True}  # vLLM's answer
            query = "?reset_running_requests=true&reset_external=true"  # vLLM's parameters
            assert client.post(f"/reset_prefix_cache{query}", headers=auth).json()["success"]
            bad = client.post("/reset_prefix_cache?reset_running_requests=maybe", headers=auth)
            assert bad.status_code == 400
            slept = client.post("/sleep", json={"level": 1}, headers=auth).json()
            assert slept["freed_gib"] > 0
            assert client.post("/wake_up", headers=auth).json() == {"sleeping": False}
    finally:
        llm.shutdown()


async def finish_reason(llm: AsyncLLM, request_id: str) -> str | None:
    async for out in llm.generate(PROMPTS[0], GREEDY, request_id):
        if out.finished:
            return out.outputs[0].finish_reason
    return None


def test_vllms_pause_and_resume_routes_take_its_query_parameters_and_answer_its_shapes(folder):
    """vLLM's POST /pause?mode=abort|keep|wait (abort by default: in-flight requests end with
    finish_reason "abort"; "wait", or its older wait_for_inflight_requests, answers once they
    finished), POST /resume, GET /is_paused answering {"is_paused": ...}."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            assert client.post("/pause?mode=keep").json() == {"status": "paused"}
            assert client.get("/is_paused").json() == {"is_paused": True}
            kept = client.portal.start_task_soon(finish_reason, llm, "kept")
            while llm.stats.num_waiting + llm.stats.num_running == 0:
                time.sleep(0.01)
            assert client.post("/pause").json() == {"status": "paused"}  # mode=abort
            assert kept.result(timeout=10) == "abort"
            refused = client.post("/pause?mode=later")
            assert refused.status_code == 400 and "mode" in refused.json()["error"]["param"]
            for query in ("?mode=wait", "?wait_for_inflight_requests=true"):
                assert client.post("/resume").json() == {"status": "resumed"}
                running = client.portal.start_task_soon(finish_reason, llm, f"run{query}")
                while llm.stats.num_running == 0:
                    time.sleep(0.01)
                assert client.post(f"/pause{query}").json() == {"status": "paused"}
                assert running.result(timeout=10) == "length"  # it finished, not aborted
                assert client.get("/is_paused").json() == {"is_paused": True}
            assert client.post("/resume").json() == {"status": "resumed"}
            assert client.get("/is_paused").json() == {"is_paused": False}
            assert client.portal.call(finish_reason, llm, "after") == "length"
    finally:
        llm.shutdown()


def test_sleep_ends_the_requests_in_flight_unless_mode_is_keep_as_vllm(folder):
    """vLLM's POST /sleep?mode=abort (its default) ends the requests in flight with
    finish_reason "abort"; ?mode=keep holds them, and they finish after waking."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            for query, want in (("", "abort"), ("&mode=keep", "length")):
                assert client.post("/pause?mode=keep").status_code == 200
                request = client.portal.start_task_soon(finish_reason, llm, f"r{query}")
                while llm.stats.num_waiting + llm.stats.num_running == 0:
                    time.sleep(0.01)
                assert client.post(f"/sleep?level=1{query}").status_code == 200
                assert client.post("/wake_up").status_code == 200
                assert client.post("/resume").status_code == 200
                assert request.result(timeout=10) == want
            refused = client.post("/sleep?mode=later")
            assert refused.status_code == 400 and "mode" in refused.json()["error"]["param"]
            assert not llm.engine.is_sleeping
    finally:
        llm.shutdown()


def test_sleep_mode_wait_lets_the_running_request_finish_and_wake_up_resumes(folder, reference):
    """vLLM's POST /sleep?mode=wait: the running request finishes before the engine sleeps; one
    sent meanwhile is held through the sleep and runs once /wake_up wakes every part."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    got, reasons = [[] for _ in PROMPTS], [None] * len(PROMPTS)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            running = client.portal.start_task_soon(stream_tokens, llm, 0, got, reasons)
            while len(got[0]) < 3:
                time.sleep(0.001)
            sleeping = ThreadPoolExecutor(1).submit(client.post, "/sleep?level=1&mode=wait")
            while not client.portal.call(llm.is_paused):
                time.sleep(0.001)
            held = client.portal.start_task_soon(stream_tokens, llm, 1, got, reasons)
            assert sleeping.result(timeout=30).status_code == 200
            running.result(timeout=10)
            assert got[0] == reference[0] and reasons[0] == "length"
            assert llm.engine.is_sleeping and got[1] == [] and not held.done()
            assert client.post("/wake_up?tags=weights").status_code == 200
            assert got[1] == [] and client.portal.call(llm.is_paused)
            assert client.post("/wake_up?tags=kv_cache").status_code == 200
            held.result(timeout=30)
            assert got[1] == reference[1] and not client.portal.call(llm.is_paused)
    finally:
        llm.shutdown()


def test_sleep_takes_vllms_level_query_parameter_and_is_sleeping_reports_it(folder):
    """vLLM's POST /sleep?level=2: the level is honoured, not left at 1; one that differs from
    the body's, or is not 1 or 2, is a 400 and nothing sleeps. GET /is_sleeping says whether it does."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            for query, body in (("?level=3", None), ("?level=2", {"level": 1})):
                refused = client.post(f"/sleep{query}", json=body)
                assert refused.status_code == 400 and "level" in refused.json()["error"]["param"]
                assert not llm.engine.is_sleeping
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            assert client.post("/sleep?level=2").status_code == 200
            assert llm.engine.memory.level == 2
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}  # vLLM's route
            assert client.post("/wake_up").status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    finally:
        llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_wake_up_by_tags_wakes_the_weights_then_the_kv_cache_as_vllm(folder, reference, level):
    """vLLM's POST /wake_up?tags=weights, then ?tags=kv_cache (the order RL trainers use, to
    load new weights before the cache takes its memory): each wakes the part it names, one
    naming parts awake already does nothing and is no error, an unknown tag is a 400."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    engine = llm.engine
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            assert client.post(f"/sleep?level={level}").status_code == 200
            unknown = client.post("/wake_up?tags=weights&tags=scheduler")
            assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tags"
            assert client.post("/wake_up?tags=weights").status_code == 200
            assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters())
            assert engine.kv_caches[0].untyped_storage().nbytes() == 0
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            assert client.post("/wake_up?tags=weights").status_code == 200  # awake already
            body = {"path": folder}  # the trainer's weights go in while the cache sleeps
            assert client.post("/update_weights_from_path", json=body).status_code == 200
            assert client.post("/wake_up?tags=kv_cache").status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            assert engine.kv_caches[0].untyped_storage().nbytes() > 0
            assert client.post("/wake_up").status_code == 200  # awake: nothing to do
            prompt = {"prompt": PROMPTS[0]["prompt_token_ids"], "max_tokens": 24}
            greedy = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
            answer = client.post("/v1/completions", json={**prompt, **greedy}).json()
            tokens = answer["choices"][0]["token_ids"]
            assert tokens == reference[0]
    finally:
        llm.shutdown()


def test_generate_on_a_paused_engine_raises_instead_of_waiting_for_itself(folder):
    llm = LLM(folder, **ENGINE_ARGS)
    llm.pause_generation()
    with pytest.raises(RuntimeError, match="resume_generation"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert not llm.engine.requests  # nothing was queued
    llm.resume_generation()
    assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


def generating(llm: LLM, params: SamplingParams = GREEDY):
    """A generate of PROMPTS on another thread, started and a few steps in; its outputs land
    in the returned list."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(llm.generate(PROMPTS, params)))
    steps = llm.engine.num_steps
    thread.start()
    while llm.engine.num_steps < steps + 3:
        time.sleep(0.001)
    return thread, results


def test_sleep_level_0_holds_the_steps_until_wake_up_and_frees_nothing(folder, reference):
    """vLLM's level 0: the steps stop (a generate on another thread waits, its requests keep
    their KV), no memory is given back, and wake_up(["scheduling"]) lets it finish as if it
    had never slept; this thread's generate is an error meanwhile, not a wait for itself."""
    llm = LLM(folder, **ENGINE_ARGS)
    engine = llm.engine
    thread, results = generating(llm)
    assert llm.sleep(0) == 0
    assert engine.is_sleeping and not engine.memory.asleep
    assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters())
    steps = engine.num_steps
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    time.sleep(0.2)
    assert engine.num_steps == steps and not results
    with pytest.raises(RuntimeError, match="asleep already"):
        llm.sleep(1)
    llm.wake_up(["scheduling"])
    thread.join(30)
    assert [o.outputs[0].token_ids for o in results[0]] == reference
    assert not engine.is_sleeping
    llm.sleep(0)
    llm.wake_up()  # every tag, "scheduling" among them
    assert not engine.is_sleeping


def test_offline_sleep_abort_ends_a_running_generate_and_wait_lets_it_finish(folder, reference):
    llm = LLM(folder, **ENGINE_ARGS)
    long = replace(GREEDY, max_tokens=100)
    thread, results = generating(llm, long)
    llm.sleep(1, mode="abort")
    thread.join(30)
    assert {o.outputs[0].finish_reason for o in results[0]} == {"abort"}
    llm.wake_up()
    thread, results = generating(llm)
    llm.sleep(1, mode="wait")  # returns once the running generate's requests are done
    thread.join(30)
    assert [o.outputs[0].token_ids for o in results[0]] == reference
    assert llm.engine.is_sleeping
    llm.wake_up()
    assert not llm.engine.is_paused  # the sleep's own pause ends with it
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == (
        reference
    )


def test_the_server_sleeps_at_level_0_and_wakes_the_scheduling_tag(folder):
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            assert client.post("/sleep?level=0&mode=keep").json() == {"freed_gib": 0.0}
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            assert not llm.engine.memory.asleep
            assert client.post("/wake_up?tags=scheduling").json() == {"sleeping": False}
    finally:
        llm.shutdown()


def held_bytes(engine) -> list[int]:
    """Bytes each weight's storage and the KV cache's hold."""
    memory = engine.memory
    return [t.untyped_storage().nbytes() for t in (*memory.weights, memory.kv_cache)]


def test_shutdown_gives_back_the_weights_and_kv_cache_and_refuses_what_would_use_them(folder):
    """As vLLM's engine process ends: after shutdown no weight and no KV block holds memory,
    and whatever would run on them raises instead of reading freed storage."""
    llm = LLM(folder, **ENGINE_ARGS)
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24
    assert all(held_bytes(llm.engine))
    llm.shutdown()
    assert not any(held_bytes(llm.engine))
    name, weight = next(iter(llm.engine.model.state_dict().items()))
    for call in (
        lambda: llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False),
        lambda: llm.sleep(1),
        lambda: llm.wake_up(),
        lambda: llm.update_weights([(name, torch.zeros(weight.shape))]),
        lambda: llm.collective_rpc("reset_prefix_cache"),
    ):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    llm.shutdown()  # a second time: nothing to do


def test_a_shut_down_server_engine_holds_no_memory_while_its_app_lives(folder):
    """The app's routes keep the engine referenced (so do a web framework's caches of them,
    past the app's life): its weights and KV cache must not stay with it."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    app = build_app(llm, "tiny")
    with TestClient(app) as client:
        body = {"model": "tiny", "prompt": [3, 17, 30], "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
    llm.shutdown()
    assert app.routes and not any(held_bytes(llm.engine))
