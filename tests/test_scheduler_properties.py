"""Property tests: the block allocator, the scheduler and the step loop keep their invariants under
random arrivals, aborts, EOS, chunked prefill and preemption, with and without async batching."""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tandem.attention import AttentionMetadata
from tandem.config import EngineConfig, ModelConfig, cdiv
from tandem.engine import Engine
from tandem.kv_cache import BlockAllocator, bytes_per_block
from tandem.model.loader import read_hf_config
from tandem.model.tiny import NUM_MERGED_TOKENS
from tandem.request import Request, Status
from tandem.sampling import SamplingParams

MAX_STEPS = 5000  # far more than any generated workload needs; reaching it means a livelock

# ---- the allocator alone ------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Owners hold block lists; the allocator's count of each block must equal its owners."""

    @initialize(num_blocks=st.integers(1, 12))
    def make_allocator(self, num_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.owners: list[list[int]] = []

    def held(self) -> np.ndarray:
        blocks = [b for owner in self.owners for b in owner]
        return np.bincount(blocks, minlength=self.allocator.num_blocks)

    @rule(n=st.integers(0, 13))
    def allocate(self, n: int) -> None:
        held = self.held()
        if not self.allocator.can_allocate(n):
            assert n > (held == 0).sum()
            return
        blocks = self.allocator.allocate(n)
        assert len(set(blocks)) == n
        assert (held[blocks] == 0).all(), f"handed out blocks in use: {blocks}"
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        blocks = data.draw(st.sampled_from(self.owners))
        self.allocator.take(blocks)
        self.owners.append(list(blocks))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.integers(0, len(self.owners) - 1))
        self.allocator.free(self.owners.pop(owner))

    @rule(block=st.integers(0, 11))
    def refuse_to_free_a_block_nobody_holds(self, block: int) -> None:
        if block >= self.allocator.num_blocks or self.held()[block]:
            return
        with pytest.raises(AssertionError, match="freed twice"):
            self.allocator.free([block])

    @invariant()
    def counts_match_owners_and_free_blocks_are_listed_once(self) -> None:
        held, free = self.held(), list(self.allocator.free_queue)
        assert (self.allocator.ref_counts == held).all()
        assert sorted(free) == np.flatnonzero(held == 0).tolist()

    def teardown(self) -> None:
        for blocks in self.owners:
            self.allocator.free(blocks)
        assert sorted(self.allocator.free_queue) == list(range(self.allocator.num_blocks))
        assert not self.allocator.ref_counts.any()


def test_allocator_never_hands_out_a_held_block_and_frees_every_block_exactly_once():
    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None),
    )


# ---- the step loop with a simulated model -------------------------------------------------
# The real Engine runs (scheduler, batch builder, carry-over, sampler, sync or async step loop);
# only the runner's decoder is replaced, by a hash "language model" that takes microseconds.


