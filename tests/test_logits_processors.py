"""Custom logits processors (logits_processors.py): vLLM's interface, their rows kept current by
BatchUpdates, their order around penalties and temperature, bad processors and requests."""

from __future__ import annotations

import asyncio
import itertools
import random
import warnings
from typing import ClassVar

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM, EngineGenerateError
from tandem.batch import StepFailed
from tandem.logits_processors import (
    WAITED,
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
    batch_update,
    process_dict_updates,
)
from tandem.request import Request
from test_bad_input import transformers_greedy

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "Hello there"]
TARGET = 7


def apply_update(slots: dict[int, str], update: BatchUpdate | None) -> dict[int, str]:
    """A persistent batch (index -> request id) after `update`, applied as vLLM's processors
    apply one: removed, then added, then moved."""
    if update is None:
        return slots
    slots = dict(slots)
    for index in update.removed:
        del slots[index]
    for index, params, _, _ in update.added:
        slots[index] = params.extra_args["id"]
    for a, b, direction in update.moved:
        moving = slots.pop(a, None)
        if direction is MoveDirectionality.SWAP:
            other = slots.pop(b, None)
            if other is not None:
                slots[a] = other
        else:
            assert b not in slots, "a one-way move onto a live row would lose it"
        assert moving is not None, "a move from an empty index"
        slots[b] = moving
    return slots


def fake_request(rid: str) -> Request:
    params = SamplingParams(extra_args={"id": rid})
    return Request(request_id=rid, prompt_token_ids=[1], params=params, seed=0)


def test_batch_updates_turn_each_steps_rows_into_the_next_ones():
    """Random steps (requests leaving, joining, reordered): applying each BatchUpdate to the
    rows before it gives exactly the step's rows, every live index below its batch size; so does
    `process_dict_updates` on a processor's entries (the even-numbered requests' alone), which
    says whether they changed."""
    rng = random.Random(0)
    pool = [fake_request(f"r{i}") for i in range(40)]
    last: list = []
    slots: dict[int, str] = {}
    evens: dict[int, str] = {}

    def even_ones(params, prompt_ids, output_ids):
        rid = params.extra_args["id"]
        return rid if int(rid[1:]) % 2 == 0 else None

    assert batch_update([], []) is None
    for _ in range(300):
        kept = [r for r in pool if r in last and rng.random() < 0.8]
        fresh = [r for r in pool if r not in last and rng.random() < 0.15]
        rows = kept + fresh
        rng.shuffle(rows) if rng.random() < 0.3 else None
        rows = rows[:12]
        update = batch_update(last, rows)
        assert (update is None) == (rows == last)
        slots = apply_update(slots, update)
        assert slots == {i: r.request_id for i, r in enumerate(rows)}
        before = dict(evens)
        changed = process_dict_updates(evens, update, even_ones)
        assert evens == {i: rid for i, rid in slots.items() if int(rid[1:]) % 2 == 0}
        assert changed == (evens != before)
        if update is not None:
            assert update.batch_size == len(rows)
            added = {params.extra_args["id"] for _, params, _, _ in update.added}
            assert added == {r.request_id for r in rows} - {r.request_id for r in last}
        last = rows


