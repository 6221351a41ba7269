"""Prefix caching: same tokens as without it and as transformers, exact hit counts, and block
accounting that holds under random arrivals, shared prefixes, aborts, preemptions and evictions."""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.kv_cache import BlockAllocator
from tandem.prefix_cache import ROOT_KEY, PrefixCache, block_key
from tandem.queues import by_priority
from tandem.request import Request, Status
from tandem.scheduler import Scheduler
from tandem.swap import SwapManager

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def shared_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat and overlap: a 21-token head shared by five, exact repeats, prompts
    that are a prefix of another, and two strangers. The first four go in one call, the rest in
    a second. Three end on a block boundary (block_size=4) with every block cached, so their
    last block is copied on write: `c` again in the same call as `c`, and `c` and `b[:20]` in
    the second."""
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, vocab, (21,), generator=g).tolist()

    def tail(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    a, b, c = head + tail(5), head + tail(11), head + tail(3)
    return [a, b, c, list(c), head, tail(9), b[:17], tail(30), list(a), list(c), b[:20]]


@functools.cache
def reference(folder: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.vocab_size - 1,
    )
    return out[0, len(prompt) :].tolist()


def generate(folder, prompts, caching: bool, **engine_args):
    llm = LLM(folder, enable_prefix_caching=caching, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    later = llm.generate([{"prompt_token_ids": p} for p in prompts[4:]], params, use_tqdm=False)
    assert llm.engine.allocator.num_free == llm.engine.num_blocks  # nothing held after the calls
    return llm, [o.outputs[0].token_ids for o in first + later]


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_blocks=64, max_model_len=128),
        # chunked prefill across cached blocks
        dict(num_blocks=64, max_model_len=128, max_num_batched_tokens=8),
        # preemption and eviction: 48 token slots for prompts of up to 30 tokens plus 12
        dict(num_blocks=12, max_model_len=48, max_num_batched_tokens=16),
    ],
    ids=["roomy", "chunked", "preempting"],
)
def test_greedy_tokens_with_caching_equal_without_and_transformers(
    make_tiny, async_batching, engine_args
):
    folder = str(make_tiny("llama"))
    args = dict(block_size=4, async_batching=async_batching, **engine_args)
    cached_llm, cached = generate(folder, shared_prompts(512), True, **args)
    _, plain = generate(folder, shared_prompts(512), False, **args)

    assert cached == plain
    for prompt, tokens in zip(shared_prompts(512), cached, strict=True):
        assert tokens == reference(folder, tuple(prompt), 12)
    assert cached_llm.engine.scheduler.cache.num_hit_tokens > 0
    assert cached_llm.engine.scheduler.num_block_copies > 0
    if engine_args["num_blocks"] == 12:
        assert cached_llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("cache_salt", [None, "tenant"], ids=["unsalted", "salted"])
@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_n_samples_prefill_their_prompt_once(make_tiny, async_batching, cache_salt):
    folder = str(make_tiny("llama"))
    llm = LLM(folder, block_size=4, num_blocks=128, max_model_len=64, async_batching=async_batching)
    scheduled = []
    schedule = llm.engine.scheduler.schedule

    def counting_schedule():
        plan = schedule()
        scheduled.append(plan.num_tokens)
        return plan

    llm.engine.scheduler.schedule = counting_schedule
    prompt = list(range(7, 37))  # 30 tokens: 7 full blocks of 4 and 2 tokens over
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    salted = {"prompt_token_ids": prompt, "cache_salt": cache_salt}
    out = llm.generate(salted, params, use_tqdm=False)[0]

    # the first sample computes the prompt; each other one only the 2 tokens past its 7 cached
    # blocks (the samples share their prompt's salt)
    assert sum(scheduled) == 30 + 3 * 2 + 4 * 5
    alone = LLM(folder, block_size=4, num_blocks=128, max_model_len=64, enable_prefix_caching=False)
    plain = alone.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds stay per sample
    # later, a request of another salt finds none of those blocks, one of the same salt all 7
    again = [{"prompt_token_ids": prompt, "cache_salt": s} for s in ("other", cache_salt)]
    outs = llm.generate(again, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 28]


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_n_samples_of_a_block_aligned_prompt_compute_only_its_last_token(make_tiny, async_batching):
    folder = str(make_tiny("llama"))
    args = dict(block_size=4, num_blocks=128, max_model_len=64, async_batching=async_batching)
    llm = LLM(folder, **args)
    scheduled: list[dict[str, int]] = []  # per step: request id -> tokens computed
    schedule = llm.engine.scheduler.schedule

    def counting_schedule():
        plan = schedule()
        scheduled.append(
            {r.request_id: n for r, n in zip(plan.requests, plan.num_new_tokens, strict=True)}
        )
        return plan

    llm.engine.scheduler.schedule = counting_schedule
    prompt = list(range(7, 39))  # 32 tokens: 8 full blocks of 4
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]

    # the first sample computes the prompt; the others wait one step for its last block, then
    # each computes its last token alone, in a copy of that block
    first, second = scheduled[0], scheduled[1]
    assert list(first.values()) == [32]
    assert sorted(second.values()) == [1, 1, 1, 1]
    assert sum(n for step in scheduled for n in step.values()) == 32 + 3 * 1 + 4 * 5
    assert llm.engine.scheduler.num_block_copies == 3
    assert out.num_cached_tokens == 0  # the first sample's
    cache = llm.engine.scheduler.cache
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (4 * 32, 3 * 31)
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    plain = LLM(folder, **args, enable_prefix_caching=False)
    alone = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds stay per sample


def test_num_cached_tokens_counts_whole_blocks_of_the_prompt(make_tiny):
    folder = str(make_tiny("llama"))
    llm = LLM(folder, block_size=4, num_blocks=10, max_model_len=40)  # 40 token slots
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def run(prompt):
        """(num_cached_tokens, num_cache_creation_tokens): vLLM's second is the prompt tokens
        in full blocks (written to the cache) less those found there."""
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        return out.num_cached_tokens, out.num_cache_creation_tokens

    assert run(list(range(1, 11))) == (0, 8)  # first time: nothing cached; 2 full blocks written
    # the same 10 tokens: 2 full blocks cached (the third holds tokens 8-9 only, never cached)
    assert run(list(range(1, 11))) == (8, 0)
    # 12 tokens, a multiple of the block size: 2 blocks again, the first request's only (its
    # third block held 2 tokens); the third is written now
    assert run(list(range(1, 13))) == (8, 4)
    # the same 12: the block of the last prompt token is cached whole now, so it is copied on
    # write and only that token computed (and written: vLLM counts it so too)
    cache = llm.engine.scheduler.cache
    queried, hits = cache.num_queried_tokens, cache.num_hit_tokens
    assert run(list(range(1, 13))) == (11, 1)
    assert (cache.num_queried_tokens - queried, cache.num_hit_tokens - hits) == (12, 11)
    assert llm.engine.scheduler.num_block_copies == 1
    # a prompt that parts after 5 tokens: one shared block, its second written
    assert run([1, 2, 3, 4, 5, 99, 98, 97, 96]) == (4, 4)
    # 36 other tokens need 9 of the 10 blocks: every cached block of range(1, 13) is evicted
    assert run(list(range(100, 136))) == (0, 36)
    assert run(list(range(1, 11))) == (0, 8)
    # caching off: nothing found, nothing written
    plain = LLM(folder, block_size=4, num_blocks=10, max_model_len=40, enable_prefix_caching=False)
    out = plain.generate({"prompt_token_ids": list(range(1, 11))}, params, use_tqdm=False)[0]
    assert (out.num_cached_tokens, out.num_cache_creation_tokens) == (0, 0)


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_requests_share_cached_blocks_only_with_requests_of_their_cache_salt(
    make_tiny, async_batching
):
    """vLLM's cache_salt: a salted prompt hits only blocks cached under its salt; no salt shares
    with no salt alone. The tokens stay those of an uncached run and of transformers."""
    folder = str(make_tiny("llama"))
    args = dict(block_size=4, num_blocks=64, max_model_len=40, async_batching=async_batching)
    llm = LLM(folder, **args)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks can be cached

    def run(*salts):
        prompts = [{"prompt_token_ids": prompt, "cache_salt": s} for s in salts]
        return llm.generate(prompts, params, use_tqdm=False)

    # in one call: "b" right after an equal prompt of "a" (so not taking a's keys), then "a"
    outs = run("a", "b", "a") + run("a", "b", "c", None) + run(None)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 8, 8, 8, 0, 0, 8]
    want = reference(folder, tuple(prompt), 6)
    plain = LLM(folder, **args, enable_prefix_caching=False).generate(
        {"prompt_token_ids": prompt}, params, use_tqdm=False
    )[0]
    assert plain.outputs[0].token_ids == want
    assert all(o.outputs[0].token_ids == want for o in outs)
    assert llm.engine.allocator.num_free == llm.engine.num_blocks


@pytest.mark.parametrize("salt", ["", 5, b"a", ["a"]], ids=["empty", "int", "bytes", "list"])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_value_error(make_tiny, salt):
    llm = LLM(str(make_tiny("llama")), block_size=4, num_blocks=16, max_model_len=32)
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 2, 3], "cache_salt": salt}]
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_skip_reading_prefix_cache_computes_the_prompt_and_still_publishes_it(make_tiny):
    """vLLM's SamplingParams.skip_reading_prefix_cache: such a request takes no cached block
    (the same tokens as an uncached run) while its own blocks serve the requests after it; it
    defaults to True with prompt_logprobs, False otherwise."""
    folder = str(make_tiny("llama"))
    llm = LLM(folder, block_size=4, num_blocks=32, max_model_len=40)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    skipping = replace(greedy, skip_reading_prefix_cache=True)
    prompt = {"prompt_token_ids": list(range(1, 11))}  # 2 full blocks can be cached

    def run(params):
        return llm.generate(prompt, params, use_tqdm=False)[0]

    first, skipped, read = run(skipping), run(skipping), run(greedy)
    assert [o.num_cached_tokens for o in (first, skipped, read)] == [0, 0, 8]
    want = reference(folder, tuple(prompt["prompt_token_ids"]), 3)
    assert all(o.outputs[0].token_ids == want for o in (first, skipped, read))
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert greedy.skip_reading_prefix_cache is False
    with pytest.raises(ValueError, match="skip_reading_prefix_cache must be True or False"):
        SamplingParams(skip_reading_prefix_cache="yes")


def test_disabled_cache_never_hits(make_tiny):
    llm = LLM(
        str(make_tiny("llama")),
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=2)
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": list(range(1, 20))}, params, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0


def test_enable_prefix_caching_must_be_a_bool(make_tiny):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(str(make_tiny("llama")), enable_prefix_caching="yes")


def test_block_keys_chain_their_parents():
    first = block_key(ROOT_KEY, [1, 2, 3, 4])
    assert block_key(first, [5, 6]) != block_key(block_key(ROOT_KEY, [9, 2, 3, 4]), [5, 6])
    assert block_key(first, [5, 6]) == block_key(block_key(ROOT_KEY, [1, 2, 3, 4]), [5, 6])
    assert block_key(first, [5, 6], extra=b"adapter-1") != block_key(first, [5, 6])


def test_request_keys_chain_block_keys_across_prompt_and_outputs():
    """PrefixCache.keys turns a run of blocks' tokens into bytes at once: the same keys as
    block_key block by block, over prompt blocks, a block that spans prompt and outputs, and a
    memo extended in two calls."""
    cache = PrefixCache(BlockAllocator(8), 4)
    params = SamplingParams(max_tokens=8)
    request = Request("r", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], params, seed=0)
    request.output_token_ids = [5, 8, 9, 7]
    tokens = request.prompt_token_ids + request.output_token_ids
    expected = [block_key(ROOT_KEY, tokens[:4])]
    for index in (1, 2):
        expected.append(block_key(expected[-1], tokens[4 * index : 4 * index + 4]))
    assert cache.keys(request, 1) == expected[:1]
    assert cache.keys(request, 3) == expected
    assert cache.keys(Request("s", tokens, params, seed=0), 3) == expected


def test_samples_of_one_prompt_matched_in_turn_hash_its_blocks_once(monkeypatch):
    """A request matched right after one with an equal prompt takes that one's prompt keys
    (the n samples of a prompt); the keys equal block_key's, and any other prompt, or a
    request matched with outputs, is hashed from its own tokens."""
    from tandem import prefix_cache

    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    expected = [block_key(ROOT_KEY, prompt[:4])]
    expected.append(block_key(expected[0], prompt[4:8]))
    hashed = []
    chained = prefix_cache.chained_key
    monkeypatch.setattr(prefix_cache, "chained_key", lambda *a: hashed.append(1) or chained(*a))
    cache = PrefixCache(BlockAllocator(8), 4)
    params = SamplingParams(max_tokens=8)
    samples = [Request(f"s{k}", list(prompt), params, seed=k) for k in range(3)]
    for sample in samples:
        cache.match(sample)
        assert sample.block_keys == expected
    assert len({id(sample.block_keys) for sample in samples}) == 3  # each extends its own
    assert len(hashed) == 2  # the prompt's two full blocks, once
    other = Request("o", [3, 1, 4, 1, 5, 9, 2, 7, 5, 3], params, seed=0)
    cache.match(other)
    assert other.block_keys[0] == expected[0] and other.block_keys[1] != expected[1]
    assert len(hashed) == 4
    samples[0].output_token_ids = [8, 8, 8, 8, 8, 8]  # 16 tokens: 4 full blocks
    cache.match(samples[0])  # its memo extended over its outputs
    late = Request("l", list(prompt), params, seed=9)
    cache.match(late)
    assert late.block_keys == expected  # the prompt's keys only, none of the outputs'
    assert len(hashed) == 6


def test_a_cache_salt_is_the_first_blocks_extra_key_and_parts_the_whole_chain():
    """A salted request's first key takes the salt as its extra key, and every later key chains
    from it; a request matched right after an equal prompt of another salt hashes its own."""
    cache = PrefixCache(BlockAllocator(8), 4)
    params = SamplingParams(max_tokens=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    expected = [block_key(ROOT_KEY, prompt[:4], extra=b"tenant")]
    expected.append(block_key(expected[0], prompt[4:8]))
    salted = Request("s", list(prompt), params, seed=0, cache_salt="tenant")
    cache.match(salted)
    assert salted.block_keys == expected
    for salt in (None, "other"):
        request = Request(f"{salt}", list(prompt), params, seed=0, cache_salt=salt)
        cache.match(request)
        assert not set(request.block_keys) & set(expected)
    again = Request("again", list(prompt), params, seed=0, cache_salt="tenant")
    cache.match(again)
    assert again.block_keys == expected


# ---- scheduler-level properties -------------------------------------------------------------

BLOCK = 4


class Simulation:
    """Drives the scheduler as the engine does (sync), writing each scheduled token's id into a
    fake KV cache at its slot, so that what a block holds can be checked against what its keys
    and its owners say it holds."""

    def __init__(
        self,
        num_blocks: int,
        budget: int,
        rng: random.Random,
        num_host_blocks: int | None = None,
        policy: str = "fcfs",
    ):
        """With `num_host_blocks`, preemption swaps to that many host blocks while they last;
        under the "priority" policy, requests take random priorities."""
        self.allocator = BlockAllocator(num_blocks)
        swap = None
        if num_host_blocks is not None:
            swap = SwapManager(self.allocator, num_host_blocks, "swap")
        self.scheduler = Scheduler(self.allocator, BLOCK, 6, budget, 64, swap=swap, policy=policy)
        self.kv = np.full(num_blocks * BLOCK, -1, dtype=np.int64)  # token id per cache slot
        self.host_kv = np.full((num_host_blocks or 0) * BLOCK, -1, dtype=np.int64)  # per host slot
        self.reused: set[int] = set()  # blocks handed to a new owner in this step
        evict = self.allocator.on_reuse

        def reuse(block: int) -> None:
            self.reused.add(block)
            evict(block)

        self.allocator.on_reuse = reuse
        self.rng = rng
        self.live: list[Request] = []
        self.next_id = 0
        self.num_copies = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = Request(str(self.next_id), prompt, params, seed=0)
        if self.scheduler.priority:
            request.priority = self.rng.randrange(-2, 3)
        self.next_id += 1
        self.scheduler.add(request)
        self.live.append(request)

    def step(self) -> None:
        published_before = set(self.scheduler.cache.key_of)
        self.reused.clear()
        plan = self.scheduler.schedule()
        ones = [n == 1 for n in plan.num_new_tokens]
        assert ones == sorted(ones, reverse=True), "a one-token row behind a longer one"
        self.copy_swapped_blocks()  # before the step writes, as the engine orders them
        self.copy_on_write(plan, published_before)  # then the block copies, as the runner does
        for request, num_new in zip(plan.requests, plan.num_new_tokens, strict=True):
            for pos in range(request.num_computed_tokens - num_new, request.num_computed_tokens):
                block = request.block_table[pos // BLOCK]
                # a published block is read, never written again, until it is evicted
                assert block not in published_before or block in self.reused, f"wrote {block}"
                self.kv[block * BLOCK + pos % BLOCK] = request.tokens(pos, pos + 1)[0]
        for request in plan.requests:
            if (
                request.status is Status.RUNNING
                and request.num_computed_tokens == request.num_tokens
            ):
                request.output_token_ids.append(self.rng.randrange(50))
                if len(request.output_token_ids) >= request.params.max_tokens:
                    self.finish(request, "length")

    def copy_on_write(self, plan, published_before: set[int]) -> None:
        """Check each copy against its invariants, then copy the fake KV."""
        holders = Counter(b for r in self.scheduler.running for b in r.block_table)
        num_new = {id(r): n for r, n in zip(plan.requests, plan.num_new_tokens, strict=True)}
        for copy in plan.copies:
            # the source: written by an earlier step (published before this one), not reused
            assert copy.src in published_before and copy.src not in self.reused
            # the destination: a new block that only the request copying into it holds
            assert copy.dst in self.reused and holders[copy.dst] == 1
            assert self.allocator.ref_counts[copy.dst] == 1
            [request] = [r for r in self.scheduler.running if copy.dst in r.block_table]
            # ... its last block, where it computes its last token alone
            assert request.block_table[-1] == copy.dst and num_new[id(request)] == 1
            assert request.num_computed_tokens == request.num_tokens
            assert request.num_tokens % BLOCK == 0
            src = slice(copy.src * BLOCK, (copy.src + 1) * BLOCK)
            self.kv[copy.dst * BLOCK : (copy.dst + 1) * BLOCK] = self.kv[src]
            self.num_copies += 1

    def copy_swapped_blocks(self) -> None:
        for copy in self.scheduler.swap.take_copies():
            device = slice(copy.device_block * BLOCK, (copy.device_block + 1) * BLOCK)
            host = slice(copy.host_block * BLOCK, (copy.host_block + 1) * BLOCK)
            if copy.out:
                self.host_kv[host] = self.kv[device]
            else:
                self.kv[device] = self.host_kv[host]

    def check_swapped(self) -> None:
        """Host blocks are held as their counts say, never beyond the pool, and hold (or their
        device block still holds) each swapped request's tokens."""
        swap = self.scheduler.swap
        held = np.zeros(swap.host.num_blocks, dtype=np.int32)
        for request in self.scheduler.swapped:
            assert request.status is Status.SWAPPED and not request.block_table
            assert len(request.host_blocks) == -(-request.num_computed_tokens // BLOCK)
            held[request.host_blocks] += 1
            for pos in range(request.num_computed_tokens):
                host_block = request.host_blocks[pos // BLOCK]
                if host_block in swap.device_of:
                    token = self.kv[swap.device_of[host_block] * BLOCK + pos % BLOCK]
                else:
                    assert host_block in swap.on_host, "a swapped block is nowhere"
                    token = self.host_kv[host_block * BLOCK + pos % BLOCK]
                assert token == request.tokens(pos, pos + 1)[0], "swapped KV of another sequence"
        assert (swap.host.ref_counts == held).all(), "host reference counts off"
        free = list(swap.host.free_blocks)
        assert len(free) == len(set(free)) and set(free) == set(np.flatnonzero(held == 0).tolist())
        assert {b: h for h, b in swap.device_of.items()} == swap.host_of
        assert set(swap.device_of) | swap.on_host <= set(np.flatnonzero(held).tolist())

    def abort_one(self) -> None:
        alive = [r for r in self.live if not r.finished]
        if alive:
            self.finish(self.rng.choice(alive), "abort")

    def finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self.live.remove(request)

    def check(self) -> None:
        scheduler = self.scheduler
        if scheduler.priority:  # the queues, and running itself, in (priority, arrival) order
            for requests in (scheduler.running, scheduler.waiting, scheduler.swapped):
                order = [by_priority(r) for r in requests]
                assert order == sorted(order)
        held = np.zeros(self.allocator.num_blocks, dtype=np.int32)
        for request in self.scheduler.running:
            held[request.block_table] += 1
            for pos in range(request.num_computed_tokens):
                slot = request.block_table[pos // BLOCK] * BLOCK + pos % BLOCK
                assert self.kv[slot] == request.tokens(pos, pos + 1)[0], "KV of another sequence"
        assert (self.allocator.ref_counts == held).all(), "reference counts off"
        free = list(self.allocator.free_queue)
        assert len(free) == len(set(free)) and set(free) == set(np.flatnonzero(held == 0).tolist())
        cache = self.scheduler.cache
        for key, block in cache.block_of.items():
            assert cache.key_of[block] == key
        self.check_swapped()


def test_one_token_rows_lead_the_step_before_a_prompts_last_chunk():
    """Two block-aligned prompts, two samples each, a budget of 10 tokens: the second step runs
    the first prompt's decode, its second sample's last token (a copy of its cached block) and
    the rest of the second prompt. The two one-token rows lead, though the scheduler plans the
    running chunk before it admits the sample."""
    scheduler = Scheduler(BlockAllocator(16), BLOCK, 8, 10, 64)
    requests = []
    for prompt in ([1] * 8, [2] * 8):
        for sample in range(2):
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            requests.append(Request(f"{prompt[0]}-{sample}", prompt, params, seed=sample))
            scheduler.add(requests[-1])
    first = scheduler.schedule()
    # the first prompt whole; its second sample waits (its copy's source is written in this
    # step); the second prompt's first 2 tokens
    assert [r.request_id for r in first.requests] == ["1-0", "2-0"]
    assert first.num_new_tokens == [8, 2]
    requests[0].output_token_ids.append(5)
    second = scheduler.schedule()
    assert [r.request_id for r in second.requests] == ["1-0", "1-1", "2-0"]
    assert second.num_new_tokens == [1, 1, 6]
    assert [(c.src, c.dst) for c in second.copies] == [
        (requests[0].block_table[1], requests[1].block_table[1])
    ]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(8, 24),
    budget=st.sampled_from([3, 8, 64]),
)
@pytest.mark.parametrize(
    "num_host_blocks", [None, 0, 6, 64], ids=["recompute", "no-room", "6", "64"]
)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_blocks_stay_accounted_and_hold_their_owners_tokens(
    seed, num_blocks, budget, num_host_blocks, policy
):
    """With swapping too: no leak on the device or the host, the host pool never exceeded
    (recompute takes over when it is full), every swapped block's tokens kept; under either
    scheduling policy."""
    rng = random.Random(seed)
    sim = Simulation(num_blocks, budget, rng, num_host_blocks, policy)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    max_new = 8 if num_host_blocks is None else 40  # longer outputs: more preemption
    for _ in range(60):
        if rng.random() < 0.4:
            prompt = rng.choice(heads)[: rng.randrange(1, 14)] + [
                rng.randrange(50) for _ in range(rng.randrange(0, 6))
            ]
            sim.add(prompt or [1], rng.randrange(1, max_new))
        if rng.random() < 0.1:
            sim.abort_one()
        sim.step()
        sim.check()
    for request in list(sim.live):
        sim.finish(request, "abort")
    assert sim.allocator.num_free == num_blocks and not sim.allocator.ref_counts.any()
    swap = sim.scheduler.swap
    assert swap.host.num_free == swap.host.num_blocks and not swap.host.ref_counts.any()
    assert not swap.host_of and not swap.device_of and not swap.on_host
    if sim.num_copies:
        event("copied on write")


def test_n_beyond_what_the_cache_can_hold_for_one_prompt_names_the_limit(make_tiny):
    llm = LLM(str(make_tiny("llama")), block_size=4, num_blocks=16, max_model_len=64)
    # a 20-token prompt: 4 shared blocks, then 8 own blocks per sample up to 48 tokens: 12 // 8
    params = SamplingParams(n=2, max_tokens=28)
    with pytest.raises(ValueError, match="n can be at most 1"):
        llm.generate({"prompt_token_ids": list(range(20))}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    params = SamplingParams(n=3, max_tokens=4)  # 2 own blocks each: up to 6 samples fit
    out = llm.generate({"prompt_token_ids": list(range(20))}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3


@pytest.mark.parametrize("caching", [True, False])
def test_the_n_limit_counts_no_block_for_the_last_sampled_token(make_tiny, caching):
    """4 prompt tokens and one sampled: KV for 4 tokens, one block per sample, so 4 samples fit
    in 4 blocks at once (without preemption) and 5 do not."""
    llm = LLM(str(make_tiny("llama")), block_size=4, num_blocks=4, max_model_len=16,
              enable_prefix_caching=caching)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(10, 14))}
    with pytest.raises(ValueError, match="n can be at most 4"):
        llm.generate(prompt, SamplingParams(n=5, max_tokens=1), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(n=4, max_tokens=1), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [1] * 4
    assert llm.engine.scheduler.num_preemptions == 0


def test_penalized_requests_compute_every_token_and_match_an_uncached_run(make_tiny):
    """Penalties count the tokens the steps feed (penalties.py): a cached prefix would skip them."""
    folder = str(make_tiny("llama"))
    prompt = {"prompt_token_ids": list(range(3, 40))}
    penalized = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3)
    outputs = {}
    for caching in (True, False):
        llm = LLM(
            folder, block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=caching
        )
        plain = SamplingParams(temperature=0, max_tokens=8)
        llm.generate(prompt, plain, use_tqdm=False)  # caches the prompt's blocks
        out = llm.generate(prompt, penalized, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        outputs[caching] = out.outputs[0].token_ids
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_cache_creation_tokens_are_counted_once_the_chunked_prompt_is_computed(
    make_tiny, async_batching
):
    """A 10-token prompt fed 4 tokens a step: its 2 full blocks (8 tokens) are written, not the
    first chunk's 1; the n samples' output is the first sample's, as num_cached_tokens."""
    folder = str(make_tiny("llama"))
    args = dict(block_size=4, num_blocks=32, max_model_len=40, async_batching=async_batching)
    llm = LLM(folder, **args, max_num_batched_tokens=4, max_num_seqs=4)
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True)
    first, again = (
        llm.generate({"prompt_token_ids": list(range(1, 11))}, params, use_tqdm=False)[0]
        for _ in range(2)
    )
    assert (first.num_cached_tokens, first.num_cache_creation_tokens) == (0, 8)
    assert (again.num_cached_tokens, again.num_cache_creation_tokens) == (8, 0)