class HashLM:
    """Stands in for the decoder: the next token is a hash of the whole context, read back
    through the block table from a token cache of its own.

    A block held by two live requests, a wrong slot or position, or a wrong carried-over token
    changes what a request reads, so its tokens stop matching `expected_output`.
    """

    lora = None  # the decoder's LoRA adapters: none here

    def __init__(self, engine: Engine, eos_percent: int):
        self.block_size = engine.block_size
        self.num_slots = engine.num_blocks * engine.block_size
        self.cached_token = np.full(self.num_slots, -1)  # [num_slots] token id written there
        self.cached_position = np.full(self.num_slots, -1)  # [num_slots] its position
        self.vocab_size = engine.model_config.vocab_size
        self.eos_id = engine.eos_token_ids[0]
        self.eos_percent = eos_percent

    def next_token(self, context: np.ndarray) -> int:
        """EOS for about eos_percent of contexts, otherwise an ordinary (non-special) token."""
        h = zlib.crc32(context.astype(np.int64).tobytes())
        return self.eos_id if h % 100 < self.eos_percent else (h >> 8) % NUM_MERGED_TOKENS

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        attend: object,
        embeds: object = None,  # prompts of embeddings: none here
    ) -> torch.Tensor:
        """Write this step's tokens to the cache, then hash each sequence's whole context."""
        assert embeds is None
        ids, pos, slots = input_ids.numpy(), positions.numpy(), meta.slot_mapping.numpy()
        assert ((slots >= 0) & (slots < self.num_slots)).all()
        self.cached_token[slots] = ids
        self.cached_position[slots] = pos
        starts = meta.query_start_loc.numpy()
        hidden = torch.zeros(len(ids), 1)  # [num_tokens, 1]: next token id at each sequence's end
        for i, seq_len in enumerate(meta.seq_lens.tolist()):
            first, end = starts[i], starts[i + 1]
            context = np.arange(seq_len)
            assert (pos[first:end] == context[seq_len - (end - first) :]).all()
            table = meta.block_tables[i].numpy()
            context_slots = table[context // self.block_size] * self.block_size
            context_slots += context % self.block_size
            assert (self.cached_position[context_slots] == context).all()
            hidden[end - 1] = self.next_token(self.cached_token[context_slots])
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, 1] -> [rows, vocab] one-hot, so greedy sampling returns the hashed token."""
        return torch.nn.functional.one_hot(hidden[:, 0].long(), self.vocab_size).float()


def expected_output(model: HashLM, request: Request, max_model_len: int) -> tuple[list[int], str]:
    """The full output the request must get, and why it stops, from replaying the model alone."""
    params, tokens = request.params, []
    limit = min(params.max_tokens, max_model_len - request.num_prompt_tokens)
    while True:
        tokens.append(model.next_token(np.array(request.prompt_token_ids + tokens)))
        if not params.ignore_eos and tokens[-1] == model.eos_id:
            return tokens, "stop"
        if len(tokens) == limit:
            return tokens, "length"


@dataclass(frozen=True)
class Arrival:
    step: int  # engine steps before the request is enqueued
    prompt_len: int  # cut to max_model_len - 1
    max_tokens: int
    ignore_eos: bool
    abort_after: int | None  # steps after its arrival at which it is aborted, if unfinished
    prompt_of: int | None = None  # repeat this arrival's prompt (its first prompt_len tokens)
    priority: int = 0  # under scheduling_policy "priority"

    def prompt(self, index: int, max_model_len: int) -> list[int]:
        """Distinct per request unless `prompt_of` says whose to repeat."""
        index = index if self.prompt_of is None else self.prompt_of
        n = min(self.prompt_len, max_model_len - 1)
        return [(index * 101 + j * 7 + 1) % NUM_MERGED_TOKENS for j in range(n)]


arrivals = st.lists(
    st.builds(
        Arrival,
        step=st.integers(0, 12),
        prompt_len=st.integers(1, 40),
        max_tokens=st.integers(1, 24),
        ignore_eos=st.booleans(),
        abort_after=st.none() | st.integers(0, 30),
    ),
    min_size=1,
    max_size=8,
)


@st.composite
def small_engines(draw: st.DrawFn) -> dict[str, int]:
    """Few blocks, seqs and tokens per step, so prefill is chunked and requests are preempted."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    min_blocks = cdiv(max_model_len, block_size)
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 4)),
        "max_num_batched_tokens": draw(st.integers(1, 32)),
        "max_num_seqs": draw(st.integers(1, 6)),
    }


def watch_scheduler(engine: Engine, finishes: Counter[str], seen: set[str]) -> None:
    """Check every plan against the step limits as it is made, and count each request's finishes."""
    scheduler = engine.scheduler
    schedule, finish = scheduler.schedule, scheduler.finish

    def checked_schedule():
        plan = schedule()
        assert plan.num_tokens <= scheduler.max_num_batched_tokens
        assert len(plan) <= scheduler.max_num_seqs
        assert all(n > 0 for n in plan.num_new_tokens)
        assert len({id(r) for r in plan.requests}) == len(plan)
        assert all(r.status is Status.RUNNING for r in plan.requests)
        if plan.preempted:
            seen.add("preemption")
        if any(r.num_computed_tokens < r.num_tokens for r in plan.requests):
            seen.add("chunked prefill")
        holders = Counter(b for r in scheduler.running for b in r.block_table)
        for copy in plan.copies:  # copy on write: from a cached block into one of the request's
            assert copy.src in scheduler.cache.key_of and copy.src != copy.dst
            assert holders[copy.dst] == 1 and engine.allocator.ref_counts[copy.dst] == 1
            seen.add("copied on write")
        return plan

    def counted_finish(request: Request, reason: str) -> None:
        finishes[request.request_id] += 1
        finish(request, reason)

    scheduler.schedule = checked_schedule
    scheduler.finish = counted_finish