class TargetToken(LogitsProcessor):
    """vLLM's example: rows whose extra_args name a target_token sample only that token."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.targets: dict[int, int] = {}

    @classmethod
    def validate_params(cls, sampling_params):
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and not (isinstance(target, int) and target >= 0):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(
            self.targets,
            batch_update,
            lambda params, _, __: (params.extra_args or {}).get("target_token"),
        )

    def apply(self, logits):
        if not self.targets:
            return logits
        rows = torch.tensor(list(self.targets), device=logits.device)
        cols = torch.tensor(list(self.targets.values()), device=logits.device)
        kept = logits[rows, cols]
        logits[rows] = float("-inf")
        logits[rows, cols] = kept
        return logits


class Recorder(LogitsProcessor):
    """Changes nothing, records the logits it saw; declared able to change an argmax."""

    seen: ClassVar[list[torch.Tensor]] = []
    invariant = False

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return self.invariant

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        type(self).seen.append(logits.clone())
        return logits


class TopOnly(Recorder):
    """Argmax-invariant: every row keeps its most likely token alone; records what it saw."""

    seen: ClassVar[list[torch.Tensor]] = []
    invariant = True

    def apply(self, logits):
        super().apply(logits)
        top = logits.argmax(-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(1, top, logits.gather(1, top))


class NoRepeat(AdapterLogitsProcessor):
    """A per-request function (vLLM's wrapper): with extra_args no_repeat, a row may not sample
    its last output token again."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("no_repeat"):
            return None

        def ban_last(output_ids, row):
            if output_ids:
                row[output_ids[-1]] = float("-inf")
            return row

        return ban_last


class RaisesLater(AdapterLogitsProcessor):
    """With extra_args raise_at, a row's function raises once the row has that many outputs."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        at = (params.extra_args or {}).get("raise_at")
        if at is None:
            return None

        def fn(output_ids, row):
            if len(output_ids) >= at:
                raise RuntimeError("the processor failed")
            return row

        return fn


class BlindRaisesLater(RaisesLater):
    """RaisesLater reading no output ids: its steps sample in the forward pass's launch."""

    @classmethod
    def needs_output_token_ids(cls):
        return False


@pytest.fixture(scope="module")
def folder(make_tiny):
    return make_tiny("qwen3")


def make_llm(folder, processors=None, **kwargs) -> LLM:
    args = dict(max_model_len=64, block_size=8, logits_processors=processors)
    return LLM(str(folder), **(args | kwargs))


def greedy_of(llm: LLM, folder, prompt: str, max_tokens: int) -> list[int]:
    ids = tuple(llm.get_tokenizer().encode(prompt))
    return transformers_greedy(folder, ids, max_tokens)


@pytest.mark.parametrize("async_batching", [True, False])
def test_target_token_rows_sample_only_it_and_other_rows_keep_their_greedy_tokens(
    folder, async_batching
):
    """Two requests name a target token (one sampled at temperature 0.9, one with n=2 joining
    later through chunked prefill), the others not: theirs are transformers' greedy tokens."""
    llm = make_llm(folder, [TargetToken], async_batching=async_batching, max_num_batched_tokens=16)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    target = SamplingParams(
        temperature=0.9, seed=1, max_tokens=6, ignore_eos=True, extra_args={"target_token": TARGET}
    )
    target_n = SamplingParams(
        n=2, temperature=1.0, max_tokens=4, ignore_eos=True, extra_args={"target_token": 3}
    )
    params = [greedy, target, greedy, target_n]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == [TARGET] * 6
    assert [o.token_ids for o in outs[3].outputs] == [[3] * 4, [3] * 4]
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == greedy_of(llm, folder, PROMPTS[i], 6)
    assert not llm.engine.has_unfinished()


def test_argmax_invariant_processors_see_logits_divided_by_temperature(folder):
    """vLLM's order: a processor that may change the argmax sees the model's logits; one that
    may not sees them divided by the row's temperature (greedy rows skip it). Keeping only the
    top token there makes a sampled row greedy."""
    Recorder.seen.clear()
    TopOnly.seen.clear()
    llm = make_llm(folder, [Recorder, TopOnly], async_batching=False)
    sampled = SamplingParams(temperature=2.0, seed=3, max_tokens=5, ignore_eos=True)
    [out] = llm.generate(PROMPTS[:1], sampled, use_tqdm=False)
    assert out.outputs[0].token_ids == greedy_of(llm, folder, PROMPTS[0], 5)
    assert len(Recorder.seen) == len(TopOnly.seen) == 5
    for raw, divided in zip(Recorder.seen, TopOnly.seen, strict=True):
        torch.testing.assert_close(divided, raw / 2.0)
    TopOnly.seen.clear()
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
    assert all(torch.equal(seen, Recorder.seen[-3 + i]) for i, seen in enumerate(TopOnly.seen))


@pytest.mark.parametrize("async_batching", [True, False])
def test_per_request_functions_through_the_adapter_see_each_rows_outputs(folder, async_batching):
    """A function is handed the row's outputs so far, the token last sampled included (with
    async batching too: the step's sampling waited for the host's read of the step before): no
    token follows itself."""
    llm = make_llm(folder, [NoRepeat], async_batching=async_batching)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    banned = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, extra_args={"no_repeat": True}
    )
    outs = llm.generate(PROMPTS, [free, banned, free, banned], use_tqdm=False)
    for i in (1, 3):  # their greedy tokens repeat: 290, 290, ... and 72, 72, ...
        assert any(a == b for a, b in itertools.pairwise(greedy_of(llm, folder, PROMPTS[i], 12)))
        ids = outs[i].outputs[0].token_ids
        assert all(a != b for a, b in itertools.pairwise(ids)), ids
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == greedy_of(llm, folder, PROMPTS[i], 12)


@pytest.mark.parametrize("async_batching", [True, False])
def test_a_request_id_used_again_is_a_new_request_to_the_processors(folder, async_batching):
    """One id, three requests one after another (a target, another target, none): each is added
    to the processors afresh, so the second samples its own target and the third the model's
    greedy tokens (the processors held the first one's row while the ids matched)."""
    llm = make_llm(folder, [TargetToken], async_batching=async_batching)
    engine = llm.engine
    ids = llm.get_tokenizer().encode(PROMPTS[0])

    def run(extra_args):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args=extra_args)
        request = engine.make_request("job", params, None, list(ids))
        engine.enqueue(request)
        while engine.has_unfinished():
            engine.step()
        return request.output_token_ids

    assert run({"target_token": 3}) == [3] * 4
    assert run({"target_token": 7}) == [7] * 4
    assert run(None) == greedy_of(llm, folder, PROMPTS[0], 4)


@pytest.mark.parametrize("processor", [RaisesLater, BlindRaisesLater])
@pytest.mark.parametrize("async_batching", [True, False])
@pytest.mark.parametrize("raise_at", [0, 2], ids=["prefill", "decode"])
def test_a_processor_raising_in_a_step_fails_that_call_and_the_next_one_runs(
    folder, async_batching, raise_at, processor
):
    """The step whose sampling raised (launched after the host's read of the step before, or
    with the forward pass where the processor reads no output ids) is abandoned, never read
    back, and its requests aborted: the next call gets transformers' greedy tokens and every
    block comes back."""
    llm = make_llm(folder, [processor], async_batching=async_batching)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    failing = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, extra_args={"raise_at": raise_at}
    )
    with pytest.raises(StepFailed, match="the processor failed"):
        llm.generate(PROMPTS[:2], [greedy, failing], use_tqdm=False)
    engine = llm.engine
    assert not engine.in_flight and not engine.has_unfinished()
    outs = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == greedy_of(llm, folder, PROMPTS[i], 6)
    assert engine.allocator.num_free == engine.num_blocks


@pytest.mark.parametrize("processor", [RaisesLater, BlindRaisesLater])
@pytest.mark.parametrize("async_batching", [True, False])
def test_a_processor_raising_under_async_llm_fails_its_steps_requests_and_the_engine_serves_on(
    folder, async_batching, processor
):
    """The requests of the abandoned step get the error in their streams (a step's processors
    run on all its rows, so its other rows too); the engine thread lives, and a request after
    them gets transformers' greedy tokens."""
    llm = AsyncLLM.from_model(
        str(folder), max_model_len=64, block_size=8, logits_processors=[processor],
        async_batching=async_batching,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    failing = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             extra_args={"raise_at": 2})  # fmt: skip

    async def tokens(prompt, params, request_id):
        outputs = [out async for out in llm.generate(prompt, params, request_id)]
        return outputs[-1].outputs[0].token_ids

    async def main():
        first = await asyncio.gather(
            tokens(PROMPTS[0], greedy, "a"), tokens(PROMPTS[1], failing, "b"),
            return_exceptions=True,
        )  # fmt: skip
        return first, await tokens(PROMPTS[2], greedy, "c")

    try:
        first, after = asyncio.run(main())
        assert isinstance(first[1], EngineGenerateError)  # vLLM's, its cause the step's
        assert isinstance(first[1].__cause__, StepFailed)
        assert "the processor failed" in str(first[1])
        assert not llm.errored
        assert after == transformers_greedy(
            folder, tuple(llm.engine.tokenizer.encode(PROMPTS[2])), 6
        )
        assert llm.engine.allocator.num_free == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_a_request_that_finished_before_the_failed_step_keeps_its_output(folder):
    """A stop token the scheduler cannot foresee ends "a" in the step before the one that
    fails: "a" still had a row there, yet keeps its own finished output; "b" gets the error."""
    ids = tuple(make_llm(folder).get_tokenizer().encode(PROMPTS[0]))
    greedy = transformers_greedy(folder, ids, 6)
    stops = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[greedy[2]])
    failing = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             extra_args={"raise_at": 3})  # fmt: skip
    llm = AsyncLLM.from_model(str(folder), max_model_len=64, block_size=8,
                              logits_processors=[RaisesLater])  # fmt: skip

    async def last(prompt, params, request_id):
        return [out async for out in llm.generate(prompt, params, request_id)][-1]

    async def main():
        return await asyncio.gather(
            last({"prompt_token_ids": list(ids)}, stops, "a"), last(PROMPTS[1], failing, "b"),
            return_exceptions=True,
        )  # fmt: skip

    try:
        a, b = asyncio.run(main())
    finally:
        llm.shutdown()
    assert isinstance(b, EngineGenerateError) and isinstance(b.__cause__, StepFailed)  # vLLM's
    assert "the processor failed" in str(b)
    assert a.outputs[0].token_ids == greedy[: greedy.index(greedy[2]) + 1]
    assert a.outputs[0].finish_reason == "stop"