def assert_blocks_rows_and_pending_consistent(engine: Engine, requests: list[Request]) -> None:
    """Every block is free once, or held by as many running requests as its count says (prefix
    caching shares blocks); rows and pending tokens add up."""
    allocator, scheduler = engine.allocator, engine.scheduler
    free = list(allocator.free_queue)
    owned = [b for r in scheduler.running for b in r.block_table]
    holders = np.bincount(owned, minlength=allocator.num_blocks)
    assert (allocator.ref_counts == holders).all()
    assert len(free) == len(set(free)) and set(free) == set(np.flatnonzero(holders == 0).tolist())
    assert len(scheduler.running) <= scheduler.max_num_seqs
    for r in scheduler.running:
        assert r.status is Status.RUNNING
        assert len(r.block_table) == cdiv(r.num_computed_tokens, engine.block_size)
    for r in scheduler.waiting:
        assert r.status is Status.WAITING and not r.block_table and r.num_computed_tokens == 0
    assert all(not r.block_table for r in requests if r.finished)
    rows = engine.builder.running_rows
    assert set(rows.row_of) <= {r.request_id for r in scheduler.running}
    assert sorted(rows.free_rows + list(rows.row_of.values())) == list(
        range(scheduler.max_num_seqs)
    )
    assert len(engine.in_flight) <= (1 if engine.async_batching else 0)
    sampling_rows = sum(int(batch.samples.sum()) for batch in engine.in_flight)
    assert sum(r.num_pending_tokens for r in requests) == sampling_rows
    assert all(r.num_pending_tokens <= 1 for r in requests)


def assert_nothing_leaked(engine: Engine) -> None:
    assert not engine.has_unfinished() and not engine.requests
    assert engine.allocator.num_free == engine.num_blocks
    assert not engine.allocator.ref_counts.any()
    rows = engine.builder.running_rows
    assert sorted(rows.free_rows) == list(range(engine.config.max_num_seqs)) and not rows.row_of


def assert_workload_runs_exactly(engine: Engine, model, workload: list[Arrival]) -> None:
    """Run the workload under `watch_scheduler`: nothing leaks, every request finishes once with
    the model's exact tokens (an aborted one with a prefix of them, shorter than the whole)."""
    finishes: Counter[str] = Counter()
    seen: set[str] = set()
    watch_scheduler(engine, finishes, seen)

    requests, aborted_with = run_workload(engine, workload)

    assert_nothing_leaked(engine)
    assert finishes == dict.fromkeys(requests, 1)
    for rid, request in requests.items():
        tokens, reason = expected_output(model, request, engine.max_model_len)
        if rid in aborted_with:
            n = aborted_with[rid]
            assert n < len(tokens) and request.finish_reason == "abort"
            assert request.output_token_ids == tokens[:n], f"request {rid} grew after its abort"
        else:
            assert (request.output_token_ids, request.finish_reason) == (tokens, reason), rid
    for name in seen:
        event(name)


def run_workload(
    engine: Engine, workload: list[Arrival]
) -> tuple[dict[str, Request], dict[str, int]]:
    """Enqueue and abort as the workload says, checking consistency after every step; returns
    the requests and, for those aborted, how many tokens each had at its abort."""
    requests: dict[str, Request] = {}
    aborted_with: dict[str, int] = {}
    last_arrival = max(a.step for a in workload)
    for step in range(MAX_STEPS):
        if step > last_arrival and not engine.has_unfinished():
            return requests, aborted_with
        for i, arrival in enumerate(workload):
            rid = str(i)
            if arrival.step == step:
                params = SamplingParams(
                    temperature=0, max_tokens=arrival.max_tokens, ignore_eos=arrival.ignore_eos
                )
                prompt = arrival.prompt(i, engine.max_model_len)
                requests[rid] = engine.make_request(
                    rid, params, prompt_token_ids=prompt, priority=arrival.priority
                )
                engine.enqueue(requests[rid])
            due = arrival.abort_after is not None and arrival.step + arrival.abort_after == step
            if due and not requests[rid].finished:
                aborted_with[rid] = len(requests[rid].output_token_ids)
                engine.abort(rid)
        engine.step()
        assert_blocks_rows_and_pending_consistent(engine, list(requests.values()))
    pytest.fail(f"the engine did not finish the workload in {MAX_STEPS} steps")


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@settings(max_examples=80, deadline=None)
@given(limits=small_engines(), workload=arrivals, eos_percent=st.sampled_from([0, 5, 25]))
def test_random_arrivals_aborts_and_eos_leak_no_blocks_and_give_every_request_its_exact_tokens(
    make_tiny, async_batching, limits, workload, eos_percent
):
    config = EngineConfig(
        str(make_tiny("llama")), device="cpu", async_batching=async_batching, **limits
    )
    engine = Engine(config)
    model = engine.runner.model = HashLM(engine, eos_percent)
    assert_workload_runs_exactly(engine, model, workload)


# ---- the real model: async batching changes when tokens are read, never which ----------------