def test_two_ranks_serve_on_after_a_processor_raised(folder):
    """Every rank runs the processors, so every rank's step fails: each aborts the step's
    requests and follows rank 0 on (a worker died of it before)."""
    llm = LLM(str(folder), max_model_len=64, block_size=8, tensor_parallel_size=2,
              logits_processors=[RaisesLater])  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    failing = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                             extra_args={"raise_at": 2})  # fmt: skip
    try:
        with pytest.raises(StepFailed, match="the processor failed"):
            llm.generate(PROMPTS[:2], [greedy, failing], use_tqdm=False)
        [out] = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    ids = tuple(llm.get_tokenizer().encode(PROMPTS[0]))
    assert out.outputs[0].token_ids == transformers_greedy(folder, ids, 4)


def test_a_processor_refuses_a_request_and_the_engine_serves_on(folder):
    llm = make_llm(folder, [f"{__name__}:TargetToken"])
    bad = SamplingParams(max_tokens=2, extra_args={"target_token": "seven"})
    with pytest.raises(ValueError, match="target_token must be a token id"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [out] = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == greedy_of(llm, folder, PROMPTS[0], 4)


@pytest.mark.parametrize(
    ("processors", "error", "words"),
    [
        ([dict], TypeError, "LogitsProcessor"),
        (["no_such_module_here:Thing"], ValueError, "cannot be imported"),
        (["NoColonOrDot"], ValueError, "package.module:Class"),
        (TargetToken, TypeError, "a list"),
    ],
)
def test_bad_processors_are_refused_at_start(folder, processors, error, words):
    with pytest.raises(error, match=words):
        make_llm(folder, processors)


def test_two_ranks_run_the_processors_and_give_the_tokens_of_one(folder):
    """Every rank makes the processors and defers the same steps' sampling (a collective);
    sampled rows with a target and with no-repeat functions, through preemption, give the
    tokens of one rank."""
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(5)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True,
                       extra_args={"target_token": 9} if i % 2 else {"no_repeat": True})
        for i in range(len(prompts))
    ]  # fmt: skip
    results = []
    for size in (1, 2):
        llm = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8,
                  max_num_batched_tokens=24, tensor_parallel_size=size,
                  logits_processors=[TargetToken, NoRepeat])  # fmt: skip
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.engine.shutdown()
        results.append([o.outputs[0].token_ids for o in outputs])
    assert results[1] == results[0]
    assert all(ids == [9] * 10 for ids in results[0][1::2])
    assert all(a != b for ids in results[0][::2] for a, b in itertools.pairwise(ids))


def test_the_cli_names_processors_by_module_and_class(folder):
    """`--logits-processors module:Class` reaches the engine, which makes the named class."""
    from tandem.cli import build_parser, engine_kwargs

    name = f"{__name__}:TargetToken"
    args = build_parser().parse_args(["generate", str(folder), "a", "--logits-processors", name])
    kwargs = engine_kwargs(args)
    assert kwargs["logits_processors"] == [name]
    llm = make_llm(folder, **{**kwargs, "max_model_len": 64})
    assert [type(p) for p in llm.engine.logits_processors.processors] == [TargetToken]
    target = SamplingParams(max_tokens=3, ignore_eos=True, extra_args={"target_token": TARGET})
    [out] = llm.generate(PROMPTS[:1], target, use_tqdm=False)
    assert out.outputs[0].token_ids == [TARGET] * 3


def test_the_server_hands_vllm_xargs_to_processors_and_answers_a_refusal_with_a_400(folder):
    """vLLM's vllm_xargs become extra_args, which a processor reads; a request it refuses is
    a 400, and the server serves the next one."""
    import httpx

    from tandem.async_llm import AsyncLLM
    from tandem.server.app import build_app
    from test_server import running

    llm = AsyncLLM.from_model(str(folder), max_model_len=64, logits_processors=[TargetToken])
    tokenizer = llm.engine.tokenizer
    try:
        with running(build_app(llm, "tiny")) as url:
            body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True}
            good = {**body, "vllm_xargs": {"target_token": TARGET}}
            response = httpx.post(f"{url}/v1/completions", json=good, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == tokenizer.decode([TARGET] * 4)
            bad = {**body, "vllm_xargs": {"target_token": "seven"}}
            response = httpx.post(f"{url}/v1/completions", json=bad, timeout=60)
            assert response.status_code == 400 and "target_token" in response.text
            response = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0})
            assert response.status_code == 200, response.text
    finally:
        llm.shutdown()