GREEDY_ENGINE = {
    "device": "cpu",
    "max_model_len": 32,
    "block_size": 4,
    "num_blocks": 8,  # one max_model_len sequence: two long requests preempt each other
    "max_num_batched_tokens": 8,  # below most prompts: prefill is chunked
    "max_num_seqs": 3,
}


@dataclass(frozen=True)
class GreedyArrival:
    step: int  # engine steps before the request is enqueued
    prompt: list[int]
    max_tokens: int  # prompt + max_tokens stays within max_model_len
    abort_at: int | None  # output tokens at which it is aborted, the same in both modes


greedy_arrivals = st.lists(
    st.builds(
        GreedyArrival,
        step=st.integers(0, 4),
        prompt=st.lists(st.integers(0, NUM_MERGED_TOKENS - 1), min_size=1, max_size=20),
        max_tokens=st.integers(1, 12),
        abort_at=st.none() | st.integers(1, 11),
    ),
    min_size=2,
    max_size=5,
)


def run_greedy(
    folder: str, workload: list[GreedyArrival], async_batching: bool
) -> dict[str, Request]:
    """Run the workload to the end, aborting each request once it has `abort_at` tokens."""
    engine = Engine(EngineConfig(folder, async_batching=async_batching, **GREEDY_ENGINE))
    requests: dict[str, Request] = {}
    last_arrival = max(a.step for a in workload)
    for step in range(MAX_STEPS):
        if step > last_arrival and not engine.has_unfinished():
            assert_nothing_leaked(engine)
            return requests
        for i, arrival in enumerate(workload):
            if arrival.step == step:
                params = SamplingParams(
                    temperature=0, max_tokens=arrival.max_tokens, ignore_eos=True
                )
                requests[str(i)] = engine.make_request(
                    str(i), params, prompt_token_ids=arrival.prompt
                )
                engine.enqueue(requests[str(i)])
        for rid, request in requests.items():
            abort_at = workload[int(rid)].abort_at
            due = abort_at is not None and len(request.output_token_ids) >= abort_at
            if due and not request.finished:
                engine.abort(rid)
        engine.step()
        assert_blocks_rows_and_pending_consistent(engine, list(requests.values()))
    pytest.fail(f"the engine did not finish the workload in {MAX_STEPS} steps")


@settings(max_examples=25, deadline=None)
@given(workload=greedy_arrivals)
@example(  # always run one workload that preempts: three long requests in 8 blocks
    workload=[
        GreedyArrival(0, list(range(100, 116)), 12, None),
        GreedyArrival(0, list(range(200, 216)), 12, 5),
        GreedyArrival(1, list(range(300, 316)), 12, None),
    ]
)
def test_async_matches_sync_token_for_token_with_arrivals_aborts_and_preemption(
    make_tiny, workload
):
    folder = str(make_tiny("llama"))
    sync = run_greedy(folder, workload, async_batching=False)
    overlapped = run_greedy(folder, workload, async_batching=True)
    outputs = {rid: (r.output_token_ids, r.finish_reason) for rid, r in sync.items()}
    assert {rid: (r.output_token_ids, r.finish_reason) for rid, r in overlapped.items()} == outputs
    if any(r.num_preemptions for r in [*sync.values(), *overlapped.values()]):
        event("preemption")


# ---- preemption by swap: the hash model keeps its tokens in the real KV cache ----------------


class KVHashLM(HashLM):
    """HashLM whose token and position per slot live in the engine's KV cache tensor (layer 0,
    key and value planes, first element of each slot), so swap copies move them like KV."""

    def __init__(self, engine: Engine, eos_percent: int):
        super().__init__(engine, eos_percent)
        cache = engine.kv_caches[0]  # [2, num_blocks + 1, block_size, kv_heads, head_dim]
        assert cache.dtype == torch.float32 and cache.is_contiguous()
        planes = cache.numpy()
        slot_stride = planes.strides[2]  # one slot to the next, across block boundaries too
        self.cached_token, self.cached_position = (
            np.lib.stride_tricks.as_strided(planes[i], (self.num_slots,), (slot_stride,))
            for i in range(2)
        )
        self.cached_token[:] = -1
        self.cached_position[:] = -1