def test_steps_with_processors_sample_eagerly_and_no_sampling_graph_is_captured(folder):
    """User code is never captured: an engine with processors has no sampling graph to
    capture, and its graphed steps sample eagerly after their forward graphs."""
    from tandem.batch import StepBatch

    llm = make_llm(folder, [TargetToken])
    assert llm.engine.runner._sampling_variants() == []
    plain = make_llm(folder)
    assert len(plain.engine.runner._sampling_variants()) > 0
    fields = dict(step=0, slot=None, requests=[], samples=None, num_tokens=1, num_seqs_padded=1,
                  decode_only=True, use_filters=False, num_top_logprobs=None, seq_lens=[1],
                  query_start_loc=[0, 1], graphed=True)  # fmt: skip
    assert StepBatch(**fields).sampling_graphed
    assert not StepBatch(**fields, custom_logits=True).sampling_graphed


class Blind(Recorder):
    """Reads no output ids, so its steps' sampling need not wait for the host."""

    seen: ClassVar[list[torch.Tensor]] = []

    @classmethod
    def needs_output_token_ids(cls):
        return False


@pytest.mark.parametrize(("processor", "waits"), [(Recorder, True), (Blind, False)])
def test_sampling_waits_for_the_host_only_for_processors_that_read_output_ids(
    folder, monkeypatch, processor, waits
):
    """With async batching, a processor that reads output ids (vLLM's default assumption) has
    each step's sampling launched once the step before is read back, its forward pass already
    launched; one that declares it reads none has the sampling launched with the forward pass.
    The tokens are the same either way, and transformers' greedy tokens."""
    from tandem.runner import Runner

    launched = []
    launch = Runner.launch

    def record(self, batch, timeline):
        launched.append(batch.sampling_waits)
        return launch(self, batch, timeline)

    monkeypatch.setattr(Runner, "launch", record)
    llm = make_llm(folder, [processor], async_batching=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert launched and all(waits is w for w in launched)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == greedy_of(llm, folder, prompt, 8)


class Truncating(Recorder):
    """A broken processor: returns the logits of its first row alone."""

    def apply(self, logits):
        return logits[:1]


def test_a_processor_returning_logits_of_another_shape_is_named_in_a_type_error(folder):
    llm = make_llm(folder, [Truncating])
    with pytest.raises(StepFailed, match=r"Truncating.apply must return .* shape \(2, ") as failed:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    assert isinstance(failed.value.__cause__, TypeError)


class Waiting(Recorder):
    """Its apply makes one call that torch's sync debug mode "warn" reports (simulated here:
    the CPU has no CUDA) and warns of something else too."""

    def apply(self, logits):
        warnings.warn(WAITED, UserWarning, stacklevel=1)
        warnings.warn("a warning of its own", UserWarning, stacklevel=1)
        return logits


class Still(Recorder):
    """Changes nothing; unhashable, as a processor defining __eq__ is."""

    def __eq__(self, other):
        return isinstance(other, Still)

    __hash__ = None

    def apply(self, logits):
        return logits


def test_a_processor_waiting_for_the_device_is_named_once_and_the_mode_set_back(
    monkeypatch, caplog
):
    """On a GPU each processor's first apply runs under sync debug mode "warn": one that waits
    is named in a logged warning, once; one that does not, never; the mode before (here
    "error", as the sync-debug tests set it) is set back after; its other warnings pass on."""
    modes = [2]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    processors = LogitsProcessors([Waiting, Still], None, torch.device("cuda"))
    logits = torch.zeros(2, 8)
    with pytest.warns(UserWarning, match="a warning of its own"):
        for _ in range(3):
            processors.before_penalties(logits)
    named = [r.getMessage() for r in caplog.records if "waits for the device" in r.getMessage()]
    assert len(named) == 1 and named[0].startswith("Waiting.apply")
    assert modes == [2, "warn", 2, "warn", 2]  # each processor's first apply watched, alone
    cpu = LogitsProcessors([Waiting], None, torch.device("cpu"))
    with pytest.warns(UserWarning, match=WAITED):  # no watching on the CPU
        cpu.before_penalties(logits)
    assert modes == [2, "warn", 2, "warn", 2]