def swapping_engine(make_tiny, async_batching: bool, limits: dict, host_blocks: int, **options):
    """An engine of the tiny llama that preempts by swap into about `host_blocks` host blocks."""
    folder = make_tiny("llama")
    cfg = ModelConfig.from_hf(read_hf_config(str(folder))[0])
    per_block = bytes_per_block(cfg, limits["block_size"], torch.float32)
    config = EngineConfig(
        str(folder),
        device="cpu",
        async_batching=async_batching,
        preemption_mode="swap",
        swap_space=(host_blocks + 0.5) * per_block / 2**30,
        **limits,
        **options,
    )
    return Engine(config)


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@settings(max_examples=40, deadline=None)
@given(
    limits=small_engines(),
    workload=arrivals,
    eos_percent=st.sampled_from([0, 5]),
    host_blocks=st.sampled_from([0, 3, 64]),  # none, a few (recompute takes over), plenty
)
def test_with_swapping_no_block_leaks_on_device_or_host_and_every_request_gets_its_tokens(
    make_tiny, async_batching, limits, workload, eos_percent, host_blocks
):
    engine = swapping_engine(make_tiny, async_batching, limits, host_blocks)
    swap = engine.scheduler.swap
    assert swap.host.num_blocks == min(
        host_blocks, limits["max_num_seqs"] * cdiv(limits["max_model_len"], limits["block_size"])
    )
    model = engine.runner.model = KVHashLM(engine, eos_percent)
    finishes: Counter[str] = Counter()
    watch_scheduler(engine, finishes, set())
    step = engine.step

    def checked_step():
        out = step()
        held = np.zeros(swap.host.num_blocks, dtype=np.int32)
        for request in engine.scheduler.swapped:
            held[request.host_blocks] += 1
        assert (swap.host.ref_counts == held).all(), "host reference counts off"
        assert swap.host.num_free == int((held == 0).sum()) <= swap.host.num_blocks
        return out

    engine.step = checked_step
    requests, aborted_with = run_workload(engine, workload)

    assert_nothing_leaked(engine)
    assert not swap.host.ref_counts.any() and swap.host.num_free == swap.host.num_blocks
    assert not swap.host_of and not swap.device_of
    assert finishes == dict.fromkeys(requests, 1)
    for rid, request in requests.items():
        tokens, reason = expected_output(model, request, engine.max_model_len)
        if rid in aborted_with:
            assert request.output_token_ids == tokens[: aborted_with[rid]]
        else:
            assert (request.output_token_ids, request.finish_reason) == (tokens, reason), rid
    if swap.num_swapped_out:
        event("swapped")
    if engine.scheduler.num_preemptions > swap.num_swapped_out:
        event("recomputed")


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@settings(max_examples=40, deadline=None)
@given(
    limits=small_engines(),
    workload=arrivals,
    num_prompts=st.integers(1, 3),
    num_blocks=st.integers(1, 6),
)
def test_repeated_block_aligned_prompts_copied_on_write_leak_nothing_and_get_their_tokens(
    make_tiny, async_batching, limits, workload, num_prompts, num_blocks
):
    """The hash model keeps its tokens in the real KV cache, so a block copied on write must
    carry them: arrivals repeat a few prompts of whole blocks (and prefixes of them)."""
    config = EngineConfig(
        str(make_tiny("llama")), device="cpu", async_batching=async_batching, **limits
    )
    engine = Engine(config)
    model = engine.runner.model = KVHashLM(engine, 0)
    aligned = num_blocks * limits["block_size"]
    workload = [
        replace(a, prompt_of=i % num_prompts, prompt_len=aligned if i % 2 else a.prompt_len)
        for i, a in enumerate(workload)
    ]
    assert_workload_runs_exactly(engine, model, workload)


# ---- scheduling_policy "priority" ------------------------------------------------------------


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@settings(max_examples=40, deadline=None)
@given(
    limits=small_engines(),
    workload=arrivals,
    priorities=st.lists(st.integers(-2, 2), min_size=8, max_size=8),
    host_blocks=st.sampled_from([0, 64]),  # recompute alone, or swapping
)
def test_under_priority_scheduling_the_queues_keep_their_order_and_every_request_its_tokens(
    make_tiny, async_batching, limits, workload, priorities, host_blocks
):
    """The hash model keeps its tokens in the real KV cache, so swapped requests carry them."""
    engine = swapping_engine(
        make_tiny, async_batching, limits, host_blocks, scheduling_policy="priority"
    )
    model = engine.runner.model = KVHashLM(engine, 5)
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def ordered_schedule():
        plan = schedule()
        for requests in (scheduler.running, scheduler.waiting, scheduler.swapped):
            order = [(r.priority, r.arrival) for r in requests]
            assert order == sorted(order)
        return plan

    scheduler.schedule = ordered_schedule
    workload = [replace(a, priority=p) for a, p in zip(workload, priorities, strict=False)]
    assert_workload_runs_exactly(engine, model, workload)
    if scheduler.swap.num_swapped_out:
        event("swapped")
